// ctorch's version and the LibTorch it was built against, as --version prints them.
#include "ctorch/version.hpp"

#include <torch/version.h>

#include <string_view>

// Set by trainer/CMakeLists.txt from dpkg (empty when no package owns LibTorch); a build of these
// sources by other means (the fuzzers) knows no package.
#ifndef CTORCH_TORCH_PACKAGE
#define CTORCH_TORCH_PACKAGE ""
#endif

namespace ctorch {

namespace {

// "1.13.1" of "1.13.1+dfsg-4" or "1:2.14.1-2": the upstream release in a distribution's version.
std::string_view upstreamOf(std::string_view version) {
  const auto epoch = version.find(':');
  if (epoch != std::string_view::npos) version.remove_prefix(epoch + 1);
  return version.substr(0, version.find_first_of("+-~"));
}

}  // namespace

std::string versionString() {
  const std::string_view package = CTORCH_TORCH_PACKAGE;  // "libtorch1.13 1.13.1+dfsg-4", or empty
  const auto space = package.find(' ');
  if (space == std::string_view::npos) return std::string("ctorch ") + CTORCH_VERSION + " (LibTorch " + TORCH_VERSION + ")";
  const std::string_view upstream = upstreamOf(package.substr(space + 1));
  std::string text = std::string("ctorch ") + CTORCH_VERSION + " (LibTorch " + std::string(upstream) + ", the package " +
                     std::string(package);
  if (upstream != TORCH_VERSION) text += std::string(", whose headers say ") + TORCH_VERSION;
  return text + ")";
}

} // namespace ctorch
