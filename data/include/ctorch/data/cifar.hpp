// Reader for CIFAR-10's binary version (https://www.cs.toronto.edu/~kriz/cifar.html): files of
// records of 1 label byte + 3072 pixel bytes (32x32, channel-major R, G, B).
#pragma once

#include <cstdint>
#include <filesystem>
#include <utility>

#include <torch/types.h>

#include <ctorch/data/dataset.hpp>

namespace ctorch::data {

constexpr int64_t kCifarImageBytes = 3 * 32 * 32;
constexpr int64_t kCifarRecordBytes = 1 + kCifarImageBytes;

// One batch file: images uint8 [N, 3, 32, 32], labels int64 [N]. The size must be a positive
// multiple of 3073 bytes and every label below 10.
std::pair<torch::Tensor, torch::Tensor> readCifar10Batch(const std::filesystem::path& file);

// Train: data_batch_1.bin .. data_batch_5.bin, concatenated in that order; test: test_batch.bin.
// Looked for in `dir` and `dir/cifar-10-batches-bin` (the archive's own folder).
InMemoryDataset readCifar10(const std::filesystem::path& dir, Split split, DatasetInfo info);

} // namespace ctorch::data
