// The launcher's small text helpers, written once: trimming, splitting, joining, lower case and
// a duration as "1.5 s". Used by the command line, the rendezvous backends and their logs.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::text {

// What trim() removes unless told otherwise: blanks and tabs (the command line's values).
inline constexpr std::string_view kBlanks = " \t";
// Every ASCII white-space character (std::isspace in the C locale).
inline constexpr std::string_view kWhiteSpace = " \t\n\r\f\v";

// `s` without the leading and trailing characters found in `chars`.
std::string_view trim(std::string_view s, std::string_view chars = kBlanks);

// The pieces of `s` between each `sep`, empty ones included ("a,,b" → a, "", b; "" → one "").
std::vector<std::string> split(std::string_view s, char sep);

// The pieces with `sep` between them ("a, b, c" for join(v, ", ")).
std::string join(const std::vector<std::string>& pieces, std::string_view sep);

// ASCII lower case.
std::string toLower(std::string_view s);

// A number written plainly in decimal, nothing around it: an optional sign, digits, and (for
// isDecimalNumber) a fraction and an exponent ("-2", "0.5", "1e3", ".5"). Not " 2", "0x10", "inf",
// "nan" or "1_000", which the C library's strtol/strtod or Python would take.
bool isDecimalInteger(std::string_view s);
bool isDecimalNumber(std::string_view s);

// A duration in seconds for a log or an error line: "1.5 s", "30 s", "0.25 s"; at most
// `significantDigits` significant digits (an ostream's precision).
std::string secondsText(std::chrono::milliseconds d, int significantDigits = 6);

} // namespace ctorch::text
