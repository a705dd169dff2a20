// Differences between the LibTorch versions ctorch supports (1.13 here; 2.x for users), kept in
// this one header. Each item says which versions differ and how.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace ctorch::compat {

// ---- Optimizer state keys ---------------------------------------------------------------------------
// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl: 1.13 (and 2.0) use its
// address printed as a string (c10::guts::to_string), later 2.x releases the void* itself. The key
// type is taken from the map, so both compile without a version number.
using OptimizerStateMap =
    std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using OptimizerStateKey = typename OptimizerStateMap::key_type;

namespace detail {
template <typename Key>
Key optimizerStateKey(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;  // what c10::guts::to_string does
    os << impl;
    return os.str();
  } else {
    return static_cast<Key>(impl);
  }
}
} // namespace detail

inline OptimizerStateKey optimizerStateKey(const at::Tensor& parameter) {
  return detail::optimizerStateKey<OptimizerStateKey>(parameter.unsafeGetTensorImpl());
}

} // namespace ctorch::compat
