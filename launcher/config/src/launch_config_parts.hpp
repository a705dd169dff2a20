// What the two halves of the launch configuration share (launch_config.cpp: the raw options into one
// validated LaunchConfig; launch_values.cpp: each flag's value parsed and checked). Internal.
#pragma once

#include "ctorch/text/text.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <string>

namespace ctorch::launcher::config_parts {

inline std::string quote(const std::string& s) { return "'" + s + "'"; }

// Strict decimal integer in [lo, hi], nothing around it (" 2" is not one); nullopt otherwise.
inline std::optional<long long> toInt(const std::string& s, long long lo, long long hi) {
  if (s.size() > 18 || !text::isDecimalInteger(s)) return std::nullopt;
  long long v = std::stoll(s);
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

inline bool isExecutableFile(const std::filesystem::path& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
}

} // namespace ctorch::launcher::config_parts
