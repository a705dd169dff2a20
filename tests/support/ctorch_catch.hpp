// Catch2 for every test: Debian bookworm ships v2 (one header), sid ships v3 (a library with a
// header per part and its matchers in Catch::Matchers). Tests include this and spell matchers as
// v2 does (Catch::Contains, Catch::Equals, Catch::StartsWith, Catch::Matches, Catch::Message, Approx).
// The version is the one CMake found (CTORCH_CATCH2_MAJOR), not whichever headers come first on
// the include path: a machine with a v3 in /usr/local and a v2 package handed to CMake links v2.
#pragma once

#ifndef CTORCH_CATCH2_MAJOR
#error "CTORCH_CATCH2_MAJOR is set by tests/CMakeLists.txt from the Catch2 package it found"
#endif
#if CTORCH_CATCH2_MAJOR >= 3
#include <catch2/catch_all.hpp>

#include <string>

namespace Catch {
inline Matchers::StringContainsMatcher Contains(const std::string& text,
                                                CaseSensitive sensitivity = CaseSensitive::Yes) {
  return Matchers::ContainsSubstring(text, sensitivity);
}
using Matchers::Equals;
using Matchers::Matches;
using Matchers::Message;
using Matchers::StartsWith;
} // namespace Catch
using Catch::Approx;
#define CTORCH_CATCH_V3 1
#else
#include <catch2/catch.hpp>
#define CTORCH_CATCH_V3 0
#endif
