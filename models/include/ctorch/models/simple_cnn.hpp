// A small, fast convolutional net (PyTorch's CIFAR-10 tutorial `Net`, 62k parameters at 32x32):
// conv1 C->6 5x5, relu, max_pool 2, conv2 6->16 5x5, relu, max_pool 2, flatten, fc1 ->120, relu,
// fc2 120->84, relu, fc3 84->classes (logits). For quick runs and tests.
#pragma once

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <ctorch/models/model.hpp>

namespace ctorch::models {

class SimpleConvNet : public Model {
 public:
  // fc1's input is 16 * s^2 with s = ((imageSize - 4) / 2 - 4) / 2: 400 at 32, 256 at 28.
  // imageSize must be >= 16.
  SimpleConvNet(int64_t inChannels = 3, int64_t numClasses = 10, int64_t imageSize = 32);
  torch::Tensor forward(torch::Tensor input) override;
  ModelOutput output() const override { return ModelOutput::Logits; }
  torch::nn::Sequential sequential() override;

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};

} // namespace ctorch::models
