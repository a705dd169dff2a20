// The model the FSDP tests train (tests/sharding, tests/cuda): units of their own (a Block with a
// BatchNorm), a unit mixing trainable and frozen parameters, a frozen unit, weights tied across two
// units and parameters left in the root; and the wrap policy that makes those units.
#pragma once

#include "ctorch/fully_sharded_data_parallel.hpp"

#include <torch/torch.h>

#include <string>

namespace fsdp_test {

// A Linear whose weight is another module's (tied weights).
struct SharedLinearImpl : torch::nn::Module {
  explicit SharedLinearImpl(torch::Tensor w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(torch::Tensor x) { return torch::nn::functional::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(SharedLinear);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int in, int out) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    norm = register_module("norm", torch::nn::BatchNorm1d(out));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(norm(fc(x))); }
  torch::nn::Linear fc{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", Block(12, 40));
    b = register_module("b", Block(40, 16));
    tiedA = register_module("tiedA", torch::nn::Linear(16, 16));
    tiedB = register_module("tiedB", SharedLinear(tiedA->weight));
    frozen = register_module("frozen", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
    frozen->weight.requires_grad_(false);
    frozen->bias.requires_grad_(false);
    a->fc->bias.requires_grad_(false);  // unit a: trainable and frozen parameters
  }
  torch::Tensor forward(torch::Tensor x) {
    x = ctorch::unitForward(a, x);
    x = ctorch::unitForward(b, x);
    x = torch::relu(ctorch::unitForward(tiedA, x));
    x = ctorch::unitForward(tiedB, x);
    x = ctorch::unitForward(frozen, x);
    return head(x);  // head stays in the root unit
  }
  Block a{nullptr}, b{nullptr};
  torch::nn::Linear tiedA{nullptr}, frozen{nullptr}, head{nullptr};
  SharedLinear tiedB{nullptr};
};
TORCH_MODULE(Net);

inline ctorch::WrapPolicy netPolicy() {
  return [](const std::string& name, const torch::nn::Module&) {
    return name == "a" || name == "b" || name == "tiedA" || name == "tiedB" || name == "frozen";
  };
}

} // namespace fsdp_test
