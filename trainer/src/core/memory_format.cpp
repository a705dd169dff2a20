// ctorch/memory_format.hpp: a module's 4-D tensors converted in place.
#include "ctorch/memory_format.hpp"

#include <torch/nn/module.h>
#include <torch/utils.h>

namespace ctorch {

namespace {

constexpr std::int64_t kImageDims = 4;  // N, C, H, W (a 2-D convolution's weight: out, in, kH, kW)

// `t` given the layout `format` in place, keeping its Tensor object; true when it was converted.
bool convertInPlace(at::Tensor t, at::MemoryFormat format) {
  if (!t.defined() || t.dim() != kImageDims) return false;
  if (!t.is_contiguous(format)) t.set_data(t.detach().contiguous(format));
  return true;
}

}  // namespace

std::size_t toMemoryFormat(torch::nn::Module& module, at::MemoryFormat format) {
  torch::NoGradGuard noGrad;
  std::size_t converted = 0;
  for (auto& p : module.parameters(/*recurse=*/true)) {
    if (!convertInPlace(p, format)) continue;
    ++converted;
    if (p.grad().defined() && !p.grad().is_contiguous(format)) p.mutable_grad() = p.grad().contiguous(format);
  }
  for (auto& b : module.buffers(/*recurse=*/true))
    if (convertInPlace(b, format)) ++converted;
  return converted;
}

at::Tensor toMemoryFormat(const at::Tensor& tensor, at::MemoryFormat format) {
  if (!tensor.defined() || tensor.dim() != kImageDims) return tensor;
  return tensor.contiguous(format);
}

bool hasFourDimensionalTensors(const torch::nn::Module& module) {
  for (const auto& p : module.parameters(/*recurse=*/true))
    if (p.dim() == kImageDims) return true;
  for (const auto& b : module.buffers(/*recurse=*/true))
    if (b.dim() == kImageDims) return true;
  return false;
}

const char* memoryFormatName(at::MemoryFormat format) {
  switch (format) {
    case at::MemoryFormat::Contiguous:
      return "contiguous";
    case at::MemoryFormat::ChannelsLast:
      return "channels-last";
    case at::MemoryFormat::ChannelsLast3d:
      return "channels-last-3d";
    case at::MemoryFormat::Preserve:
      return "preserve";
    default:
      break;
  }
  return "unknown";
}

}  // namespace ctorch
