// Automatic mixed precision for a loop of your own, as Python's torch.autocast and
// torch.amp.GradScaler: an autocast region per device type and dtype (bfloat16 or float16 on CUDA,
// bfloat16 on the CPU), and dynamic loss scaling for float16 (bfloat16 has float32's range: it needs
// none). The scaler's state goes into snapshots (ResilientTraining::track(GradScaler&)).
#pragma once

#include <ctorch/state_dict.hpp>

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <unordered_set>

namespace ctorch::amp {

// "float16" / "fp16" / "half" and "bfloat16" / "bf16" (any case); throws std::invalid_argument
// naming the text otherwise.
torch::ScalarType parseDtype(const std::string& text);
std::string dtypeName(torch::ScalarType dtype);  // "float16", "bfloat16", ...

// Whether `dtype` autocasts on `device` with this LibTorch: CUDA float16 and bfloat16, CPU bfloat16
// (LibTorch 2.4+ also float16). When not, `why` says so.
bool autocastSupported(torch::DeviceType device, torch::ScalarType dtype, std::string* why = nullptr);

// Autocast for this thread while it lives, as `with torch.autocast(device_type, dtype):`. Nests (the
// cast cache is cleared when the outermost region closes); disabled, it does nothing. Throws
// std::invalid_argument for a device type / dtype pair autocastSupported() refuses.
class Autocast {
 public:
  Autocast(torch::DeviceType device, torch::ScalarType dtype, bool enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  torch::DeviceType device_;
  bool enabled_;
  bool previousEnabled_ = false;
  torch::ScalarType previousDtype_ = torch::kFloat;
};

struct GradScalerOptions {
  TORCH_ARG(double, initScale) = 65536.0;   // Python's init_scale (2^16)
  TORCH_ARG(double, growthFactor) = 2.0;
  TORCH_ARG(double, backoffFactor) = 0.5;
  TORCH_ARG(std::int64_t, growthInterval) = 2000;
  TORCH_ARG(bool, enabled) = true;          // disabled: every call is a pass-through
};

// Python's GradScaler: scale(loss).backward(); [unscale(opt); clip...]; step(opt); update().
// The loss is multiplied by the scale before backward; step() unscales the gradients (unless
// unscale() did already), checks them for inf/NaN and skips the optimizer step when it finds any;
// update() halves the scale after an overflow and doubles it after growthInterval clean steps. On
// CUDA it runs LibTorch's own AMP kernels; on the CPU the same arithmetic in tensor operations (the
// kernels have no CPU version before LibTorch 2.3). Under DDP the gradients are averaged before
// step(), so every rank finds the same and skips the same steps.
class GradScaler {
 public:
  explicit GradScaler(const torch::Device& device, GradScalerOptions options = {});

  bool enabled() const { return options_.enabled(); }
  torch::Tensor scale(const torch::Tensor& loss) const;
  // Divides this optimizer's gradients by the scale now (e.g. before clipping them); once per step.
  void unscale(torch::optim::Optimizer& optimizer);
  // Steps the optimizer unless its gradients hold inf/NaN; returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // Adjusts the scale after the step(s) of this iteration.
  void update();

  // Device skip (for a step captured in a CUDA graph, ctorch/cuda_graph.hpp): step() reads nothing
  // back to the host. It steps the optimizer whatever the gradients hold, then puts back, where
  // found-inf is set, the parameters and the optimizer's state tensors as they were (torch::where:
  // bit for bit what skipping leaves), and returns true. For optimizers whose whole state is tensors
  // (torch::optim::SGD); the ones that count steps on the host are refused by the graph instead.
  void setDeviceSkip(bool on) { deviceSkip_ = on; }
  bool deviceSkip() const { return deviceSkip_; }

  double currentScale() const;
  std::int64_t growthTracker() const;
  // The state a snapshot keeps: "amp_scale" and "amp_growth_tracker" (absent keys keep the
  // current state on load; a disabled scaler saves and loads nothing).
  void saveTo(ItemDict& items) const;
  void loadFrom(const ItemDict& items);

 private:
  void unscaleInto(torch::optim::Optimizer& optimizer);
  void stepOnDevice(torch::optim::Optimizer& optimizer);

  GradScalerOptions options_;
  torch::Device device_;
  torch::Tensor scale_, growthTracker_, foundInf_;
  std::unordered_set<const torch::optim::Optimizer*> unscaled_;
  bool deviceSkip_ = false;
};

}  // namespace ctorch::amp
