// Datasets by name for the trainer: one validated options struct, one factory. Known names:
// fashion-mnist, mnist, cifar10, synthetic-regression, synthetic-images.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <ctorch/data/dataset.hpp>

namespace ctorch::data {

// Where Debian's dataset-fashion-mnist package installs the data: the default for fashion-mnist.
inline const char* const kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct DatasetOptions {
  std::string name = "fashion-mnist";
  std::filesystem::path root;    // data directory; empty: fashion-mnist's default, required for mnist/cifar10
  Split split = Split::Train;
  int64_t limit = 0;             // keep only the first `limit` samples (0: all)
  uint64_t seed = 0;             // synthetic data
  int64_t syntheticSize = 0;     // synthetic: samples in this split (0: 2048 train, 512 test)
  std::vector<int64_t> imageShape{1, 28, 28};  // synthetic-images: C, H, W
  int64_t numClasses = 10;       // synthetic-images
  int64_t features = 20;         // synthetic-regression: inputs per sample
  // Throws DataOptionsError naming the bad value (unknown name, negative limit, ...).
  void validate() const;
};

std::vector<std::string> datasetNames();

// Loads (or generates) the split named by `options`; validates them first.
InMemoryDataset loadDataset(const DatasetOptions& options);

} // namespace ctorch::data
