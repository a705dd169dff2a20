// ctorch::UnitSequential: torch::nn::Sequential whose children FullyShardedDataParallel may make units
// of their own with no edit of the model: its forward calls each child as ctorch::unitForward would
// (a plain Sequential when no FSDP holds it). Replace torch::nn::Sequential by it inside a model:
//   blocks = register_module("blocks", ctorch::UnitSequential(Block(64), Block(64), Block(64)));
//   x = blocks->forward(x);   // each Block a unit under moduleTypeWrapPolicy<BlockImpl>()
// A FullyShardedDataParallel whose root module is a torch::nn::Sequential calls its children that way
// by itself. What still needs ctorch::unitForward, and why: any other parent's call of a unit (LibTorch
// has no module hooks, so nothing else can see a submodule's forward begin and end), a
// torch::nn::Sequential nested inside another module, and the loop over a ModuleList
// (x = ctorch::unitForward(list[i]->as<BlockImpl>(), x)). docs/sharding.md.
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/fsdp_unit.hpp"

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace ctorch {
namespace detail {

// One child of a Sequential, through its unit when it is one. A unit's output must be a tensor: the
// hook that gathers the unit's parameters again before its backward is placed on it.
template <typename... Args>
torch::nn::AnyValue unitAnyForward(torch::nn::AnyModule& child, std::size_t index, Args&&... args) {
  FSDPUnit* unit = unitOf(child.ptr().get());
  if (unit == nullptr) return child.any_forward(std::forward<Args>(args)...);
  beginUnitForward(*unit);
  torch::nn::AnyValue output = child.any_forward(std::forward<Args>(args)...);
  at::Tensor* tensor = output.try_get<at::Tensor>();
  if (tensor == nullptr)
    throw ConfigError("UnitSequential: child " + std::to_string(index) + " (" + child.ptr()->name() +
                      ") is a unit but returns no tensor: call it through ctorch::unitForward in a forward of your own");
  endUnitForward(*unit, {*tensor});
  return output;
}

// Sequential::forward, each child through its unit.
template <typename ReturnType, typename... InputTypes>
ReturnType sequentialUnitForward(torch::nn::SequentialImpl& sequential, InputTypes&&... inputs) {
  if (sequential.is_empty()) throw ConfigError("UnitSequential: forward() of an empty Sequential");
  auto child = sequential.begin();
  std::size_t index = 0;
  torch::nn::AnyValue value = unitAnyForward(*child, index, std::forward<InputTypes>(inputs)...);
  for (++child, ++index; child != sequential.end(); ++child, ++index)
    value = unitAnyForward(*child, index, std::move(value));
  if (ReturnType* result = value.try_get<ReturnType>()) return std::move(*result);
  throw ConfigError(std::string("UnitSequential: the last child returns ") + value.type_info().name() +
                    ", not the type forward was asked for (" + typeid(ReturnType).name() + ")");
}

} // namespace detail

class UnitSequentialImpl : public torch::nn::SequentialImpl {
 public:
  using torch::nn::SequentialImpl::SequentialImpl;

  template <typename ReturnType = at::Tensor, typename... InputTypes>
  ReturnType forward(InputTypes&&... inputs) {
    return detail::sequentialUnitForward<ReturnType>(*this, std::forward<InputTypes>(inputs)...);
  }
};
TORCH_MODULE(UnitSequential);

} // namespace ctorch
