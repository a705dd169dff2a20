// The one in-memory dataset abstraction: all samples live in one tensor (uint8 images or float
// features) plus one targets tensor; a batch is an index_select by a list of indices, never a
// per-example stack. Readers (idx.hpp, cifar.hpp, synthetic.hpp) produce it; BatchPipeline consumes it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/types.h>

namespace ctorch::data {

enum class Split { Train, Test };
// "train" / "test"; anything else throws DataOptionsError naming the value.
Split parseSplit(const std::string& text);
const char* toString(Split split);

enum class Task { Classification, Regression };

// Per-channel mean and standard deviation in [0, 1] pixel units (the torchvision convention:
// x = (pixel / 255 - mean) / std). One value applies to every channel.
struct Normalization {
  std::vector<double> mean;
  std::vector<double> std;

  static Normalization mnist();         // (0.1307, 0.3081)
  static Normalization fashionMnist();  // (0.2860, 0.3530)
  static Normalization cifar10();       // (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
  // Throws DataOptionsError unless sizes are 1 or `channels` and every std is > 0.
  void validate(int64_t channels) const;
  std::string describe() const;         // "mean (0.286) std (0.353)"
};

// Mean and std per channel, computed from images [N, C, ...] (uint8 in 0..255, or float in [0, 1]).
Normalization computeNormalization(const torch::Tensor& images);

struct DatasetInfo {
  std::string name;                      // registry name, e.g. "fashion-mnist"
  Task task = Task::Classification;
  int64_t numClasses = 0;                // 0 for regression
  std::optional<Normalization> normalization;  // how to normalise inputs; none: leave them as they are
  bool recommendsCropFlip = false;       // CIFAR-style augmentation is the usual choice for this data
};

// A batch ready for a model: float inputs, int64 class labels (or float regression targets), and
// the global indices of the samples (what augmentation was keyed on).
struct Batch {
  torch::Tensor inputs;
  torch::Tensor targets;
  torch::Tensor indices;
  int64_t size() const { return indices.defined() ? indices.size(0) : 0; }
};

class InMemoryDataset {
 public:
  // inputs: [N, ...] uint8 (images, 0..255) or floating point; targets: [N] int64 labels or
  // [N, ...] float values. Throws DataOptionsError if the first dimensions differ.
  InMemoryDataset(torch::Tensor inputs, torch::Tensor targets, DatasetInfo info);

  int64_t size() const { return inputs_.size(0); }
  const torch::Tensor& inputs() const { return inputs_; }
  const torch::Tensor& targets() const { return targets_; }
  const DatasetInfo& info() const { return info_; }
  // Shape of one sample, e.g. {1, 28, 28} or {20}.
  std::vector<int64_t> sampleShape() const;

  // The first `n` samples (a view, no copy); n >= size() returns the whole set.
  InMemoryDataset head(int64_t n) const;

  // Raw samples (same dtype as stored) and targets at `indices` (Long [B] or a vector). Throws
  // DataOptionsError naming the first index outside [0, size()).
  Batch select(const torch::Tensor& indices) const;
  Batch select(const std::vector<int64_t>& indices) const;
  // The check select() does: a 1-D Long tensor with every value in [0, size()).
  void checkIndices(const torch::Tensor& indices) const;

 private:
  torch::Tensor inputs_;
  torch::Tensor targets_;
  DatasetInfo info_;
};

// A Long tensor [n] holding `indices` (copied).
torch::Tensor indexTensor(const std::vector<int64_t>& indices);

} // namespace ctorch::data
