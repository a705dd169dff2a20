#include <ctorch/data/synthetic.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <ctorch/data/error.hpp>
#include <ctorch/data/transforms.hpp>

namespace ctorch::data {
namespace {

// The train split uses the seed itself (so it matches Python's torch.Generator().manual_seed(seed));
// the test split a seed derived from it, so the two never share samples.
uint64_t splitSeed(uint64_t seed, Split split) {
  return split == Split::Train ? seed : mixBits(seed, 0x7465737400000000ULL /* "test" */, 1);
}

void requirePositive(const char* what, int64_t value) {
  if (value < 1) {
    throw DataOptionsError(std::string(what) + " " + std::to_string(value) + " must be >= 1");
  }
}

}  // namespace

InMemoryDataset makeSyntheticRegression(int64_t size, uint64_t seed, Split split, int64_t features,
                                        int64_t outputs) {
  requirePositive("synthetic-regression size", size);
  requirePositive("synthetic-regression features", features);
  requirePositive("synthetic-regression outputs", outputs);
  auto gen = at::detail::createCPUGenerator(splitSeed(seed, split));
  auto inputs = torch::rand({size, features}, gen, torch::kFloat);
  auto targets = torch::rand({size, outputs}, gen, torch::kFloat);
  DatasetInfo info;
  info.name = "synthetic-regression";
  info.task = Task::Regression;
  return InMemoryDataset(std::move(inputs), std::move(targets), std::move(info));
}

InMemoryDataset makeSyntheticImages(int64_t size, const std::vector<int64_t>& shape,
                                    int64_t numClasses, uint64_t seed, Split split) {
  requirePositive("synthetic-images size", size);
  if (shape.size() != 3 || shape[0] < 1 || shape[1] < 1 || shape[2] < 1) {
    throw DataOptionsError("synthetic-images shape " + c10::str(c10::IntArrayRef(shape)) +
                           " must be [C, H, W] with every size >= 1");
  }
  if (numClasses < 2 || numClasses > 100000) {
    throw DataOptionsError("synthetic-images classes " + std::to_string(numClasses) +
                           " must be in [2, 100000]");
  }
  std::vector<int64_t> all{size, shape[0], shape[1], shape[2]};
  std::vector<int64_t> protoShape{numClasses, shape[0], shape[1], shape[2]};
  // Prototypes depend only on the seed: both splits show the same classes.
  auto protoGen = at::detail::createCPUGenerator(mixBits(seed, 0x70726f746f000000ULL /* "proto" */, 2));
  auto prototypes = torch::randint(0, 256, protoShape, protoGen, torch::kShort);
  auto gen = at::detail::createCPUGenerator(splitSeed(seed, split));
  auto labels = torch::randint(0, numClasses, {size}, gen, torch::kLong);
  auto noise = torch::randint(0, 256, all, gen, torch::kShort);
  auto images = (prototypes.index_select(0, labels) * 3 + noise).div_(4, "floor").to(torch::kByte);
  DatasetInfo info;
  info.name = "synthetic-images";
  info.task = Task::Classification;
  info.numClasses = numClasses;
  // 3/4 uniform + 1/4 uniform pixels: mean 0.5, std sqrt(10/16 / 12) ~ 0.23.
  info.normalization = Normalization{{0.5}, {0.23}};
  return InMemoryDataset(std::move(images), std::move(labels), std::move(info));
}

} // namespace ctorch::data
