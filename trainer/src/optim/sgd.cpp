// SGD (momentum, dampening, Nesterov, weight decay) over a group's parameters at once: torch::optim's
// per-parameter arithmetic as multi-tensor operations (kForEach), or LibTorch's fused kernel (kFused).
#include "core/compat.hpp"
#include "optim/buckets.hpp"

#if __has_include(<ATen/ops/_fused_sgd.h>)
#include <ATen/ops/_fused_sgd.h>
#define CTORCH_HAS_FUSED_SGD 1
#else
#define CTORCH_HAS_FUSED_SGD 0
#endif

#include <torch/torch.h>

namespace ctorch::optim {

using compat::OptimizerStateMap;
using compat::optimizerStateKey;

using torch::optim::SGDOptions;
using torch::optim::SGDParamState;

SGD::SGD(const std::vector<torch::optim::OptimizerParamGroup>& groups, SGDOptions defaults, Kernels kernels)
    : torch::optim::SGD(groups, defaults), kernels_(kernels) {}

SGD::SGD(std::vector<at::Tensor> params, SGDOptions defaults, Kernels kernels)
    : torch::optim::SGD(std::move(params), defaults), kernels_(kernels) {}

namespace {

// torch::optim::SGD's step of one parameter, operation by operation over the bucket:
//   d_p = grad (+ wd * p); buf = clone(d_p) the first time, else buf * momentum + (1 - dampening) * d_p;
//   d_p = nesterov ? d_p + momentum * buf : buf; p += -lr * d_p
void sgdForEachStep(detail::Bucket& b, const SGDOptions& o, OptimizerStateMap& state) {
  std::vector<at::Tensor> dps = o.weight_decay() != 0 ? at::_foreach_add(b.grads, b.params, o.weight_decay()) : b.grads;
  if (o.momentum() != 0) {
    std::vector<at::Tensor> olds, oldDps;
    std::vector<at::Tensor> bufs(b.params.size());
    for (std::size_t i = 0; i < b.params.size(); ++i) {
      const auto key = optimizerStateKey(b.originals[i]);
      auto it = state.find(key);
      if (it == state.end()) {
        bufs[i] = at::clone(dps[i]).detach();
        auto s = std::make_unique<SGDParamState>();
        s->momentum_buffer(bufs[i]);
        state[key] = std::move(s);
      } else {
        bufs[i] = static_cast<SGDParamState&>(*it->second).momentum_buffer();
        olds.push_back(bufs[i]);
        oldDps.push_back(dps[i]);
      }
    }
    if (!olds.empty()) {
      at::_foreach_mul_(olds, o.momentum());
      at::_foreach_add_(olds, oldDps, 1 - o.dampening());
    }
    if (o.nesterov()) dps = at::_foreach_add(dps, bufs, o.momentum());
    else dps = bufs;
  }
  at::_foreach_add_(b.params, dps, -1 * o.lr());
}

#if CTORCH_HAS_FUSED_SGD
// One fused kernel per call; the parameters with a momentum buffer and those taking their first step
// go in separate calls (the kernel's is_first_step is per call).
void sgdFusedStep(detail::Bucket& b, const SGDOptions& o, OptimizerStateMap& state) {
  if (o.momentum() == 0) {
    at::_fused_sgd_(b.params, b.grads, {}, o.weight_decay(), 0.0, o.lr(), o.dampening(), o.nesterov(), false, false);
    return;
  }
  std::vector<at::Tensor> ps[2], gs[2], bufs[2];  // [0]: buffer exists, [1]: first step
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    const auto key = optimizerStateKey(b.originals[i]);
    auto it = state.find(key);
    const int first = it == state.end() ? 1 : 0;
    at::Tensor buf;
    if (first) {
      buf = at::empty_like(b.params[i], at::MemoryFormat::Preserve);
      auto s = std::make_unique<SGDParamState>();
      s->momentum_buffer(buf);
      state[key] = std::move(s);
    } else {
      buf = static_cast<SGDParamState&>(*it->second).momentum_buffer();
    }
    ps[first].push_back(b.params[i]);
    gs[first].push_back(b.grads[i]);
    bufs[first].push_back(buf);
  }
  for (int first = 0; first < 2; ++first)
    if (!ps[first].empty())
      at::_fused_sgd_(ps[first], gs[first], bufs[first], o.weight_decay(), o.momentum(), o.lr(), o.dampening(),
                      o.nesterov(), false, first == 1);
}
#endif

// The fused kernel walks parameter, gradient and buffer element by element: they must share a layout.
bool sgdFusable(const detail::Bucket& b, const OptimizerStateMap& state) {
  for (std::size_t i = 0; i < b.params.size(); ++i) {
    if (!detail::sameLayout(b.params[i], b.grads[i]) || !b.params[i].is_non_overlapping_and_dense()) return false;
    auto it = state.find(optimizerStateKey(b.originals[i]));
    if (it != state.end()) {
      const auto& buf = static_cast<const SGDParamState&>(*it->second).momentum_buffer();
      if (buf.defined() && !detail::sameLayout(b.params[i], buf)) return false;
    }
  }
  return true;
}

} // namespace

at::Tensor SGD::step(LossClosure closure) {
  return detail::runStep<torch::optim::SGD>(*this, kernels_, last_, std::move(closure), [&] {
    for (auto& group : param_groups()) {
      const auto& o = static_cast<const SGDOptions&>(group.options());
      for (auto& b : detail::bucketsOf(group.params(), "SGD")) {
        Kernels k = detail::resolve(kernels_, "SGD", b);
        if (k == Kernels::kFused && !sgdFusable(b, state())) {
          if (kernels_ == Kernels::kFused)
            throw ConfigError("ctorch::optim::SGD: the fused kernel needs each gradient and momentum buffer laid out "
                              "as its parameter (use Kernels::kAuto or kForEach)");
          k = Kernels::kForEach;
        }
#if CTORCH_HAS_FUSED_SGD
        if (k == Kernels::kFused) sgdFusedStep(b, o, state());
        else sgdForEachStep(b, o, state());
#else
        sgdForEachStep(b, o, state());
#endif
        last_ = k;
      }
    }
  });
}

} // namespace ctorch::optim
