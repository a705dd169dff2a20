// Dynamic loss scaling for float16 training on CUDA, as Python's torch.cuda.amp.GradScaler: the loss
// is multiplied by a scale before backward; gradients are unscaled and checked for inf/NaN before the
// optimizer step, which is skipped when any is found; the scale halves after an overflow and doubles
// after `growthInterval` clean steps. Disabled, every call is a pass-through. Its state goes into
// snapshots (USER_STATE) so a resumed run continues with the same scale.
#pragma once

#include <ctorch/snapshot.hpp>

#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>

namespace ctorch::train {

class GradScaler {
 public:
  GradScaler(bool enabled, const torch::Device& device, double initScale = 65536.0, double growthFactor = 2.0,
             double backoffFactor = 0.5, std::int64_t growthInterval = 2000);

  bool enabled() const { return enabled_; }
  torch::Tensor scale(const torch::Tensor& loss) const;
  // Unscales the gradients, steps the optimizer unless they hold inf/NaN; returns whether it stepped.
  bool step(torch::optim::Optimizer& optimizer);
  // Adjusts the scale after step().
  void update();

  double currentScale() const;
  void saveTo(ItemDict& items) const;      // "amp_scale", "amp_growth_tracker"
  void loadFrom(const ItemDict& items);    // absent keys: keep the initial state

 private:
  bool enabled_;
  double growthFactor_, backoffFactor_;
  std::int64_t growthInterval_;
  torch::Tensor scale_, growthTracker_, foundInf_;
};

}  // namespace ctorch::train
