// Per-rank model-state memory and step time of DDP with the whole Adam against DDP with a
// ZeroRedundancyOptimizer (ZeRO-1), on an MLP of ~100 M parameters; run under ctorchrun by
// bench/zero_memory.sh, which prints the table quoted in docs/sharding.md.
// Usage (as each worker): zero_memory_bench <ddp|zero> <layers> <width> <steps>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/zero_redundancy_optimizer.hpp>

#include <torch/torch.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

std::size_t bytesOf(const std::vector<at::Tensor>& tensors) {
  std::size_t n = 0;
  for (const auto& t : tensors)
    if (t.defined()) n += t.nbytes();
  return n;
}

// The whole optimizer's state bytes (Adam: exp_avg and exp_avg_sq per parameter).
std::size_t stateBytes(const torch::optim::Optimizer& optimizer) {
  std::size_t bytes = 0;
  std::function<void(const c10::IValue&)> add = [&](const c10::IValue& v) {
    if (v.isTensor()) bytes += v.toTensor().nbytes();
    else if (v.isGenericDict())
      for (const auto& e : v.toGenericDict()) add(e.value());
  };
  add(ctorch::captureOptimizerState(optimizer).at("state"));
  return bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s <ddp|zero> <layers> <width> <steps>\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const int layers = std::stoi(argv[2]), width = std::stoi(argv[3]), steps = std::stoi(argv[4]);
  torch::set_num_threads(1);
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::minutes(10)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  torch::manual_seed(1);
  torch::nn::Sequential mlp;
  for (int i = 0; i < layers; ++i) mlp->push_back(torch::nn::Linear(width, width));
  ctorch::DistributedDataParallel ddp(mlp, ctorch::DDPOptions().gradientAsBucketView(true));
  std::unique_ptr<torch::optim::Optimizer> whole;
  std::unique_ptr<ctorch::ZeroRedundancyOptimizer> zero;
  auto adam = [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-4)); };
  if (mode == "zero") zero = std::make_unique<ctorch::ZeroRedundancyOptimizer>(ddp.parameters(), adam);
  else whole = adam(ddp.parameters());
  std::vector<double> ms;
  for (int s = 0; s < steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    ddp.zeroGrad();
    const auto x = torch::randn({8, width});
    ddp(x).pow(2).mean().backward();
    if (zero) zero->step();
    else whole->step();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::vector<at::Tensor> grads;
  for (const auto& p : ddp.parameters()) grads.push_back(p.grad());
  const std::size_t optimizer = zero ? zero->localStateBytes() : stateBytes(*whole);
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  std::sort(ms.begin() + 1, ms.end());  // the first step builds the optimizer state: left out
  std::printf("rank=%d world=%d mode=%s params_mb=%.1f grads_mb=%.1f optimizer_mb=%.1f peak_rss_mb=%.1f step_ms=%.0f\n",
              rank, world, mode.c_str(), bytesOf(ddp.parameters()) / 1e6, bytesOf(grads) / 1e6, optimizer / 1e6,
              usage.ru_maxrss / 1024.0, ms.size() > 1 ? ms[1 + (ms.size() - 1) / 2] : ms[0]);
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}
