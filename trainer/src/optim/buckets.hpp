// The parameters of one group that a step updates, split by device and dtype (a multi-tensor or
// fused kernel takes tensors of one device and dtype), in the group's order.
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/optim.hpp"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <utility>
#include <vector>

namespace ctorch::optim::detail {

struct Bucket {
  c10::Device device{c10::kCPU};
  at::ScalarType dtype = at::kFloat;
  std::vector<at::Tensor> params;  // detached views of the parameters (same storage)
  std::vector<at::Tensor> originals;  // the parameters themselves (the optimizer state's keys)
  std::vector<at::Tensor> grads;
};

// Parameters with a gradient, bucketed; a sparse gradient is refused as torch::optim refuses it.
inline std::vector<Bucket> bucketsOf(const std::vector<at::Tensor>& params, const char* optimizer) {
  std::vector<Bucket> buckets;
  for (const auto& p : params) {
    const auto& grad = p.grad();
    if (!grad.defined()) continue;
    if (grad.is_sparse())
      throw ConfigError(std::string("ctorch::optim::") + optimizer + ": sparse gradients are not supported");
    Bucket* bucket = nullptr;
    for (auto& b : buckets)
      if (b.device == p.device() && b.dtype == p.scalar_type()) bucket = &b;
    if (!bucket) {
      buckets.push_back(Bucket{p.device(), p.scalar_type(), {}, {}, {}});
      bucket = &buckets.back();
    }
    bucket->params.push_back(p.detach());
    bucket->originals.push_back(p);
    bucket->grads.push_back(grad.detach());
  }
  return buckets;
}

// Whether the fused kernels may take these tensors: each dense, and every tensor that a kernel
// walks element by element beside the parameter laid out as the parameter is.
inline bool sameLayout(const at::Tensor& p, const at::Tensor& other) {
  return other.sizes() == p.sizes() && other.strides() == p.strides() && other.is_non_overlapping_and_dense();
}

// kAuto resolved for one bucket.
inline Kernels resolve(Kernels asked, const char* optimizer, const Bucket& b) {
  if (asked != Kernels::kAuto && asked != Kernels::kFused) return asked;
  bool fused = hasFusedKernel(optimizer, b.device.type(), b.dtype);
  // LibTorch's fused CPU kernels round an element's update differently in the vectorised body of a
  // tensor and in its tail (SGD's momentum, Adam's and AdamW's exp_avg_sq; measured with 2.14): the
  // same element would step differently in a whole parameter (DDP) and in a flat shard (FSDP, ZeRO),
  // and a sharded run would leave the run without sharding. kAuto keeps the CPU on the multi-tensor
  // kernels, which are exact; asked for explicitly, the fused CPU kernels run.
  const bool autoOnCpu = asked == Kernels::kAuto && b.device.type() == c10::DeviceType::CPU;
  if (autoOnCpu) fused = false;
  if (asked == Kernels::kFused && !fused)
    throw ConfigError(std::string("ctorch::optim::") + optimizer + ": this LibTorch has no fused " + optimizer +
                      " kernel for " + c10::toString(b.dtype) + " tensors on " + b.device.str() +
                      " (use Kernels::kForEach or kAuto)");
  return fused ? Kernels::kFused : Kernels::kForEach;
}

// One list of scalars for the multi-tensor operations whose scalar differs per parameter.
inline std::vector<c10::Scalar> scalars(const std::vector<double>& values) {
  return std::vector<c10::Scalar>(values.begin(), values.end());
}

// What every step() does around its kernels: kPerParameter hands the step to torch::optim's own
// (`Base`); otherwise the closure, if any, runs with gradients on and `body` steps without.
template <typename Base, typename Body>
at::Tensor runStep(Base& self, Kernels kernels, Kernels& last, torch::optim::Optimizer::LossClosure closure,
                   Body&& body) {
  if (kernels == Kernels::kPerParameter) {
    last = Kernels::kPerParameter;
    return self.Base::step(std::move(closure));
  }
  torch::NoGradGuard noGrad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enableGrad(true);
    loss = closure();
  }
  std::forward<Body>(body)();
  return loss;
}

} // namespace ctorch::optim::detail
