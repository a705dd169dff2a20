// One optimizer step over a model's parameters (random gradients, set once), torch::optim's step
// against ctorch::optim's multi-tensor (foreach) and fused kernels; run by optim_step.sh beside
// Python's torch.optim (optim_step.py). Prints one line per case:
//   impl=ctorch optimizer=adam kernels=fused params=resnet18 tensors=62 numel=11173962 median_ms=.. min_ms=..
// Usage: optim_step_bench <resnet18|mlp> <steps> [threads=1]
#include <ctorch/models/resnet.hpp>
#include <ctorch/optim.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

std::vector<at::Tensor> parameters(const std::string& which) {
  torch::manual_seed(0);
  if (which == "resnet18") {
    auto model = std::make_shared<ctorch::models::ResNet18>(3, 10);
    std::vector<at::Tensor> out;
    for (auto& p : model->parameters()) out.push_back(p.detach().clone().requires_grad_());
    return out;
  }
  // The ZeRO comparison's share at 2 ranks (bench/zero_memory.cpp's MLP of 6 Linear(4096, 4096)).
  std::vector<at::Tensor> out;
  for (int i = 0; i < 3; ++i) {
    out.push_back(torch::randn({4096, 4096}).requires_grad_());
    out.push_back(torch::randn({4096}).requires_grad_());
  }
  return out;
}

std::unique_ptr<torch::optim::Optimizer> make(const std::string& optimizer, ctorch::optim::Kernels k,
                                              const std::vector<at::Tensor>& ps) {
  using namespace torch::optim;
  if (optimizer == "sgd")
    return std::make_unique<ctorch::optim::SGD>(ps, SGDOptions(0.01).momentum(0.9).weight_decay(5e-4), k);
  if (optimizer == "adamw") return std::make_unique<ctorch::optim::AdamW>(ps, AdamWOptions(1e-3), k);
  return std::make_unique<ctorch::optim::Adam>(ps, AdamOptions(1e-4), k);
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s <resnet18|mlp> <steps> [threads=1]\n", argv[0]);
    return 2;
  }
  const std::string which = argv[1];
  const int steps = std::stoi(argv[2]);
  at::set_num_threads(argc > 3 ? std::stoi(argv[3]) : 1);
  torch::NoGradGuard noGrad;
  for (const std::string optimizer : {"sgd", "adam", "adamw"}) {
    for (auto k : {ctorch::optim::Kernels::kPerParameter, ctorch::optim::Kernels::kForEach,
                   ctorch::optim::Kernels::kFused}) {
      if (k == ctorch::optim::Kernels::kFused &&
          !ctorch::optim::hasFusedKernel(optimizer == "sgd" ? "SGD" : optimizer == "adam" ? "Adam" : "AdamW",
                                         c10::DeviceType::CPU, at::kFloat)) {
        std::printf("impl=ctorch optimizer=%s kernels=fused params=%s not-available\n", optimizer.c_str(), which.c_str());
        continue;
      }
      auto ps = parameters(which);
      std::int64_t numel = 0;
      for (auto& p : ps) {
        p.mutable_grad() = torch::randn_like(p);
        numel += p.numel();
      }
      auto opt = make(optimizer, k, ps);
      opt->step();  // the state is created
      std::vector<double> ms;
      for (int s = 0; s < steps; ++s) {
        const auto start = std::chrono::steady_clock::now();
        opt->step();
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(ms.begin(), ms.end());
      std::printf("impl=ctorch optimizer=%s kernels=%s params=%s tensors=%zu numel=%lld median_ms=%.2f min_ms=%.2f\n",
                  optimizer.c_str(), ctorch::optim::toString(k).c_str(), which.c_str(), ps.size(),
                  static_cast<long long>(numel), ms[ms.size() / 2], ms.front());
    }
  }
  return 0;
}
