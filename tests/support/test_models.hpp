// Small models more than one test program uses: one definition, so that a "the same model" in two
// tests is the same model. LibTorch tests only.
#pragma once

#include <torch/torch.h>

namespace ctorch::test {

// A three-layer perceptron, 10 -> 32 -> 32 -> 3 with ReLU (DDP's and the CUDA tests' reference model).
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(10, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

} // namespace ctorch::test
