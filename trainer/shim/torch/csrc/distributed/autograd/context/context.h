// Shim for LibTorch packages (Debian's libtorch-dev 1.13) that omit this header, which c10d's
// reducer.hpp includes. It declares only the two names reducer.hpp uses; the layout-relevant one
// (ContextPtr) is a std::shared_ptr, exactly as in the real header. Added to the include path by
// cmake/CtorchTorch.cmake only when the real header is missing.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

} // namespace autograd
} // namespace distributed
} // namespace torch
