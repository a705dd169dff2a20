// Version of the ctorch library, and of the LibTorch it was built against.
#pragma once

#include <string>

namespace ctorch {

// "ctorch <version> (LibTorch <major>.<minor>.<patch>)"; with a distribution's LibTorch also its
// package, whose release the headers may not say: "ctorch 0.9.0 (LibTorch 1.13.1, the package
// libtorch1.13 1.13.1+dfsg-4, whose headers say 1.13.0)".
std::string versionString();

} // namespace ctorch
