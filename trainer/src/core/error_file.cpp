#include "ctorch/error_file.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/errors.hpp"
#include "ctorch/durable_io.hpp"

#include "core/file_io.hpp"

#include <c10/util/Exception.h>

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string_view>
#include <typeinfo>

namespace ctorch {
namespace {

namespace ef = contract::error_file;

std::string demangle(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(mangled, nullptr, nullptr, &status),
                                              std::free);
  return status == 0 && name ? std::string(name.get()) : std::string(mangled);
}

std::string whatOf(const std::exception& e) { return errorMessage(e); }

// The chain of std::nested_exception causes, innermost last.
void appendNested(const std::exception& e, std::string& out, int depth = 0) {
  try {
    std::rethrow_if_nested(e);
  } catch (const std::exception& inner) {
    out += "\ncaused by: " + describeException(inner);
    if (depth < 16) appendNested(inner, out, depth + 1);
  } catch (...) {
    out += "\ncaused by: an exception not derived from std::exception";
  }
}

void appendUtf8Escaped(std::string& out, const std::string& s) {
  static const char* kHex = "0123456789abcdef";
  auto u = [&](unsigned cp) {
    out += "\\u";
    for (int shift = 12; shift >= 0; shift -= 4) out.push_back(kHex[(cp >> shift) & 15]);
  };
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"') out += "\\\"", ++i;
    else if (c == '\\') out += "\\\\", ++i;
    else if (c == '\n') out += "\\n", ++i;
    else if (c == '\r') out += "\\r", ++i;
    else if (c == '\t') out += "\\t", ++i;
    else if (c < 0x20 || c == 0x7f) u(c), ++i;
    else if (c < 0x80) out.push_back(static_cast<char>(c)), ++i;
    else {
      // A UTF-8 sequence becomes \u escapes (surrogate pairs above U+FFFF); a byte that does not
      // start a valid sequence becomes U+FFFD, so the file is always valid JSON.
      const int len = c >= 0xF0 && c < 0xF5 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 && c < 0xE0 ? 2 : 0;
      unsigned cp = len == 4 ? c & 0x07 : len == 3 ? c & 0x0F : c & 0x1F;
      bool ok = len > 0 && i + static_cast<std::size_t>(len) <= s.size();
      for (int k = 1; ok && k < len; ++k) {
        const auto cc = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
        ok = (cc & 0xC0) == 0x80;
        cp = (cp << 6) | (cc & 0x3F);
      }
      ok = ok && !(len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp < 0xE000))) &&
           !(len == 4 && (cp < 0x10000 || cp > 0x10FFFF));
      if (!ok) {
        u(0xFFFD);
        ++i;
        continue;
      }
      if (cp >= 0x10000) {
        cp -= 0x10000;
        u(0xD800 + (cp >> 10));
        u(0xDC00 + (cp & 0x3FF));
      } else {
        u(cp);
      }
      i += static_cast<std::size_t>(len);
    }
  }
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  appendUtf8Escaped(out, s);
  return out + "\"";
}

bool writeRecord(const std::string& message, const std::string& details, bool retryable) {
  const char* path = std::getenv(contract::env::kErrorFile);
  if (!path || !*path) return false;
  try {
    writeFileAtomically(path, errorFileJson(message, details, std::chrono::system_clock::now(), retryable));
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "warning: could not write the error file %s (%s): %s\n",
                 contract::env::kErrorFile, path, e.what());
    return false;
  }
}

} // namespace

std::string describeException(const std::exception& error) {
  return demangle(typeid(error).name()) + ": " + whatOf(error);
}

std::string errorFileJson(const std::string& message, const std::string& details,
                          std::chrono::system_clock::time_point when, bool retryable) {
  const auto seconds =
      std::chrono::duration_cast<std::chrono::seconds>(when.time_since_epoch()).count();
  // Python's torchrun reads message.extraInfo.timestamp with int(), so it is a decimal string.
  return std::string("{") + jsonString(ef::kMessage) + ": {" + jsonString(ef::kMessage) + ": " +
         jsonString(message) + ", " + jsonString(ef::kExtraInfo) + ": {" +
         jsonString(ef::kCallstack) + ": " + jsonString(details) + ", " +
         jsonString(ef::kTimestamp) + ": " + jsonString(std::to_string(seconds)) +
         (retryable ? std::string() : ", " + jsonString(ef::kRetry) + ": " + jsonString(ef::kRetryNever)) + "}}}";
}

std::string trimBacktrace(const std::string& text) {
  std::string out;
  std::size_t omitted = 0;
  auto flush = [&] {
    if (omitted == 0) return;
    out += "(" + std::to_string(omitted) + (omitted == 1 ? " frame" : " frames") + " without symbols left out)\n";
    omitted = 0;
  };
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + start, end - start);
    const auto first = line.find_first_not_of(' ');
    const bool frame = first != std::string_view::npos && line.substr(first, 7) == "frame #";
    if (frame && line.find("<unknown function>") != std::string_view::npos) {
      ++omitted;
    } else {
      flush();
      out.append(line);
      if (end < text.size()) out += '\n';
    }
    start = end + 1;
  }
  flush();
  return out;
}

bool recordError(const std::exception& error) {
  const bool deterministic =
      dynamic_cast<const ConfigError*>(&error) != nullptr || dynamic_cast<const SnapshotIncompatible*>(&error) != nullptr;
  return recordError(error, !deterministic);
}

bool recordError(const std::exception& error, bool retryable) {
  try {
    const std::string message = describeException(error);
    std::string details = message;
    appendNested(error, details);
    if (dynamic_cast<const c10::Error*>(&error)) details += "\n\n" + trimBacktrace(error.what());
    return writeRecord(message, details, retryable);
  } catch (...) {
    return false;
  }
}

bool recordErrorMessage(const std::string& message, const std::string& details, bool retryable) {
  try {
    return writeRecord(message, details.empty() ? message : details, retryable);
  } catch (...) {
    return false;
  }
}

int runRecorded(const std::function<int()>& body) {
  try {
    return body();
  } catch (const Stopped& e) {
    std::cerr << e.what() << std::endl;
    return contract::kExitPreempted;
  } catch (const std::exception& e) {
    recordError(e);
    std::cerr << "error: " << describeException(e) << std::endl;
  } catch (...) {
    const std::string message = "unknown exception (not derived from std::exception)";
    recordErrorMessage(message);
    std::cerr << "error: " << message << std::endl;
  }
  return contract::kExitFailure;
}

} // namespace ctorch
