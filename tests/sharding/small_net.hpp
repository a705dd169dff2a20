// The small model and optimizers the sharding and parameter-server tests train: three Linears of unequal
// sizes (so a packing gives each rank or server a different share), SGD (momentum, weight decay) or Adam.
#pragma once

#include <ctorch/optim.hpp>

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace sharding_test {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", torch::nn::Linear(12, 40));
    b = register_module("b", torch::nn::Linear(40, 24));
    c = register_module("c", torch::nn::Linear(24, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return c(torch::tanh(b(torch::relu(a(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Net);

// "sgd" or "adam": torch::optim's; "sgd:K" or "adam:K": ctorch::optim's with kernels K (auto, fused,
// foreach).
inline std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (const auto colon = kind.find(':'); colon != std::string::npos) {
    const auto kernels = ctorch::optim::kernelsFromString(kind.substr(colon + 1)).value();
    if (kind.substr(0, colon) == "adam")
      return std::make_unique<ctorch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(1e-3), kernels);
    return std::make_unique<ctorch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3),
                                                kernels);
  }
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
}

} // namespace sharding_test
