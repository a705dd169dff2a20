// ctorch-train's command line checked for its shape before CLI11 sees it (argument_check.hpp):
// unknown flags with a "did you mean" (by prefix, else by edit distance), missing values, values
// that are not whole numbers or plain decimals where the flag needs one.
#include "argument_check.hpp"

#include "ctorch/train/options.hpp"

#include "option_choices.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <regex>

namespace ctorch::train {

using choices::bad;

// CLI11's own messages ("The following arguments were not expected: 1 --epoch", "Could not convert")
// neither quote the flag the way the other errors do nor say what to type instead, and their text
// differs between CLI11 releases. Everything a user can get wrong in the shape of the command line is
// therefore checked here first, against the options as they were added to the app.

namespace {

// Restricted Damerau-Levenshtein distance: insertions, deletions, substitutions and swaps of two
// neighbouring characters (--lr-deacy) each cost one.
std::size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// " (did you mean --epochs?)" for --epoch: the known flags that start with what was typed, else the
// nearest ones within a third of its length in edits (at least 2); "" when nothing is close.
std::string didYouMean(const std::string& typed, const FlagKinds& known) {
  std::vector<std::string> near;
  for (const auto& [name, kind] : known)
    if (typed.size() > 2 && name.rfind(typed, 0) == 0) near.push_back(name);
  if (near.empty()) {
    const std::size_t limit = std::max<std::size_t>(2, (typed.size() - 2) / 3);
    std::size_t best = limit + 1;
    for (const auto& [name, kind] : known) {
      const std::size_t dist = editDistance(typed.substr(2), name.substr(2));
      if (dist < best) near.clear(), best = dist;
      if (dist == best) near.push_back(name);
    }
  }
  if (near.empty()) return "";
  if (near.size() > 3) near.resize(3);
  std::string out = " (did you mean ";
  for (std::size_t i = 0; i < near.size(); ++i) out += (i == 0 ? "" : i + 1 == near.size() ? " or " : ", ") + near[i];
  return out + "?)";
}

// Plain decimal, as Python's argparse users write it: "0.05", "-1", "1e-3", ".5". Not what strtod
// alone would also take: "0x10" (16), "inf", "nan", " 2".
bool isNumber(const std::string& text) {
  static const std::regex decimal(R"([+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)");
  return std::regex_match(text, decimal);
}

}  // namespace

bool isWholeNumber(const std::string& text, ValueKind kind) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (*end != '\0' || errno == ERANGE) return false;
  return kind != ValueKind::kInt32 || (v >= INT_MIN && v <= INT_MAX);
}

void checkArguments(const std::vector<std::string>& typed, const std::vector<std::string>& args,
                    const FlagKinds& known) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool negativeNumber = a.size() > 1 && a[0] == '-' && (std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.');
    if (a == "--") {
      if (i + 1 < args.size())
        throw UsageError("unexpected argument '" + typed[i + 1] + "' after '--': ctorch-train takes options only");
      return;
    }
    if (a.size() < 2 || a[0] != '-' || negativeNumber)
      throw UsageError("unexpected argument '" + typed[i] +
                       "': ctorch-train takes options only (a value needs its flag before it, e.g. --epochs 3)");
    const auto eq = a.find('=');
    const std::string name = a.substr(0, eq);
    const std::string typedName = typed[i].substr(0, typed[i].find('='));
    const auto found = known.find(name);
    if (found == known.end()) {
      const std::string hint = a.rfind("--", 0) == 0 ? didYouMean(name, known) : "";
      throw UsageError("unknown option '" + typedName + "'" + (hint.empty() ? " (see ctorch-train --help)" : hint));
    }
    if (found->second == ValueKind::kFlag) continue;  // a value after '=' is CLI11's to judge
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else {
      const bool missing = i + 1 >= args.size() ||
                           (args[i + 1].rfind("--", 0) == 0 && known.count(args[i + 1].substr(0, args[i + 1].find('='))));
      if (missing) throw UsageError(typedName + " needs a value (see ctorch-train --help)");
      value = typed[++i];
    }
    if ((found->second == ValueKind::kInt64 || found->second == ValueKind::kInt32) &&
        !isWholeNumber(value, found->second))
      bad(typedName, value, isNumber(value) ? "is not a whole number in range" : "is not a number");
    if (found->second == ValueKind::kNumber && !isNumber(value)) bad(typedName, value, "is not a number");
  }
}

}  // namespace ctorch::train
