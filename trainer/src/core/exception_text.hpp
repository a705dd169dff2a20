// Private helper: the one-line text of an exception. c10::Error::what() carries a C++ backtrace in
// LibTorch 1.13; users see the message only.
#pragma once

#include "ctorch/errors.hpp"

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace ctorch::detail {

inline std::string messageOf(const std::exception& e) {
  std::string text = errorMessage(e);
  // Keep the first paragraph: c10 appends "Exception raised from ..." after a newline.
  if (auto pos = text.find("\nException raised from"); pos != std::string::npos) text.resize(pos);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

// True when the message says a wait ran out of time (c10d has no timeout type in 1.13).
inline bool looksLikeTimeout(const std::string& message) {
  for (const char* needle : {"imed out", "imeout", "TIMEOUT", "timed-out"})
    if (message.find(needle) != std::string::npos) return true;
  return false;
}

// A failed collective as one exception: DistributedTimeout when the underlying `message` says it
// timed out, else DistributedError; `text` is the whole line (where, what, the message).
[[noreturn]] inline void throwDistributed(const std::string& text, const std::string& message) {
  if (looksLikeTimeout(message)) throw DistributedTimeout(text);
  throw DistributedError(text);
}

// Runs `f` (a call into c10d or Gloo) and returns what it returns. A failure that is not one of the
// library's own errors becomes one DistributedError (DistributedTimeout): "<describe()> failed:
// <message>" (`describe` is called only then).
template <typename F, typename D>
auto failuresAsDistributed(F&& f, D&& describe) -> decltype(f()) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string message = messageOf(e);
    throwDistributed(describe() + " failed: " + message, message);
  }
}

} // namespace ctorch::detail
