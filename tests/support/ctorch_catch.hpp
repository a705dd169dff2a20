// Catch2 for every test: Debian bookworm ships v2 (one header), sid ships v3 (a library with a
// header per part and its matchers in Catch::Matchers). Tests include this and spell matchers as
// v2 does (Catch::Contains, Catch::StartsWith, Catch::Matches, Catch::Message, Approx).
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>

#include <string>

namespace Catch {
inline Matchers::StringContainsMatcher Contains(const std::string& text,
                                                CaseSensitive sensitivity = CaseSensitive::Yes) {
  return Matchers::ContainsSubstring(text, sensitivity);
}
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
