// ResNet-18 (He et al. 2015; BasicBlock, [2, 2, 2, 2]) with the CIFAR stem: a 3x3 stride-1 conv and no
// max-pool, so 32x32 (or 28x28 grayscale) inputs keep their resolution into layer1. Submodule names
// follow torchvision's resnet18 (conv1, bn1, layer1..4 with conv1/bn1/conv2/bn2/downsample, fc).
#pragma once

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <ctorch/models/model.hpp>

namespace ctorch::models {

class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t inPlanes, int64_t planes, int64_t stride);
  torch::Tensor forward(torch::Tensor x);

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};  // 1x1 conv + bn when the shape changes, else none
};
TORCH_MODULE(BasicBlock);

class ResNet18 : public Model {
 public:
  ResNet18(int64_t inChannels = 3, int64_t numClasses = 10);
  torch::Tensor forward(torch::Tensor input) override;  // [B, C, H, W] -> [B, classes]
  ModelOutput output() const override { return ModelOutput::Logits; }
  torch::nn::Sequential sequential() override;

  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr}, layer4{nullptr};
  torch::nn::Linear fc{nullptr};
};

} // namespace ctorch::models
