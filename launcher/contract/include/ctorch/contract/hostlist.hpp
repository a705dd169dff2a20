// Slurm hostlist expressions ("node[01-04,07]", "rack[1-2]-node[01-02]", "n1,gpu[1-3],x"),
// expanded the way `scontrol show hostnames` does. Part of the worker contract because both the
// launcher (rendezvous endpoint under srun) and the library (plain `srun` workers) derive the
// master host from SLURM_STEP_NODELIST. Header-only; errors are std::invalid_argument quoting
// the bad expression.
#pragma once

#include <cctype>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::contract {

namespace hostlist_detail {

[[noreturn]] inline void fail(std::string_view expr, const std::string& why) {
  throw std::invalid_argument("invalid Slurm hostlist '" + std::string(expr) + "': " + why);
}

inline bool allDigits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

inline unsigned long long toNumber(std::string_view s, std::string_view expr) {
  if (s.size() > 18) fail(expr, "number '" + std::string(s) + "' is too long");
  unsigned long long v = 0;
  for (char c : s) v = v * 10 + static_cast<unsigned long long>(c - '0');
  return v;
}

inline std::string padded(unsigned long long v, std::size_t width) {
  std::string s = std::to_string(v);
  if (s.size() < width) s.insert(0, width - s.size(), '0');
  return s;
}

// Expands the contents of one bracket ("01-04,07") into the list of suffixes.
inline std::vector<std::string> expandBracket(std::string_view body, std::string_view expr) {
  std::vector<std::string> out;
  if (body.empty()) fail(expr, "empty brackets");
  std::size_t start = 0;
  while (start <= body.size()) {
    std::size_t comma = body.find(',', start);
    std::string_view item =
        body.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    std::size_t dash = item.find('-');
    if (dash == std::string_view::npos) {
      if (!allDigits(item)) fail(expr, "'" + std::string(item) + "' is not a number");
      out.emplace_back(item);
    } else {
      std::string_view lo = item.substr(0, dash), hi = item.substr(dash + 1);
      if (!allDigits(lo) || !allDigits(hi))
        fail(expr, "'" + std::string(item) + "' is not a range like 01-04");
      unsigned long long a = toNumber(lo, expr), b = toNumber(hi, expr);
      if (b < a) fail(expr, "range '" + std::string(item) + "' goes backwards");
      if (b - a > 1000000) fail(expr, "range '" + std::string(item) + "' is too large");
      for (unsigned long long v = a; v <= b; ++v) out.push_back(padded(v, lo.size()));
    }
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

// Expands one host expression without top-level commas ("rack[1-2]-node[01-02]").
inline void expandOne(std::string_view item, std::string_view expr, std::vector<std::string>& out) {
  std::vector<std::string> partial{""};
  std::size_t i = 0;
  while (i < item.size()) {
    std::size_t open = item.find('[', i);
    std::string_view literal = item.substr(i, open == std::string_view::npos ? std::string_view::npos : open - i);
    if (literal.find(']') != std::string_view::npos) fail(expr, "unbalanced ']'");
    for (auto& p : partial) p.append(literal);
    if (open == std::string_view::npos) break;
    std::size_t close = item.find(']', open);
    if (close == std::string_view::npos) fail(expr, "unbalanced '['");
    std::string_view body = item.substr(open + 1, close - open - 1);
    if (body.find('[') != std::string_view::npos) fail(expr, "nested '['");
    auto suffixes = expandBracket(body, expr);
    std::vector<std::string> next;
    next.reserve(partial.size() * suffixes.size());
    for (const auto& p : partial)
      for (const auto& s : suffixes) next.push_back(p + s);
    partial = std::move(next);
    i = close + 1;
  }
  for (auto& p : partial) out.push_back(std::move(p));
}

} // namespace hostlist_detail

// Expands a Slurm hostlist into host names, in order. Throws std::invalid_argument.
inline std::vector<std::string> expandHostlist(std::string_view expr) {
  using namespace hostlist_detail;
  std::vector<std::string> hosts;
  std::size_t depth = 0, start = 0;
  for (std::size_t i = 0; i <= expr.size(); ++i) {
    char c = i < expr.size() ? expr[i] : ',';
    if (c == '[') ++depth;
    if (c == ']') {
      if (depth == 0) fail(expr, "unbalanced ']'");
      --depth;
    }
    if (c == ',' && depth == 0) {
      std::string_view item = expr.substr(start, i - start);
      // Slurm tolerates surrounding blanks in hand-written lists.
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
      while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
      if (item.empty()) fail(expr, "empty host name");
      expandOne(item, expr, hosts);
      start = i + 1;
    }
  }
  if (depth != 0) fail(expr, "unbalanced '['");
  return hosts;
}

// The first host of a hostlist (the head node of a Slurm step).
inline std::string firstHost(std::string_view expr) {
  auto hosts = expandHostlist(expr);
  if (hosts.empty()) hostlist_detail::fail(expr, "no hosts");
  return hosts.front();
}

} // namespace ctorch::contract
