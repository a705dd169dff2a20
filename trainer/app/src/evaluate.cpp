#include "ctorch/train/evaluate.hpp"

#include <c10/core/InferenceMode.h>
#include <torch/nn/functional/loss.h>

#include <numeric>

namespace ctorch::train {

const char* lossKindName(models::ModelOutput output) {
  switch (output) {
    case models::ModelOutput::LogProbabilities: return "nll";
    case models::ModelOutput::Logits: return "cross_entropy";
    case models::ModelOutput::Values: return "mse";
  }
  return "?";
}

torch::Tensor lossFor(models::ModelOutput output, const torch::Tensor& prediction, const torch::Tensor& target,
                      bool sum) {
  namespace F = torch::nn::functional;
  const auto reduction = sum ? torch::nn::functional::NLLLossFuncOptions::reduction_t(torch::kSum)
                             : torch::nn::functional::NLLLossFuncOptions::reduction_t(torch::kMean);
  const auto ceReduction = sum ? F::CrossEntropyFuncOptions::reduction_t(torch::kSum)
                               : F::CrossEntropyFuncOptions::reduction_t(torch::kMean);
  switch (output) {
    case models::ModelOutput::LogProbabilities:
      return F::nll_loss(prediction, target, F::NLLLossFuncOptions().reduction(reduction));
    case models::ModelOutput::Logits:
      return F::cross_entropy(prediction, target,
                              F::CrossEntropyFuncOptions().reduction(ceReduction));
    case models::ModelOutput::Values: {
      if (!sum) return F::mse_loss(prediction, target);
      // Per-sample mean over the outputs, added over the batch: sum / outputs per sample.
      const auto perSample = prediction.numel() / std::max<std::int64_t>(1, prediction.size(0));
      return F::mse_loss(prediction, target, F::MSELossFuncOptions().reduction(torch::kSum)) /
             static_cast<double>(perSample);
    }
  }
  throw std::logic_error("lossFor: unknown model output");
}

std::pair<std::int64_t, std::int64_t> evalShard(std::int64_t size, std::int64_t rank, std::int64_t worldSize) {
  // The first size % world ranks take one more: begin(r) = r * q + min(r, extra).
  const std::int64_t q = size / worldSize, extra = size % worldSize;
  const std::int64_t begin = rank * q + std::min(rank, extra);
  return {begin, begin + q + (rank < extra ? 1 : 0)};
}

EvalTotals evaluateRange(models::Model& model, const data::BatchPipeline& pipeline, std::int64_t begin,
                         std::int64_t end, std::int64_t batchSize, const torch::Device& device,
                         const EvalForward& forward, std::int64_t forwards) {
  EvalTotals totals;
  totals.classification = model.output() != models::ModelOutput::Values;
  const bool wasTraining = model.is_training();
  model.eval();
  {
    c10::InferenceMode inference;
    double lossSum = 0.0;
    std::int64_t correct = 0;
    for (std::int64_t first = begin; first < end; first += batchSize) {
      const std::int64_t last = std::min(end, first + batchSize);
      const auto batch = pipeline.batch(torch::arange(first, last, torch::kLong));
      const auto inputs = batch.inputs.to(device);
      const auto targets = batch.targets.to(device);
      const auto prediction = forward ? forward(inputs) : model.forward(inputs);
      lossSum += lossFor(model.output(), prediction, targets, /*sum=*/true).item<double>();
      if (totals.classification) correct += prediction.argmax(1).eq(targets).sum().item<std::int64_t>();
      totals.count += last - first;
    }
    for (std::int64_t done = (end - begin + batchSize - 1) / batchSize; done < forwards; ++done) {
      const auto batch = pipeline.batch(torch::zeros({1}, torch::kLong));  // its result is not counted
      forward(batch.inputs.to(device));
    }
    totals.lossSum = lossSum;
    totals.correct = correct;
  }
  model.train(wasTraining);
  return totals;
}

EvalTotals allReduceTotals(const EvalTotals& local, c10d::ProcessGroup& group, const torch::Device& commDevice) {
  std::vector<at::Tensor> tensors{torch::tensor({local.lossSum, static_cast<double>(local.correct),
                                                 static_cast<double>(local.count)},
                                                torch::kFloat64)
                                      .to(commDevice)};
  group.allreduce(tensors)->wait();
  const auto sums = tensors[0].cpu();
  const auto* v = sums.data_ptr<double>();
  EvalTotals total;
  total.classification = local.classification;
  total.lossSum = v[0];
  total.correct = static_cast<std::int64_t>(v[1]);
  total.count = static_cast<std::int64_t>(v[2]);
  return total;
}

EvalTotals evaluateDistributed(models::Model& model, const data::BatchPipeline& pipeline, std::int64_t batchSize,
                               const torch::Device& device, c10d::ProcessGroup& group, const EvalForward& forward) {
  const auto [begin, end] = evalShard(pipeline.size(), group.getRank(), group.getSize());
  // The largest shard's batches: a sharded model's forward is a collective, made as often on every rank.
  const std::int64_t most = (pipeline.size() + group.getSize() - 1) / group.getSize();
  const auto local = evaluateRange(model, pipeline, begin, end, batchSize, device, forward,
                                   forward ? (most + batchSize - 1) / batchSize : 0);
  return allReduceTotals(local, group, device);
}

}  // namespace ctorch::train
