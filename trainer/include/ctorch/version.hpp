// Version of the ctorch library, and of the LibTorch it was built against.
#pragma once

#include <string>

namespace ctorch {

// "ctorch <version> (LibTorch <major>.<minor>.<patch>)"
std::string versionString();

} // namespace ctorch
