// Multi-tensor optimizers: SGD, Adam and AdamW that step all parameters of a group at once, with
// LibTorch's multi-tensor (`_foreach_*`) kernels or its fused kernels (`_fused_sgd_`, `_fused_adam_`,
// `_fused_adamw_`: one kernel per group, CPU and CUDA, LibTorch 2.4 and later) — what Python's
// `foreach=True` / `fused=True` optimizers do, where LibTorch's C++ optimizers go one parameter and
// one operation at a time.
//
// Each is a drop-in torch::optim optimizer (it derives from it): the same options, parameter groups,
// state (torch::optim's AdamParamState / SGDParamState, so snapshots, ZeroRedundancyOptimizer,
// FullyShardedDataParallel and the parameter server take it as they take torch::optim's, and a
// snapshot resumes across the two), only step() differs:
//
//   ctorch::optim::Adam adam(ddp.parameters(), torch::optim::AdamOptions(1e-3));   // kAuto
//   ctorch::ZeroRedundancyOptimizer zero(ddp.parameters(), [](std::vector<at::Tensor> share) {
//     return std::make_unique<ctorch::optim::AdamW>(share, torch::optim::AdamWOptions(1e-3));
//   });
//
// Kernels:
//   kForEach       the per-parameter arithmetic of torch::optim, one multi-tensor kernel per
//                  operation over the group: bit for bit equal to torch::optim's optimizer (the
//                  same operations in the same order; on the CPU LibTorch runs a multi-tensor
//                  operation tensor by tensor with the same kernels).
//   kFused         one fused kernel per group and step: each element read and written once.
//                  Differs from torch::optim in rounding only (the fused kernel computes the
//                  bias corrections and the update in another order; docs/optimizers.md states the
//                  bound measured). Throws ConfigError where this LibTorch has no such kernel for
//                  the parameters' device and dtype.
//   kAuto          kFused on CUDA where this LibTorch has the kernel for the group's dtype,
//                  kForEach elsewhere. Never a fused CPU kernel: LibTorch's (2.14) round an
//                  element's update by its place in the tensor (vectorised body or tail), so a
//                  flat shard (ZeRO, FSDP) would step unlike the whole parameter (DDP).
//   kPerParameter  torch::optim's own step (for comparisons).
#pragma once

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::optim {

enum class Kernels { kAuto, kFused, kForEach, kPerParameter };

// "auto", "fused", "foreach", "per-parameter"; kernelsFromString returns nullopt for anything else.
std::string toString(Kernels kernels);
std::optional<Kernels> kernelsFromString(const std::string& text);

// Whether this LibTorch has the fused kernel of `optimizer` ("SGD", "Adam" or "AdamW") for tensors
// of this device type and dtype (asked of the dispatcher, so a build without it answers false).
bool hasFusedKernel(const std::string& optimizer, c10::DeviceType device, at::ScalarType dtype);

namespace detail {
// What one step of a group ran (kFused or kForEach once kAuto is resolved; kPerParameter).
struct StepRecord {
  Kernels kernels = Kernels::kAuto;
};
// Fused kernels take each parameter's step count as a tensor on its device; this keeps one per
// parameter between steps (so a CUDA step copies nothing from the host), checked against the
// state's own count, which stays the truth (a restored state replaces a stale tensor).
class StepTensors {
 public:
  // The step tensors of `params`, each equal to its state's step count `steps[i]` (after it was
  // advanced), as a float32 scalar on the parameter's device.
  std::vector<at::Tensor> advance(const std::vector<at::Tensor>& params, const std::vector<std::int64_t>& steps);

 private:
  struct Entry {
    at::Tensor tensor;
    std::int64_t value = 0;
  };
  std::map<const void*, Entry> entries_;
};
} // namespace detail

class SGD : public torch::optim::SGD {
 public:
  SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups, torch::optim::SGDOptions defaults,
      Kernels kernels = Kernels::kAuto);
  SGD(std::vector<at::Tensor> params, torch::optim::SGDOptions defaults, Kernels kernels = Kernels::kAuto);
  at::Tensor step(LossClosure closure = nullptr) override;
  Kernels kernels() const { return kernels_; }
  // What the last step ran (kFused or kForEach for kAuto; kAuto before the first step).
  Kernels lastKernels() const { return last_; }

 private:
  Kernels kernels_;
  Kernels last_ = Kernels::kAuto;
};

class Adam : public torch::optim::Adam {
 public:
  Adam(const std::vector<torch::optim::OptimizerParamGroup>& groups, torch::optim::AdamOptions defaults = {},
       Kernels kernels = Kernels::kAuto);
  Adam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults = {}, Kernels kernels = Kernels::kAuto);
  at::Tensor step(LossClosure closure = nullptr) override;
  Kernels kernels() const { return kernels_; }
  Kernels lastKernels() const { return last_; }

 private:
  Kernels kernels_;
  Kernels last_ = Kernels::kAuto;
  detail::StepTensors steps_;
};

class AdamW : public torch::optim::AdamW {
 public:
  AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups, torch::optim::AdamWOptions defaults = {},
        Kernels kernels = Kernels::kAuto);
  AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults = {}, Kernels kernels = Kernels::kAuto);
  at::Tensor step(LossClosure closure = nullptr) override;
  Kernels kernels() const { return kernels_; }
  Kernels lastKernels() const { return last_; }

 private:
  Kernels kernels_;
  Kernels last_ = Kernels::kAuto;
  detail::StepTensors steps_;
};

} // namespace ctorch::optim
