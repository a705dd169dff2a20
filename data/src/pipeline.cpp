#include <ctorch/data/pipeline.hpp>

#include <torch/torch.h>

#include <ctorch/data/error.hpp>

namespace ctorch::data {

BatchPipeline::BatchPipeline(std::shared_ptr<const InMemoryDataset> dataset, PipelineOptions options)
    : dataset_(std::move(dataset)), options_(std::move(options)) {
  if (!dataset_) throw DataOptionsError("BatchPipeline needs a dataset");
  const auto& inputs = dataset_->inputs();
  if (options_.augment) {
    if (inputs.dim() != 4) {
      throw DataOptionsError("dataset '" + dataset_->info().name +
                             "': crop/flip augmentation needs images [N, C, H, W], samples are " +
                             c10::str(inputs.sizes().slice(1)));
    }
    augment_.emplace(*options_.augment);
  }
  const auto& norm = dataset_->info().normalization;
  const bool normalizing = options_.normalize && norm.has_value();
  torch::NoGradGuard noGrad;

  if (options_.conversion == Conversion::Once) {
    converted_ = toFloat(inputs);
    if (normalizing) converted_ = normalize(converted_, *norm);
    if (augment_) {
      // The crop pads with black pixels before normalisation: the value of a black pixel after it.
      auto black = torch::zeros({1, inputs.size(1), 1, 1}, torch::kFloat);
      fill_ = normalizing ? normalize(black, *norm).view({-1}) : black.view({-1});
    }
  }
}

Batch BatchPipeline::batch(const torch::Tensor& indices, int64_t epoch) const {
  torch::NoGradGuard noGrad;
  Batch out;
  if (converted_.defined()) {
    dataset_->checkIndices(indices);
    out.indices = indices;
    out.inputs = converted_.index_select(0, indices);
    out.targets = dataset_->targets().index_select(0, indices);
    if (augment_) out.inputs = augment_->apply(out.inputs, indices, epoch, fill_);
    return out;
  }
  out = dataset_->select(indices);
  if (augment_) out.inputs = augment_->apply(out.inputs, indices, epoch);
  out.inputs = toFloat(out.inputs);
  const auto& norm = dataset_->info().normalization;
  if (options_.normalize && norm) out.inputs = normalize(out.inputs, *norm);
  return out;
}

Batch BatchPipeline::batch(const std::vector<int64_t>& indices, int64_t epoch) const {
  return batch(indexTensor(indices), epoch);
}

} // namespace ctorch::data
