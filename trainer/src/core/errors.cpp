// The two questions every caller asks of an exception (errors.hpp), answered in one place.
#include "ctorch/errors.hpp"

#include <c10/util/Exception.h>

namespace ctorch {

std::string errorMessage(const std::exception& e) {
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) return c10->what_without_backtrace();
  return e.what();
}

bool isLostPeer(const std::exception& e) {
  if (dynamic_cast<const DistributedError*>(&e)) return true;
  if (dynamic_cast<const Error*>(&e)) return false;  // the library's others: configuration, snapshots, disks
  const std::string text = errorMessage(e);
  for (const char* mark : {"onnection", "imed out", "imeout", "Gloo", "gloo", "NCCL", "peer", "exited while rank"})
    if (text.find(mark) != std::string::npos) return true;
  return false;
}

} // namespace ctorch
