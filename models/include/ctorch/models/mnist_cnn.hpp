// The seeds' MNIST CNN, exactly PyTorch's examples/mnist `Net` (same layers, same submodule names,
// so state-dict keys match Python's): conv1 1->32 3x3, relu, conv2 32->64 3x3, relu, max_pool 2,
// dropout1 0.25, flatten, fc1 9216->128, relu, dropout2 0.5, fc2 128->10, log_softmax.
#pragma once

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <ctorch/models/model.hpp>

namespace ctorch::models {

class MnistCnn : public Model {
 public:
  // fc1's input is 64 * ((imageSize - 4) / 2)^2: 9216 for 28x28. imageSize must be >= 6.
  MnistCnn(int64_t inChannels = 1, int64_t numClasses = 10, int64_t imageSize = 28);
  torch::Tensor forward(torch::Tensor input) override;  // [B, C, S, S] -> [B, classes]
  ModelOutput output() const override { return ModelOutput::LogProbabilities; }
  torch::nn::Sequential sequential() override;

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Dropout dropout1{nullptr}, dropout2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

} // namespace ctorch::models
