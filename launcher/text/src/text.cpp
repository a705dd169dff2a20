// The launcher's shared text helpers (text.hpp): trimming, splitting, joining, lower case and
// the "1.5 s" duration text, written once for every launcher library.
#include "ctorch/text/text.hpp"

#include <cctype>
#include <sstream>

namespace ctorch::text {

std::string_view trim(std::string_view s, std::string_view chars) {
  const auto first = s.find_first_not_of(chars);
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(chars);
  return s.substr(first, last - first + 1);
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  for (;;) {
    const std::size_t p = s.find(sep, start);
    out.emplace_back(s.substr(start, p == std::string_view::npos ? std::string_view::npos : p - start));
    if (p == std::string_view::npos) break;
    start = p + 1;
  }
  return out;
}

std::string join(const std::vector<std::string>& pieces, std::string_view sep) {
  std::string out;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (i) out += sep;
    out += pieces[i];
  }
  return out;
}

std::string toLower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return out;
}

namespace {

bool isDigit(char c) { return c >= '0' && c <= '9'; }

// Advances `i` past a run of digits; how many there were.
std::size_t digits(std::string_view s, std::size_t& i) {
  const std::size_t start = i;
  while (i < s.size() && isDigit(s[i])) ++i;
  return i - start;
}

std::size_t sign(std::string_view s, std::size_t i) { return i < s.size() && (s[i] == '+' || s[i] == '-') ? i + 1 : i; }

}  // namespace

bool isDecimalInteger(std::string_view s) {
  std::size_t i = sign(s, 0);
  return digits(s, i) > 0 && i == s.size();
}

bool isDecimalNumber(std::string_view s) {
  std::size_t i = sign(s, 0);
  std::size_t mantissa = digits(s, i);
  if (i < s.size() && s[i] == '.') mantissa += digits(s, ++i);
  if (mantissa == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    i = sign(s, i + 1);
    if (digits(s, i) == 0) return false;
  }
  return i == s.size();
}

std::string secondsText(std::chrono::milliseconds d, int significantDigits) {
  std::ostringstream os;
  os.precision(significantDigits);
  os << static_cast<double>(d.count()) / 1000.0 << " s";
  return os.str();
}

} // namespace ctorch::text
