// From sample indices to a batch a model can eat: select -> augment -> float -> normalise, in that
// order (torchvision's order: the crop pads with black pixels before normalisation). Immutable and
// safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <torch/types.h>

#include <ctorch/data/dataset.hpp>
#include <ctorch/data/transforms.hpp>

namespace ctorch::data {

// When uint8 images become normalised floats. Both give bit-identical batches; see docs/data.md for
// which is faster (PerBatch keeps 1/4 of the memory).
enum class Conversion {
  PerBatch,  // keep uint8, convert each batch after index_select
  Once,      // convert the whole dataset to normalised float at construction
};

struct PipelineOptions {
  bool normalize = true;                 // apply the dataset's normalisation (if it has one)
  std::optional<AugmentOptions> augment; // crop + flip (images [N, C, H, W] only)
  Conversion conversion = Conversion::PerBatch;
};

class BatchPipeline {
 public:
  // Throws DataOptionsError if augmentation is asked for non-image data or options are invalid.
  BatchPipeline(std::shared_ptr<const InMemoryDataset> dataset, PipelineOptions options);

  int64_t size() const { return dataset_->size(); }
  const InMemoryDataset& dataset() const { return *dataset_; }
  const PipelineOptions& options() const { return options_; }

  // The batch of samples `indices` for `epoch` (epoch only matters with augmentation).
  Batch batch(const torch::Tensor& indices, int64_t epoch = 0) const;
  Batch batch(const std::vector<int64_t>& indices, int64_t epoch = 0) const;

 private:
  std::shared_ptr<const InMemoryDataset> dataset_;
  PipelineOptions options_;
  std::optional<RandomCropFlip> augment_;
  torch::Tensor converted_;  // Conversion::Once: the normalised float inputs
  torch::Tensor fill_;       // the padding value per channel in the space augmentation runs in
};

} // namespace ctorch::data
