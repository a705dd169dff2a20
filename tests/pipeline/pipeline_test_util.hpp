// The pipeline tests' model, optimizers, loss and batches, and the one-process reference they are
// compared with (M gradient-accumulation micro-steps, each stage's part under the pipeline's seed).
#pragma once

#include "ctorch/pipeline.hpp"

#include <torch/torch.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace pipeline_test {

constexpr std::uint64_t kSeed = 99;

// Nine children of unequal sizes, two of them dropout.
inline torch::nn::Sequential makeModel() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Dropout(0.2),
                               torch::nn::Linear(32, 24), torch::nn::Tanh(), torch::nn::Linear(24, 16),
                               torch::nn::ReLU(), torch::nn::Dropout(0.1), torch::nn::Linear(16, 3));
}

inline std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
}

inline at::Tensor lossFn(const at::Tensor& output, const at::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

// Step k's batch: 8 rows, the third step 6 (uneven micro-batches, shapes agreed again).
inline std::pair<at::Tensor, at::Tensor> batch(int step, int rows) {
  torch::manual_seed(1234 + step);
  return {torch::randn({rows, 12}), torch::randint(0, 3, {rows}, torch::kLong)};
}
inline int rowsOf(int step) { return step == 2 ? 6 : 8; }

// One process, the same model cut the same way, M micro-steps of gradient accumulation: each stage's
// part of micro-batch m runs under the seed the pipeline gives it. Returns the M losses; gradients
// accumulate scaled by `scale`.
inline std::vector<at::Tensor> referenceStep(std::vector<torch::nn::Sequential>& stages, const at::Tensor& x,
                                             const at::Tensor& y, int M, std::int64_t step, double scale) {
  std::vector<at::Tensor> losses;
  auto xs = x.tensor_split(M, 0), ys = y.tensor_split(M, 0);
  for (int m = 0; m < M; ++m) {
    at::Tensor h = xs[static_cast<std::size_t>(m)];
    for (std::size_t t = 0; t < stages.size(); ++t) {
      torch::manual_seed(ctorch::pipelineMicroBatchSeed(kSeed, step, m, static_cast<int>(t)));
      h = stages[t]->forward(h);
    }
    at::Tensor loss = lossFn(h, ys[static_cast<std::size_t>(m)]);
    losses.push_back(loss.detach());
    (loss / scale).backward();
  }
  return losses;
}

}  // namespace pipeline_test
