// Evaluation split across ranks: each rank takes a contiguous share of the test set (no padding,
// no sample twice), sums loss and correct predictions locally, and one allreduce adds the shares, so
// every rank reports exactly the whole test set's numbers.
#pragma once

#include <ctorch/data/pipeline.hpp>
#include <ctorch/models/model.hpp>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <utility>

namespace ctorch::train {

// The training loss for a model's kind of output: NLL on log-probabilities, cross entropy on
// logits, mean squared error on values. `sum` adds over the batch instead of averaging.
torch::Tensor lossFor(models::ModelOutput output, const torch::Tensor& prediction, const torch::Tensor& target,
                      bool sum = false);

// The name of that loss in the metrics file: "nll", "cross_entropy" (both classification) or "mse"
// (regression), so that a reader tells the task from any record, not from the presence of accuracy.
const char* lossKindName(models::ModelOutput output);

struct EvalTotals {
  double lossSum = 0.0;          // per-sample losses added up
  std::int64_t correct = 0;      // classification only
  std::int64_t count = 0;        // samples evaluated
  bool classification = true;

  double loss() const { return count > 0 ? lossSum / static_cast<double>(count) : 0.0; }
  double accuracy() const { return count > 0 ? static_cast<double>(correct) / static_cast<double>(count) : 0.0; }
};

// Rank `rank`'s share [begin, end) of `size` samples: contiguous, sizes differing by at most one,
// together exactly 0..size-1.
std::pair<std::int64_t, std::int64_t> evalShard(std::int64_t size, std::int64_t rank, std::int64_t worldSize);

// The model's forward as the evaluation calls it (unset: model.forward; a sharded model's goes through
// FullyShardedDataParallel, which gathers its parameters).
using EvalForward = std::function<torch::Tensor(const torch::Tensor&)>;

// One pass over samples [begin, end) in eval mode without gradients (the module's training mode is
// restored afterwards). No communication (but `forward`'s own: a forward that is a collective is
// called at least `forwards` times, on a repeated sample past the range, so that every rank makes as
// many calls as the one with the most batches).
EvalTotals evaluateRange(models::Model& model, const data::BatchPipeline& pipeline, std::int64_t begin,
                         std::int64_t end, std::int64_t batchSize, const torch::Device& device,
                         const EvalForward& forward = {}, std::int64_t forwards = 0);

// Adds the totals of every rank (one allreduce of a float64 tensor on `commDevice`; counts stay
// exact up to 2^53).
EvalTotals allReduceTotals(const EvalTotals& local, c10d::ProcessGroup& group, const torch::Device& commDevice);

// evalShard + evaluateRange + allReduceTotals: the whole test set's totals on every rank.
EvalTotals evaluateDistributed(models::Model& model, const data::BatchPipeline& pipeline, std::int64_t batchSize,
                               const torch::Device& device, c10d::ProcessGroup& group, const EvalForward& forward = {});

}  // namespace ctorch::train
