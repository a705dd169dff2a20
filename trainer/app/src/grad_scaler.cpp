#include "ctorch/train/grad_scaler.hpp"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>

namespace ctorch::train {

GradScaler::GradScaler(bool enabled, const torch::Device& device, double initScale, double growthFactor,
                       double backoffFactor, std::int64_t growthInterval)
    : enabled_(enabled), growthFactor_(growthFactor), backoffFactor_(backoffFactor), growthInterval_(growthInterval) {
  if (!enabled_) return;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  scale_ = torch::full({1}, initScale, f32);
  growthTracker_ = torch::zeros({1}, f32.dtype(torch::kInt32));
  foundInf_ = torch::zeros({1}, f32);
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const {
  return enabled_ ? loss * scale_.to(loss.dtype()) : loss;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) {
    optimizer.step();
    return true;
  }
  foundInf_.zero_();
  const auto invScale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat32);
  std::vector<torch::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined()) grads.push_back(p.mutable_grad());
  if (!grads.empty()) at::_amp_foreach_non_finite_check_and_unscale_(grads, foundInf_, invScale);
  // DDP averaged the gradients already, so every rank finds the same and skips the same steps.
  if (foundInf_.item<float>() != 0.0f) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!enabled_) return;
  at::_amp_update_scale_(scale_, growthTracker_, foundInf_, growthFactor_, backoffFactor_, growthInterval_);
}

double GradScaler::currentScale() const { return enabled_ ? scale_.item<double>() : 1.0; }

void GradScaler::saveTo(ItemDict& items) const {
  if (!enabled_) return;
  items.insert("amp_scale", scale_.item<double>());
  items.insert("amp_growth_tracker", static_cast<std::int64_t>(growthTracker_.item<int>()));
}

void GradScaler::loadFrom(const ItemDict& items) {
  if (!enabled_) return;
  if (items.contains("amp_scale")) scale_.fill_(items.at("amp_scale").toDouble());
  if (items.contains("amp_growth_tracker")) growthTracker_.fill_(items.at("amp_growth_tracker").toInt());
}

}  // namespace ctorch::train
