#include <ctorch/models/mnist_cnn.hpp>
#include <ctorch/models/ops.hpp>

#include <ctorch/fsdp_unit.hpp>

#include <torch/torch.h>

namespace ctorch::models {

namespace F = torch::nn::functional;

MnistCnn::MnistCnn(int64_t inChannels, int64_t numClasses, int64_t imageSize) : Model("MnistCnn") {
  const int64_t pooled = (imageSize - 4) / 2;
  // Registration order = Python's attribute order, so state-dict keys come in the same order.
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(inChannels, 32, 3).stride(1)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).stride(1)));
  dropout1 = register_module("dropout1", torch::nn::Dropout(0.25));
  dropout2 = register_module("dropout2", torch::nn::Dropout(0.5));
  fc1 = register_module("fc1", torch::nn::Linear(64 * pooled * pooled, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, numClasses));
}

torch::Tensor MnistCnn::forward(torch::Tensor x) {
  // Each layer through ctorch::unitForward: a plain call, or a unit of FullyShardedDataParallel.
  x = F::relu(ctorch::unitForward(conv1, x));
  x = F::relu(ctorch::unitForward(conv2, x));
  x = maxPool2x2(x);  // = F::max_pool2d(x, 2), bit for bit, faster on the CPU (ops.hpp)
  x = dropout1(x);
  x = torch::flatten(x, 1);
  x = F::relu(ctorch::unitForward(fc1, x));
  x = dropout2(x);
  x = ctorch::unitForward(fc2, x);
  return F::log_softmax(x, F::LogSoftmaxFuncOptions(1));
}

torch::nn::Sequential MnistCnn::sequential() {
  using torch::nn::Functional;
  return torch::nn::Sequential(
      conv1, Functional([](const torch::Tensor& x) { return F::relu(x); }), conv2,
      Functional([](const torch::Tensor& x) { return F::relu(x); }), Functional([](const torch::Tensor& x) { return maxPool2x2(x); }),
      dropout1, Functional([](const torch::Tensor& x) { return torch::flatten(x, 1); }), fc1,
      Functional([](const torch::Tensor& x) { return F::relu(x); }), dropout2, fc2,
      Functional([](const torch::Tensor& x) { return F::log_softmax(x, F::LogSoftmaxFuncOptions(1)); }));
}

} // namespace ctorch::models
