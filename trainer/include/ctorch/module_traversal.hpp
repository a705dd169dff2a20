// The two pieces of module plumbing every wrapper shares (DistributedDataParallel, FullyShardedDataParallel,
// ctorch::unitForward): the shared_ptr behind whatever a user passes as "the module", and a visit of every
// tensor inside a forward's output (Python's _find_tensors over outputs of any nesting).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace ctorch::detail {

template <class T>
struct IsTuple : std::false_type {};
template <class... Ts>
struct IsTuple<std::tuple<Ts...>> : std::true_type {};
template <class A, class B>
struct IsTuple<std::pair<A, B>> : std::true_type {};
template <class T>
struct IsVector : std::false_type {};
template <class T, class A>
struct IsVector<std::vector<T, A>> : std::true_type {};
template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};

// Visits every tensor inside a forward's output (a Tensor, vectors, tuples, pairs and optionals of
// them; numbers and strings hold none). Returns false for a type it cannot look into.
template <class T, class F>
bool visitTensors(T& value, F& f) {
  using V = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<V, at::Tensor>) {
    f(value);
    return true;
  } else if constexpr (IsVector<V>::value) {
    for (auto& item : value)
      if (!visitTensors(item, f)) return false;
    return true;
  } else if constexpr (IsTuple<V>::value) {
    return std::apply([&](auto&... items) { return (visitTensors(items, f) && ... && true); }, value);
  } else if constexpr (IsOptional<V>::value) {
    return value ? visitTensors(*value, f) : true;
  } else if constexpr (std::is_arithmetic_v<V> || std::is_enum_v<V> || std::is_same_v<V, std::string>) {
    return true;
  } else {
    return false;
  }
}

template <class M>
std::shared_ptr<torch::nn::Module> modulePointer(const M& module) {
  if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, M>) {
    return module.ptr();
  } else {
    static_assert(std::is_convertible_v<M, std::shared_ptr<torch::nn::Module>>,
                  "a module is passed as a torch::nn module holder (torch::nn::Linear, a "
                  "TORCH_MODULE) or a std::shared_ptr to a torch::nn::Module");
    return module;
  }
}

} // namespace ctorch::detail
