#include <ctorch/models/simple_cnn.hpp>
#include <ctorch/models/ops.hpp>

#include <ctorch/fsdp_unit.hpp>

#include <torch/torch.h>

namespace ctorch::models {

namespace F = torch::nn::functional;

SimpleConvNet::SimpleConvNet(int64_t inChannels, int64_t numClasses, int64_t imageSize)
    : Model("SimpleConvNet") {
  const int64_t s = ((imageSize - 4) / 2 - 4) / 2;
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(inChannels, 6, 5)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 16, 5)));
  fc1 = register_module("fc1", torch::nn::Linear(16 * s * s, 120));
  fc2 = register_module("fc2", torch::nn::Linear(120, 84));
  fc3 = register_module("fc3", torch::nn::Linear(84, numClasses));
}

torch::Tensor SimpleConvNet::forward(torch::Tensor x) {
  // Each layer through ctorch::unitForward: a plain call, or a unit of FullyShardedDataParallel.
  x = maxPool2x2(F::relu(ctorch::unitForward(conv1, x)));  // = F::max_pool2d(.., 2), bit for bit (ops.hpp)
  x = maxPool2x2(F::relu(ctorch::unitForward(conv2, x)));
  x = torch::flatten(x, 1);
  x = F::relu(ctorch::unitForward(fc1, x));
  x = F::relu(ctorch::unitForward(fc2, x));
  return ctorch::unitForward(fc3, x);
}

torch::nn::Sequential SimpleConvNet::sequential() {
  using torch::nn::Functional;
  auto reluPool = [](const torch::Tensor& x) { return maxPool2x2(F::relu(x)); };
  auto relu = [](const torch::Tensor& x) { return F::relu(x); };
  return torch::nn::Sequential(conv1, Functional(reluPool), conv2, Functional(reluPool),
                               Functional([](const torch::Tensor& x) { return torch::flatten(x, 1); }), fc1,
                               Functional(relu), fc2, Functional(relu), fc3);
}

} // namespace ctorch::models
