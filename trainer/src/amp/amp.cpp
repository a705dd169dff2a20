#include <ctorch/amp.hpp>

#include "core/compat.hpp"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <stdexcept>

namespace ctorch::amp {

torch::ScalarType parseDtype(const std::string& text) {
  std::string t = text;
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (t == "float16" || t == "fp16" || t == "half") return torch::kHalf;
  if (t == "bfloat16" || t == "bf16") return torch::kBFloat16;
  throw std::invalid_argument("mixed-precision dtype '" + text + "' is not one of float16, bfloat16");
}

std::string dtypeName(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kHalf: return "float16";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat: return "float32";
    case torch::kDouble: return "float64";
    default: return c10::toString(dtype);
  }
}

bool autocastSupported(torch::DeviceType device, torch::ScalarType dtype, std::string* why) {
  auto no = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (dtype != torch::kHalf && dtype != torch::kBFloat16)
    return no("autocast casts to float16 or bfloat16, not " + dtypeName(dtype));
  if (device == torch::kCUDA) return true;
  if (device == torch::kCPU) {
    if (dtype == torch::kHalf && !compat::kCpuAutocastHalf)
      return no("CPU autocast casts to bfloat16 only with this LibTorch (" TORCH_VERSION "); float16 needs CUDA");
    return true;
  }
  return no(std::string("autocast runs on the CPU or CUDA, not ") + c10::DeviceTypeName(device, /*lower_case=*/true));
}

Autocast::Autocast(torch::DeviceType device, torch::ScalarType dtype, bool enabled)
    : device_(device), enabled_(enabled) {
  if (!enabled_) return;
  std::string why;
  if (!autocastSupported(device, dtype, &why)) throw std::invalid_argument(why);
  previousEnabled_ = compat::autocastEnabled(device_);
  previousDtype_ = compat::autocastDtype(device_);
  compat::setAutocastEnabled(device_, true);
  compat::setAutocastDtype(device_, dtype);
  at::autocast::increment_nesting();
}

Autocast::~Autocast() {
  if (!enabled_) return;
  // Python's autocast.__exit__: the cast cache lives while any autocast region is open.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::setAutocastEnabled(device_, previousEnabled_);
  compat::setAutocastDtype(device_, previousDtype_);
}

GradScaler::GradScaler(const torch::Device& device, GradScalerOptions options)
    : options_(options), device_(device) {
  if (!(options_.initScale() > 0) || !std::isfinite(options_.initScale()))
    throw std::invalid_argument("GradScalerOptions::initScale must be a positive finite number, not " +
                                std::to_string(options_.initScale()));
  if (!(options_.growthFactor() > 1.0))
    throw std::invalid_argument("GradScalerOptions::growthFactor must be above 1, not " +
                                std::to_string(options_.growthFactor()));
  if (!(options_.backoffFactor() > 0.0 && options_.backoffFactor() < 1.0))
    throw std::invalid_argument("GradScalerOptions::backoffFactor must be in (0, 1), not " +
                                std::to_string(options_.backoffFactor()));
  if (options_.growthInterval() < 1)
    throw std::invalid_argument("GradScalerOptions::growthInterval must be at least 1, not " +
                                std::to_string(options_.growthInterval()));
  if (!enabled()) return;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device_);
  scale_ = torch::full({1}, options_.initScale(), f32);
  growthTracker_ = torch::zeros({1}, f32.dtype(torch::kInt32));
  foundInf_ = torch::zeros({1}, f32);
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const {
  return enabled() ? loss * scale_.to(loss.device()).to(loss.dtype()) : loss;
}

void GradScaler::unscaleInto(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard noGrad;
  // Python's _unscale_grads_: 1/scale in float64, then float32.
  const auto invScale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat32);
  std::vector<torch::Tensor> grads;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params())
      if (p.grad().defined()) grads.push_back(p.mutable_grad());
  if (grads.empty()) return;
  if (device_.is_cuda()) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, foundInf_, invScale);
    return;
  }
  // The kernel's arithmetic: found_inf = 1 when any gradient holds inf/NaN; every value * inv_scale.
  for (auto& g : grads) {
    if (!torch::isfinite(g).all().item<bool>()) foundInf_.fill_(1.0);
    g.mul_(invScale.to(g.device()).to(g.scalar_type()));
  }
}

void GradScaler::unscale(torch::optim::Optimizer& optimizer) {
  if (!enabled()) return;
  if (unscaled_.count(&optimizer))
    throw std::logic_error("GradScaler::unscale() was already called for this optimizer since the last update()");
  unscaleInto(optimizer);
  unscaled_.insert(&optimizer);
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled()) {
    optimizer.step();
    return true;
  }
  if (!unscaled_.count(&optimizer)) {
    unscaleInto(optimizer);
    unscaled_.insert(&optimizer);
  }
  if (deviceSkip_) {
    stepOnDevice(optimizer);
    return true;
  }
  if (foundInf_.item<float>() != 0.0f) return false;
  optimizer.step();
  return true;
}

namespace {
// The state tensors a step may change besides the parameters (torch::optim's own state types).
std::vector<torch::Tensor> stateTensors(torch::optim::Optimizer& optimizer, const torch::Tensor& param) {
  auto& states = optimizer.state();
  auto it = states.find(compat::optimizerStateKey(param));
  if (it == states.end()) return {};
  std::vector<torch::Tensor> out;
  auto keep = [&](const torch::Tensor& t) {
    if (t.defined()) out.push_back(t);
  };
  if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
    keep(sgd->momentum_buffer());
  } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
    keep(adam->exp_avg()), keep(adam->exp_avg_sq()), keep(adam->max_exp_avg_sq());
  } else if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
    keep(adamw->exp_avg()), keep(adamw->exp_avg_sq()), keep(adamw->max_exp_avg_sq());
  }
  return out;
}
} // namespace

void GradScaler::stepOnDevice(torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard noGrad;
  std::vector<torch::Tensor> live, saved;
  for (auto& group : optimizer.param_groups())
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      live.push_back(p);
      for (auto& t : stateTensors(optimizer, p)) live.push_back(t);
    }
  saved.reserve(live.size());
  for (const auto& t : live) saved.push_back(t.clone());
  optimizer.step();
  // Skipped where found_inf is set: every value back to what it was, exactly.
  const auto skip = foundInf_.ne(0).reshape({});
  for (size_t i = 0; i < live.size(); ++i) {
    // A state tensor the step replaced (rather than updated in place) is not restored: none of
    // torch::optim's does so once it exists, which the warm-up before a capture ensures.
    live[i].copy_(torch::where(skip.to(live[i].device()), saved[i], live[i]));
  }
}

void GradScaler::update() {
  if (!enabled()) return;
  unscaled_.clear();
  if (device_.is_cuda()) {
    at::_amp_update_scale_(scale_, growthTracker_, foundInf_, options_.growthFactor(), options_.backoffFactor(),
                           options_.growthInterval());
  } else {
    // _amp_update_scale_'s rule, in float32 as the kernel computes it.
    float scale = scale_.item<float>();
    int tracker = growthTracker_.item<int>();
    if (foundInf_.item<float>() != 0.0f) {
      scale = scale * static_cast<float>(options_.backoffFactor());
      tracker = 0;
    } else if (tracker + 1 == options_.growthInterval()) {
      const float grown = scale * static_cast<float>(options_.growthFactor());
      if (std::isfinite(grown)) scale = grown;
      tracker = 0;
    } else {
      ++tracker;
    }
    scale_.fill_(scale);
    growthTracker_.fill_(tracker);
  }
  foundInf_.zero_();
}

double GradScaler::currentScale() const { return enabled() ? scale_.item<double>() : 1.0; }

std::int64_t GradScaler::growthTracker() const { return enabled() ? growthTracker_.item<int>() : 0; }

void GradScaler::saveTo(ItemDict& items) const {
  if (!enabled()) return;
  items.insert("amp_scale", scale_.item<double>());
  items.insert("amp_growth_tracker", static_cast<std::int64_t>(growthTracker_.item<int>()));
}

void GradScaler::loadFrom(const ItemDict& items) {
  if (!enabled()) return;
  if (items.contains("amp_scale")) scale_.fill_(items.at("amp_scale").toDouble());
  if (items.contains("amp_growth_tracker")) growthTracker_.fill_(items.at("amp_growth_tracker").toInt());
}

}  // namespace ctorch::amp
