#include <ctorch/data/registry.hpp>

#include <algorithm>

#include <ctorch/data/cifar.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/data/idx.hpp>
#include <ctorch/data/synthetic.hpp>

namespace ctorch::data {
namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

int64_t syntheticSize(const DatasetOptions& o) {
  if (o.syntheticSize > 0) return o.syntheticSize;
  return o.split == Split::Train ? 2048 : 512;
}

}  // namespace

std::vector<std::string> datasetNames() {
  return {"fashion-mnist", "mnist", "cifar10", "synthetic-regression", "synthetic-images"};
}

void DatasetOptions::validate() const {
  auto names = datasetNames();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    throw DataOptionsError("unknown dataset '" + name + "' (known: " + joined(names) + ")");
  }
  if ((name == "mnist" || name == "cifar10") && root.empty()) {
    throw DataOptionsError("dataset '" + name + "' needs a data directory (root)");
  }
  if (limit < 0) throw DataOptionsError("dataset size limit " + std::to_string(limit) + " must be >= 0");
  if (syntheticSize < 0) {
    throw DataOptionsError("synthetic dataset size " + std::to_string(syntheticSize) + " must be >= 0");
  }
  if (name == "synthetic-images") {
    if (imageShape.size() != 3 || *std::min_element(imageShape.begin(), imageShape.end()) < 1) {
      throw DataOptionsError("synthetic-images shape must be C, H, W with every size >= 1");
    }
    if (numClasses < 2) {
      throw DataOptionsError("synthetic-images classes " + std::to_string(numClasses) + " must be >= 2");
    }
  }
  if (name == "synthetic-regression" && features < 1) {
    throw DataOptionsError("synthetic-regression features " + std::to_string(features) + " must be >= 1");
  }
}

InMemoryDataset loadDataset(const DatasetOptions& options) {
  options.validate();
  auto make = [&]() -> InMemoryDataset {
    DatasetInfo info;
    info.name = options.name;
    info.task = Task::Classification;
    info.numClasses = 10;
    if (options.name == "fashion-mnist") {
      info.normalization = Normalization::fashionMnist();
      return readMnist(options.root.empty() ? std::filesystem::path(kDefaultFashionMnistDir) : options.root,
                       options.split, std::move(info));
    }
    if (options.name == "mnist") {
      info.normalization = Normalization::mnist();
      return readMnist(options.root, options.split, std::move(info));
    }
    if (options.name == "cifar10") {
      info.normalization = Normalization::cifar10();
      info.recommendsCropFlip = true;
      return readCifar10(options.root, options.split, std::move(info));
    }
    if (options.name == "synthetic-regression") {
      return makeSyntheticRegression(syntheticSize(options), options.seed, options.split,
                                     options.features);
    }
    return makeSyntheticImages(syntheticSize(options), options.imageShape, options.numClasses,
                               options.seed, options.split);
  };
  auto dataset = make();
  return options.limit > 0 ? dataset.head(options.limit) : dataset;
}

} // namespace ctorch::data
