// Whether bytes are UTF-8 as Python decodes them: a snapshot's strings and record names must be, or
// Python's torch.load (its unpickler, its zipfile) cannot open a file LibTorch reads byte for byte.
// Private to the library; header-only so that the fuzz targets' own builds need nothing more.
#pragma once

#include <cstddef>
#include <string_view>

namespace ctorch::detail {

// Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
inline bool isUtf8(std::string_view s) {
  std::size_t i = 0;
  const std::size_t n = s.size();
  auto byte = [&](std::size_t at) { return static_cast<unsigned char>(s[at]); };
  auto continuation = [&](std::size_t at) { return at < n && (byte(at) & 0xC0) == 0x80; };
  while (i < n) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      ++i;
    } else if (c >= 0xC2 && c <= 0xDF) {
      if (!continuation(i + 1)) return false;
      i += 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      if (!continuation(i + 1) || !continuation(i + 2)) return false;
      const unsigned char c1 = byte(i + 1);
      if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0)) return false;  // overlong, surrogate
      i += 3;
    } else if (c >= 0xF0 && c <= 0xF4) {
      if (!continuation(i + 1) || !continuation(i + 2) || !continuation(i + 3)) return false;
      const unsigned char c1 = byte(i + 1);
      if ((c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90)) return false;  // overlong, > U+10FFFF
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

inline bool isAscii(std::string_view s) {
  for (char c : s)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

} // namespace ctorch::detail
