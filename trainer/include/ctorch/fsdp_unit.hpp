// ctorch::unitForward: how a model calls a submodule that FullyShardedDataParallel may have made a unit
// of its own (a plain call when no FSDP holds it). A model includes this, not the FSDP header:
//   x = F::relu(ctorch::unitForward(conv1, x));
#pragma once

#include "ctorch/module_traversal.hpp"

#include <ATen/core/Tensor.h>

#include <type_traits>
#include <utility>
#include <vector>

namespace ctorch {

namespace detail {

struct FSDPUnit;

// The unit a module is, under a live FullyShardedDataParallel (null: none).
FSDPUnit* unitOf(const torch::nn::Module* module);
void beginUnitForward(FSDPUnit& unit);
void endUnitForward(FSDPUnit& unit, const std::vector<at::Tensor>& outputs);
// The unit's FSDP's MixedPrecisionPolicy applied to one input (paramDtype) or output (outputDtype).
at::Tensor castUnitInput(const FSDPUnit& unit, const at::Tensor& input);
at::Tensor castUnitOutput(const FSDPUnit& unit, const at::Tensor& output);

template <class A>
decltype(auto) castUnitArgument(const FSDPUnit& unit, A&& arg) {
  if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) return castUnitInput(unit, arg);
  else return std::forward<A>(arg);
}

template <class M>
const torch::nn::Module* rawModule(const M& module) {
  if constexpr (std::is_pointer_v<M>) return module;
  else return modulePointer(module).get();
}

} // namespace detail

// Calls module->forward(args...). When the module is a unit of a FullyShardedDataParallel, its
// parameters are gathered before (waiting for a prefetch) and, with reshardAfterForward, freed after;
// its outputs carry the hook that gathers them again before its backward. Under a MixedPrecisionPolicy
// its tensor arguments are cast to paramDtype and its outputs to outputDtype, as Python's are.
// `module`: a module holder (torch::nn::Linear, a TORCH_MODULE), a std::shared_ptr to a module, or a
// raw pointer to one (list[i]->as<BlockImpl>()).
template <class M, class... Args>
auto unitForward(M& module, Args&&... args) {
  detail::FSDPUnit* unit = detail::unitOf(detail::rawModule(module));
  if (unit == nullptr) return module->forward(std::forward<Args>(args)...);
  detail::beginUnitForward(*unit);
  auto output = module->forward(detail::castUnitArgument(*unit, std::forward<Args>(args))...);
  std::vector<at::Tensor> tensors;
  auto collect = [&](at::Tensor& t) {
    t = detail::castUnitOutput(*unit, t);
    tensors.push_back(t);
  };
  detail::visitTensors(output, collect);
  detail::endUnitForward(*unit, tensors);
  return output;
}

} // namespace ctorch
