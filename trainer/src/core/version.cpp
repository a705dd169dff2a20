#include "ctorch/version.hpp"

#include <torch/version.h>

namespace ctorch {

std::string versionString() {
  return std::string("ctorch ") + CTORCH_VERSION + " (LibTorch " + TORCH_VERSION + ")";
}

} // namespace ctorch
