// Adam and AdamW over a group's parameters at once: torch::optim's per-parameter arithmetic as
// multi-tensor operations (kForEach), or LibTorch's fused kernels (kFused).
#include "core/compat.hpp"
#include "optim/buckets.hpp"

#if __has_include(<ATen/ops/_fused_adamw.h>)
#include <ATen/ops/_fused_adamw.h>
#define CTORCH_HAS_FUSED_ADAMW 1
#else
#define CTORCH_HAS_FUSED_ADAMW 0
#endif
#include <ATen/ops/_fused_adam.h>

#include <torch/torch.h>

#include <cmath>

namespace ctorch::optim {

using compat::OptimizerStateMap;
using compat::optimizerStateKey;

using torch::optim::AdamParamState;
using torch::optim::AdamWParamState;

Adam::Adam(const std::vector<torch::optim::OptimizerParamGroup>& groups, torch::optim::AdamOptions defaults,
           Kernels kernels)
    : torch::optim::Adam(groups, defaults), kernels_(kernels) {}
Adam::Adam(std::vector<at::Tensor> params, torch::optim::AdamOptions defaults, Kernels kernels)
    : torch::optim::Adam(std::move(params), defaults), kernels_(kernels) {}
AdamW::AdamW(const std::vector<torch::optim::OptimizerParamGroup>& groups, torch::optim::AdamWOptions defaults,
             Kernels kernels)
    : torch::optim::AdamW(groups, defaults), kernels_(kernels) {}
AdamW::AdamW(std::vector<at::Tensor> params, torch::optim::AdamWOptions defaults, Kernels kernels)
    : torch::optim::AdamW(std::move(params), defaults), kernels_(kernels) {}

namespace {

// The state tensors of a bucket's parameters, created as torch::optim creates them (zeros laid out
// as the parameter; step 0), each step count advanced.
template <typename State>
struct Moments {
  std::vector<at::Tensor> expAvg, expAvgSq, maxExpAvgSq;
  std::vector<std::int64_t> steps;
};

template <typename State>
Moments<State> advanceState(const detail::Bucket& b, bool amsgrad, OptimizerStateMap& state) {
  Moments<State> m;
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    const auto key = optimizerStateKey(b.originals[i]);
    auto it = state.find(key);
    if (it == state.end()) {
      auto s = std::make_unique<State>();
      s->step(0);
      s->exp_avg(torch::zeros_like(b.params[i], at::MemoryFormat::Preserve));
      s->exp_avg_sq(torch::zeros_like(b.params[i], at::MemoryFormat::Preserve));
      if (amsgrad) s->max_exp_avg_sq(torch::zeros_like(b.params[i], at::MemoryFormat::Preserve));
      it = state.insert_or_assign(key, std::move(s)).first;
    }
    auto& s = static_cast<State&>(*it->second);
    s.step(s.step() + 1);
    m.expAvg.push_back(s.exp_avg());
    m.expAvgSq.push_back(s.exp_avg_sq());
    if (amsgrad) {
      // A state restored from a run without amsgrad has none: torch::optim would fail on it too late.
      if (!s.max_exp_avg_sq().defined()) s.max_exp_avg_sq(torch::zeros_like(b.params[i], at::MemoryFormat::Preserve));
      m.maxExpAvgSq.push_back(s.max_exp_avg_sq());
    }
    m.steps.push_back(s.step());
  }
  return m;
}

// torch::optim's Adam / AdamW step of one parameter, operation by operation over the bucket:
//   (Adam) g = grad + wd * p          (AdamW) p *= 1 - lr * wd
//   m = m * beta1 + (1 - beta1) * g;  v = v * beta2 + (1 - beta2) * g * g;  (amsgrad) vmax = max(vmax, v)
//   denom = sqrt(v or vmax) / sqrt(1 - beta2^t) + eps;  p += -(lr / (1 - beta1^t)) * m / denom
template <typename Options, typename State>
void forEachStep(detail::Bucket& b, const Options& o, OptimizerStateMap& state, bool decoupled) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  std::vector<at::Tensor> grads = b.grads;
  if (o.weight_decay() != 0) {
    if (decoupled) at::_foreach_mul_(b.params, 1 - o.lr() * o.weight_decay());
    else grads = at::_foreach_add(b.grads, b.params, o.weight_decay());
  }
  auto m = advanceState<State>(b, o.amsgrad(), state);
  std::vector<double> sqrtCorrection2, negStepSize;
  for (auto t : m.steps) {
    sqrtCorrection2.push_back(std::sqrt(1 - std::pow(beta2, t)));
    negStepSize.push_back(-(o.lr() / (1 - std::pow(beta1, t))));
  }
  at::_foreach_mul_(m.expAvg, beta1);
  at::_foreach_add_(m.expAvg, grads, 1 - beta1);
  at::_foreach_mul_(m.expAvgSq, beta2);
  at::_foreach_addcmul_(m.expAvgSq, grads, grads, 1 - beta2);
  if (o.amsgrad()) at::_foreach_maximum_(m.maxExpAvgSq, m.expAvgSq);
  auto denom = at::_foreach_sqrt(o.amsgrad() ? m.maxExpAvgSq : m.expAvgSq);
  at::_foreach_div_(denom, detail::scalars(sqrtCorrection2));
  at::_foreach_add_(denom, o.eps());
  at::_foreach_addcdiv_(b.params, m.expAvg, denom, detail::scalars(negStepSize));
}

template <typename Options, typename State>
void fusedStep(detail::Bucket& b, const Options& o, OptimizerStateMap& state, bool decoupled,
               detail::StepTensors& stepTensors) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  auto m = advanceState<State>(b, o.amsgrad(), state);
  const auto steps = stepTensors.advance(b.originals, m.steps);
  if (!decoupled) {
    at::_fused_adam_(b.params, b.grads, m.expAvg, m.expAvgSq, m.maxExpAvgSq, steps, o.lr(), beta1, beta2,
                     o.weight_decay(), o.eps(), o.amsgrad(), false);
    return;
  }
#if CTORCH_HAS_FUSED_ADAMW
  at::_fused_adamw_(b.params, b.grads, m.expAvg, m.expAvgSq, m.maxExpAvgSq, steps, o.lr(), beta1, beta2,
                    o.weight_decay(), o.eps(), o.amsgrad(), false);
#else
  throw ConfigError("ctorch::optim::AdamW: this LibTorch has no fused AdamW kernel");
#endif
}

// The fused kernels walk parameter, gradient and moments element by element: one layout for all.
template <typename State>
bool fusable(const detail::Bucket& b, const OptimizerStateMap& state) {
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    if (!b.params[i].is_non_overlapping_and_dense() || !detail::sameLayout(b.params[i], b.grads[i])) return false;
    auto it = state.find(optimizerStateKey(b.originals[i]));
    if (it == state.end()) continue;
    const auto& s = static_cast<const State&>(*it->second);
    for (const at::Tensor* t : {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq()})
      if (t->defined() && !detail::sameLayout(b.params[i], *t)) return false;
  }
  return true;
}

template <typename Options, typename State>
Kernels stepAll(torch::optim::Optimizer& optimizer, Kernels asked, const char* name, bool decoupled,
                detail::StepTensors& stepTensors) {
  Kernels last = asked;
  for (auto& group : optimizer.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    for (auto& b : detail::bucketsOf(group.params(), name)) {
      Kernels k = detail::resolve(asked, name, b);
      if (k == Kernels::kFused && !fusable<State>(b, optimizer.state())) {
        if (asked == Kernels::kFused)
          throw ConfigError(std::string("ctorch::optim::") + name +
                            ": the fused kernel needs each gradient and moment laid out as its parameter "
                            "(use Kernels::kAuto or kForEach)");
        k = Kernels::kForEach;
      }
      if (k == Kernels::kFused) fusedStep<Options, State>(b, o, optimizer.state(), decoupled, stepTensors);
      else forEachStep<Options, State>(b, o, optimizer.state(), decoupled);
      last = k;
    }
  }
  return last;
}

} // namespace

at::Tensor Adam::step(LossClosure closure) {
  return detail::runStep<torch::optim::Adam>(*this, kernels_, last_, std::move(closure), [&] {
    last_ = stepAll<torch::optim::AdamOptions, AdamParamState>(*this, kernels_, "Adam", false, steps_);
  });
}

at::Tensor AdamW::step(LossClosure closure) {
  return detail::runStep<torch::optim::AdamW>(*this, kernels_, last_, std::move(closure), [&] {
    last_ = stepAll<torch::optim::AdamWOptions, AdamWParamState>(*this, kernels_, "AdamW", true, steps_);
  });
}

} // namespace ctorch::optim
