#include "ctorch/rdzv/c10d/settings.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/text/text.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

namespace ctorch::rdzv::c10d {

namespace {

// --rdzv-conf and --rdzv-endpoint text: every white-space character around a piece goes.
std::string_view trim(std::string_view s) { return text::trim(s, text::kWhiteSpace); }

[[noreturn]] void bad(const std::string& what) { throw RendezvousConfigError(what); }

// Seconds, decimals allowed ("30", "0.5"); strictly positive.
milliseconds parseSeconds(const std::string& key, const std::string& value) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !text::isDecimalNumber(value) || !std::isfinite(v))
    bad("--rdzv-conf " + key + "='" + value + "' is not a number of seconds");
  if (v <= 0) bad("--rdzv-conf " + key + "='" + value + "' must be positive");
  if (v > 1e9) bad("--rdzv-conf " + key + "='" + value + "' is too large");
  auto ms = static_cast<long long>(std::llround(v * 1000.0));
  if (ms < 1) bad("--rdzv-conf " + key + "='" + value + "' is below one millisecond");
  return milliseconds(ms);
}

int parseCount(const std::string& key, const std::string& value) {
  std::size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !text::isDecimalInteger(value))
    bad("--rdzv-conf " + key + "='" + value + "' is not a whole number");
  if (v < 1 || v > 1000000) bad("--rdzv-conf " + key + "='" + value + "' must be between 1 and 1000000");
  return static_cast<int>(v);
}

// torch's RendezvousParameters.get_as_bool spellings.
bool parseBool(const std::string& key, const std::string& value) {
  const std::string v = text::toLower(value);
  if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y") return true;
  if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n") return false;
  bad("--rdzv-conf " + key + "='" + value + "' is not a boolean (use true or false)");
}

} // namespace

void Settings::validate() const {
  if (runId.empty()) bad("the rendezvous id (--rdzv-id) must not be empty");
  for (char c : runId)
    if (std::iscntrl(static_cast<unsigned char>(c)))
      bad("the rendezvous id (--rdzv-id) must not contain control characters");
  if (minNodes < 1) bad("the minimum number of nodes (" + std::to_string(minNodes) + ") must be at least 1");
  if (maxNodes < minNodes)
    bad("the maximum number of nodes (" + std::to_string(maxNodes) +
        ") must not be below the minimum (" + std::to_string(minNodes) + ")");
  const std::pair<const char*, milliseconds> times[] = {
      {"join_timeout", joinTimeout},           {"last_call_timeout", lastCallTimeout},
      {"close_timeout", closeTimeout},         {"heartbeat_timeout", heartbeatTimeout},
      {"read_timeout", readTimeout},           {"keep_alive_interval", keepAliveInterval}};
  for (const auto& [name, value] : times)
    if (value.count() <= 0) bad(std::string(name) + " (" + text::secondsText(value) + ") must be positive");
  if (keepAliveMaxAttempt < 1)
    bad("keep_alive_max_attempt (" + std::to_string(keepAliveMaxAttempt) + ") must be at least 1");
}

const std::vector<std::string>& rdzvConfKeys() {
  static const std::vector<std::string> keys = {
      "join_timeout",        "last_call_timeout",      "close_timeout", "heartbeat_timeout",
      "read_timeout",        "keep_alive_interval",    "heartbeat",     "keep_alive_max_attempt",
      "is_host",             "store_type"};
  return keys;
}

namespace {

// One key=value of a --rdzv-conf for the c10d rendezvous, into `conf`.
void applyC10dKey(RdzvConf& conf, const std::string& key, const std::string& value) {
  if (key == "join_timeout") conf.joinTimeout = parseSeconds(key, value);
  else if (key == "last_call_timeout") conf.lastCallTimeout = parseSeconds(key, value);
  else if (key == "close_timeout") conf.closeTimeout = parseSeconds(key, value);
  else if (key == "heartbeat_timeout") conf.heartbeatTimeout = parseSeconds(key, value);
  else if (key == "read_timeout") conf.readTimeout = parseSeconds(key, value);
  else if (key == "keep_alive_interval" || key == "heartbeat") conf.keepAliveInterval = parseSeconds(key, value);
  else if (key == "keep_alive_max_attempt") conf.keepAliveMaxAttempt = parseCount(key, value);
  else if (key == "is_host") conf.isHost = parseBool(key, value);
  else if (key == "store_type" && text::toLower(value) != "tcp")
    bad("--rdzv-conf store_type='" + value + "' is not supported (only tcp)");
}

} // namespace

RdzvConf parseRdzvConf(std::string_view text, RdzvConfKeys keys) {
  RdzvConf conf;
  text = trim(text);
  if (text.empty()) return conf;
  std::set<std::string> seen;
  for (const auto& piece : ctorch::text::split(text, ',')) {
    const std::string_view item = trim(piece);
    std::size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      bad("--rdzv-conf entry '" + std::string(item) + "' is not key=value");
    const std::string given(trim(item.substr(0, eq)));
    std::string key = given;
    std::string value(trim(item.substr(eq + 1)));
    std::replace(key.begin(), key.end(), '-', '_');
    if (key.empty()) bad("--rdzv-conf entry '" + std::string(item) + "' has no key");
    const auto& known = rdzvConfKeys();
    if (keys == RdzvConfKeys::kC10d && std::find(known.begin(), known.end(), key) == known.end()) {
      bad("--rdzv-conf key '" + key + "' is unknown (known: " + ctorch::text::join(known, ", ") + ")");
    }
    if (value.empty()) bad("--rdzv-conf " + key + " has no value");
    // The c10d keys by meaning (heartbeat is keep_alive_interval); other backends' as given.
    const std::string canonical = keys == RdzvConfKeys::kAny ? given
                                  : key == "heartbeat"     ? "keep_alive_interval"
                                                           : key;
    if (!seen.insert(canonical).second) bad("--rdzv-conf " + key + " is given twice");
    if (keys == RdzvConfKeys::kC10d) applyC10dKey(conf, key, value);
    conf.entries.emplace_back(given, value);
  }
  return conf;
}

Settings makeSettings(std::string runId, int minNodes, int maxNodes, const RdzvConf& conf) {
  Settings s;
  s.runId = std::move(runId);
  s.minNodes = minNodes;
  s.maxNodes = maxNodes;
  if (conf.joinTimeout) s.joinTimeout = *conf.joinTimeout;
  if (conf.lastCallTimeout) s.lastCallTimeout = *conf.lastCallTimeout;
  if (conf.closeTimeout) s.closeTimeout = *conf.closeTimeout;
  if (conf.heartbeatTimeout) s.heartbeatTimeout = *conf.heartbeatTimeout;
  if (conf.readTimeout) s.readTimeout = *conf.readTimeout;
  if (conf.keepAliveInterval) s.keepAliveInterval = *conf.keepAliveInterval;
  if (conf.keepAliveMaxAttempt) s.keepAliveMaxAttempt = *conf.keepAliveMaxAttempt;
  s.validate();
  return s;
}

Settings ctorchrunSettings(std::string runId, int minNodes, int maxNodes, const RdzvConf& conf) {
  RdzvConf withDefaults = conf;
  if (!withDefaults.keepAliveInterval) withDefaults.keepAliveInterval = kCtorchrunKeepAliveInterval;
  if (!withDefaults.keepAliveMaxAttempt) withDefaults.keepAliveMaxAttempt = kCtorchrunKeepAliveMaxAttempt;
  return makeSettings(std::move(runId), minNodes, maxNodes, withDefaults);
}

} // namespace ctorch::rdzv::c10d
