// Readers for the IDX format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/), plain
// or gzip-compressed (detected from the content, not the name). Every error is a one-line
// DataFileError / DataFormatError naming the file and the expected versus found value.
#pragma once

#include <cstdint>
#include <filesystem>

#include <torch/types.h>

#include <ctorch/data/dataset.hpp>

namespace ctorch::data {

// Magic numbers of the two MNIST files (0x00000803: unsigned byte, 3 dims; 0x00000801: 1 dim).
constexpr uint32_t kIdxImagesMagic = 0x00000803;
constexpr uint32_t kIdxLabelsMagic = 0x00000801;

// Any IDX file: the dtype comes from the type byte (uint8, int8, int16, int32, float, double), the
// shape from the header. Data after the announced size is an error (the file is not what it says).
torch::Tensor readIdx(const std::filesystem::path& file);

// MNIST image file (magic 2051): uint8 [N, 1, rows, cols].
torch::Tensor readIdxImages(const std::filesystem::path& file);
// MNIST label file (magic 2049): int64 [N]; every label must be below `numClasses`.
torch::Tensor readIdxLabels(const std::filesystem::path& file, int64_t numClasses = 10);

struct MnistFiles {
  std::filesystem::path images;
  std::filesystem::path labels;
};

// Finds `train-images-idx3-ubyte[.gz]` / `t10k-...` (also the `train-images.idx3-ubyte` spelling)
// in `dir`, `dir/raw`, `dir/MNIST/raw` or `dir/FashionMNIST/raw` (torchvision's download layout).
// Throws DataFileError naming the directory and the file looked for.
MnistFiles findMnistFiles(const std::filesystem::path& dir, Split split);

// Images and labels of one split; the counts must agree. `info` goes into the dataset unchanged.
InMemoryDataset readMnist(const std::filesystem::path& dir, Split split, DatasetInfo info);

} // namespace ctorch::data
