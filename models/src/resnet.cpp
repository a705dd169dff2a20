#include <ctorch/models/resnet.hpp>

#include <ctorch/fsdp_unit.hpp>

#include <torch/torch.h>

namespace ctorch::models {

namespace F = torch::nn::functional;
namespace {

torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

torch::nn::Sequential makeLayer(int64_t& inPlanes, int64_t planes, int64_t blocks, int64_t stride) {
  torch::nn::Sequential layer;
  for (int64_t i = 0; i < blocks; ++i) {
    layer->push_back(BasicBlock(inPlanes, planes, i == 0 ? stride : 1));
    inPlanes = planes;
  }
  return layer;
}

}  // namespace

BasicBlockImpl::BasicBlockImpl(int64_t inPlanes, int64_t planes, int64_t stride) {
  conv1 = register_module("conv1", conv3x3(inPlanes, planes, stride));
  bn1 = register_module("bn1", torch::nn::BatchNorm2d(planes));
  conv2 = register_module("conv2", conv3x3(planes, planes, 1));
  bn2 = register_module("bn2", torch::nn::BatchNorm2d(planes));
  if (stride != 1 || inPlanes != planes) {
    downsample = register_module(
        "downsample",
        torch::nn::Sequential(
            torch::nn::Conv2d(torch::nn::Conv2dOptions(inPlanes, planes, 1).stride(stride).bias(false)),
            torch::nn::BatchNorm2d(planes)));
  }
}

torch::Tensor BasicBlockImpl::forward(torch::Tensor x) {
  auto out = F::relu(bn1(conv1(x)));
  out = bn2(conv2(out));
  out += downsample ? downsample->forward(x) : x;
  return F::relu(out);
}

ResNet18::ResNet18(int64_t inChannels, int64_t numClasses) : Model("ResNet18") {
  int64_t inPlanes = 64;
  conv1 = register_module("conv1", conv3x3(inChannels, 64, 1));
  bn1 = register_module("bn1", torch::nn::BatchNorm2d(64));
  layer1 = register_module("layer1", makeLayer(inPlanes, 64, 2, 1));
  layer2 = register_module("layer2", makeLayer(inPlanes, 128, 2, 2));
  layer3 = register_module("layer3", makeLayer(inPlanes, 256, 2, 2));
  layer4 = register_module("layer4", makeLayer(inPlanes, 512, 2, 2));
  fc = register_module("fc", torch::nn::Linear(512, numClasses));

  // torchvision's initialisation: He-normal (fan_out) convolutions, BatchNorm scale 1 and shift 0;
  // Linear keeps its default.
  torch::NoGradGuard noGrad;
  for (auto& module : modules(/*include_self=*/false)) {
    if (auto* conv = module->as<torch::nn::Conv2d>()) {
      torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
    } else if (auto* bn = module->as<torch::nn::BatchNorm2d>()) {
      torch::nn::init::ones_(bn->weight);
      torch::nn::init::zeros_(bn->bias);
    }
  }
}

torch::Tensor ResNet18::forward(torch::Tensor x) {
  // Each block (and the stem and head) through ctorch::unitForward: a plain call, or a unit of
  // FullyShardedDataParallel. The same operations as layerN->forward(x).
  x = F::relu(bn1(ctorch::unitForward(conv1, x)));
  for (const auto& layer : {layer1, layer2, layer3, layer4})
    for (std::size_t i = 0; i < layer->size(); ++i) {
      auto* block = layer->ptr(i)->as<BasicBlockImpl>();
      x = ctorch::unitForward(block, x);
    }
  x = F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(1));
  return ctorch::unitForward(fc, torch::flatten(x, 1));
}

torch::nn::Sequential ResNet18::sequential() {
  // The stem, the eight blocks one by one, the pooling and the head.
  torch::nn::Sequential seq(conv1, bn1, torch::nn::Functional([](const torch::Tensor& x) { return F::relu(x); }));
  for (const auto& layer : {layer1, layer2, layer3, layer4})
    for (std::size_t i = 0; i < layer->size(); ++i) seq->push_back(BasicBlock(layer->ptr<BasicBlockImpl>(i)));
  seq->push_back(torch::nn::Functional([](const torch::Tensor& x) {
    return torch::flatten(F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(1)), 1);
  }));
  seq->push_back(fc);
  return seq;
}

} // namespace ctorch::models
