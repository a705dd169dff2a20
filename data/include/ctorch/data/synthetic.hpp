// Synthetic datasets, deterministic from a seed: the torchrun tutorial's regression set and random
// images with learnable classes. The train and test splits of one seed are different samples.
#pragma once

#include <cstdint>
#include <vector>

#include <ctorch/data/dataset.hpp>

namespace ctorch::data {

// The tutorial's MyTrainDataset: `size` samples of `features` values uniform in [0, 1) (like
// torch.rand) and `outputs` targets uniform in [0, 1). Inputs float [N, features], targets float
// [N, outputs]. Uses torch's CPU generator, so Python's torch.Generator().manual_seed(s) with
// torch.rand(N, features) then torch.rand(N, outputs) gives the same train split.
InMemoryDataset makeSyntheticRegression(int64_t size, uint64_t seed, Split split = Split::Train,
                                        int64_t features = 20, int64_t outputs = 1);

// Random uint8 images of `shape` (C, H, W) in `numClasses` classes. Each class has a random
// prototype image (shared by both splits); a sample is 3/4 its class prototype and 1/4 noise, so
// models can learn it. Labels uniform.
InMemoryDataset makeSyntheticImages(int64_t size, const std::vector<int64_t>& shape,
                                    int64_t numClasses, uint64_t seed, Split split = Split::Train);

} // namespace ctorch::data
