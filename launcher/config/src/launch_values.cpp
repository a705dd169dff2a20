// Each ctorchrun flag's value parsed and checked, one line naming the flag and the value when it is
// bad (the declarations are in ctorch/launcher/launch_config.hpp; launch_config.cpp makes the whole
// LaunchConfig of them), and the machine and environment they are read against.
#include "ctorch/launcher/launch_config.hpp"

#include "launch_config_parts.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/exit_status.hpp"
#include "ctorch/launcher/machine.hpp"
#include "ctorch/text/text.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace ctorch::launcher {

namespace fs = std::filesystem;
using namespace config_parts;
using text::split;
using text::trim;

EnvLookup processEnvironment() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

MachineProbe MachineProbe::real(const EnvLookup& env) {
  MachineProbe p;
  p.visibleGpus = [env] { return visibleGpuCount(countNvidiaDevices(), env("CUDA_VISIBLE_DEVICES")); };
  p.cpuCount = [] { return onlineCpuCount(); };
  p.hostname = [] { return hostName(); };
  p.pythonHasTorch = [](const std::string& python) { return pythonFindsTorch(python); };
  return p;
}

StdStreams StdSpec::forRank(int localRank) const {
  if (!mapped) return all;
  auto it = perRank.find(localRank);
  return it == perRank.end() ? StdStreams::None : it->second;
}

StdSpec StdSpec::parse(const std::string& value, const std::string& flag) {
  auto bad = [&](const std::string& why) {
    return UsageError(flag + " " + quote(value) + ": " + why +
                      " (expected 0-3, or local_rank:value pairs such as 0:3,1:1; "
                      "1 = stdout, 2 = stderr, 3 = both)");
  };
  StdSpec spec;
  std::string v(trim(value));
  if (v.find(':') == std::string::npos) {
    auto n = toInt(value, 0, 3);
    if (!n) throw bad("not a value between 0 and 3");
    spec.all = static_cast<StdStreams>(*n);
    return spec;
  }
  spec.mapped = true;
  for (const auto& item : split(v, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) throw bad(quote(item) + " is not local_rank:value");
    auto rank = toInt(std::string(trim(item.substr(0, colon))), 0, 1 << 20);  // "0:3, 1:1" as torchrun takes it
    auto val = toInt(std::string(trim(item.substr(colon + 1))), 0, 3);
    if (!rank || !val) throw bad(quote(item) + " is not local_rank:value");
    if (spec.perRank.count(static_cast<int>(*rank)))
      throw bad("local rank " + std::to_string(*rank) + " is given twice");
    spec.perRank[static_cast<int>(*rank)] = static_cast<StdStreams>(*val);
  }
  return spec;
}

std::pair<int, int> parseNnodes(const std::string& value) {
  auto bad = [&](const std::string& why) {
    return UsageError("--nnodes " + quote(value) + ": " + why + " (expected N or MIN:MAX)");
  };
  const std::string& v = value;
  auto colon = v.find(':');
  if (colon == std::string::npos) {
    auto n = toInt(v, 1, 1000000);
    if (!n) throw bad("not a positive number of nodes");
    return {static_cast<int>(*n), static_cast<int>(*n)};
  }
  auto lo = toInt(v.substr(0, colon), 1, 1000000);
  auto hi = toInt(v.substr(colon + 1), 1, 1000000);
  if (!lo || !hi) throw bad("MIN and MAX must be positive numbers");
  if (*lo > *hi) throw bad("MIN (" + std::to_string(*lo) + ") is larger than MAX (" +
                           std::to_string(*hi) + ")");
  return {static_cast<int>(*lo), static_cast<int>(*hi)};
}

int parseNproc(const std::string& value, const MachineProbe& probe, std::string* source) {
  const std::string& v = value;
  std::string lower = text::toLower(v);
  if (lower == "gpu" || lower == "auto") {
    int n = probe.visibleGpus ? probe.visibleGpus() : 0;
    if (n > 0) {
      if (source) *source = std::to_string(n) + " (" + lower + ": visible NVIDIA GPUs)";
      return n;
    }
    if (lower == "gpu")
      throw UsageError("--nproc-per-node 'gpu': no NVIDIA GPU is visible on this machine "
                       "(no /proc/driver/nvidia/gpus or /dev/nvidiaN, or CUDA_VISIBLE_DEVICES "
                       "hides them); give a number instead");
    int c = probe.cpuCount ? probe.cpuCount() : 1;
    if (source) *source = std::to_string(c) + " (auto: no GPU, CPU count)";
    return c;
  }
  if (lower == "cpu") {
    int c = probe.cpuCount ? probe.cpuCount() : 1;
    if (source) *source = std::to_string(c) + " (cpu: CPU count)";
    return c;
  }
  auto n = toInt(v, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  if (!n)
    throw UsageError("--nproc-per-node " + quote(value) +
                     ": not a number of workers, 'gpu', 'cpu' or 'auto'");
  if (*n < 1) throw UsageError("--nproc-per-node " + quote(value) + ": needs at least 1 worker");
  if (*n > 4096) throw UsageError("--nproc-per-node " + quote(value) + ": more than 4096 workers on one node");
  if (source) *source = std::to_string(*n);
  return static_cast<int>(*n);
}

int parsePort(const std::string& value, const std::string& flag) {
  auto n = toInt(value, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  if (!n) throw UsageError(flag + " " + quote(value) + ": not a port number");
  if (*n < 0 || *n > 65535)
    throw UsageError(flag + " " + quote(value) + ": port out of range (0-65535)");
  return static_cast<int>(*n);
}

std::pair<std::string, std::optional<int>> parseEndpoint(const std::string& value) {
  std::string v(trim(value));
  if (v.empty()) return {"", std::nullopt};
  std::string host;
  std::string rest;
  if (v[0] == '[') {  // [IPv6]:port
    auto close = v.find(']');
    if (close == std::string::npos)
      throw UsageError("--rdzv-endpoint " + quote(value) + ": unbalanced '[' in IPv6 address");
    host = v.substr(1, close - 1);
    rest = v.substr(close + 1);
    if (!rest.empty() && rest[0] != ':')
      throw UsageError("--rdzv-endpoint " + quote(value) + ": expected HOST[:PORT]");
  } else {
    auto colon = v.rfind(':');
    // Several colons: a bare IPv6 address (no port), or as torchrun reads it, HOST:PORT split at
    // the last one ("localhost:29400:x" has the port 'x', refused at once).
    in6_addr probe{};
    const std::string address = v.substr(0, v.find('%'));  // fe80::1%eth0: the zone is not the address's
    const bool bareIpv6 = colon != std::string::npos && v.find(':') != colon &&
                          ::inet_pton(AF_INET6, address.c_str(), &probe) == 1;
    if (colon != std::string::npos && !bareIpv6) {
      host = v.substr(0, colon);
      rest = v.substr(colon);
    } else {
      host = v;
    }
  }
  if (host.empty()) throw UsageError("--rdzv-endpoint " + quote(value) + ": missing host");
  // torchrun's rule (a name, an IPv4 or an IPv6 address), and an IPv6 zone ("%eth0").
  for (char c : host)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_' || c == ':' || c == '%'))
      throw UsageError("--rdzv-endpoint " + quote(value) + ": host " + quote(host) +
                       " is not a host name or an IP address");
  if (rest.empty()) return {host, std::nullopt};
  return {host, parsePort(rest.substr(1), "--rdzv-endpoint port")};
}

std::set<int> parseRanksFilter(const std::string& value) {
  std::set<int> ranks;
  for (const auto& item : split(value, ',')) {
    auto n = toInt(std::string(trim(item)), 0, 1 << 20);  // "0, 2" as torchrun takes it
    if (!n)
      throw UsageError("--local-ranks-filter " + quote(value) + ": " + quote(item) +
                       " is not a local rank (expected a comma-separated list such as 0,1,2)");
    ranks.insert(static_cast<int>(*n));
  }
  return ranks;
}

std::vector<int> parseSignals(const std::string& value) {
  std::vector<int> out;
  for (const auto& item : split(value, ',')) {
    if (trim(item).empty()) continue;
    int s = parseSignal(item);
    if (s < 0)
      throw UsageError("--signals-to-handle " + quote(value) + ": " + quote(std::string(trim(item))) +
                       " is not a signal name or number");
    if (s == SIGKILL || s == SIGSTOP || s == SIGCHLD)
      throw UsageError("--signals-to-handle " + quote(value) + ": " + signalName(s) +
                       " cannot be handled or forwarded");
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  return out;
}

std::chrono::milliseconds parseSeconds(const std::string& value, const std::string& flag) {
  const std::string& v = value;
  char* end = nullptr;
  errno = 0;
  double s = text::isDecimalNumber(v) ? std::strtod(v.c_str(), &end) : 0.0;
  if (!text::isDecimalNumber(v) || end != v.c_str() + v.size() || errno != 0 || !std::isfinite(s))
    throw UsageError(flag + " " + quote(value) + ": not a number of seconds");
  if (s < 0) throw UsageError(flag + " " + quote(value) + ": must not be negative");
  if (s > 1e7) throw UsageError(flag + " " + quote(value) + ": too large");
  return std::chrono::milliseconds(static_cast<long long>(std::llround(s * 1000.0)));
}

int parseNonNegative(const std::string& value, const std::string& flag) {
  auto n = toInt(value, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  if (!n) throw UsageError(flag + " " + quote(value) + ": not a whole number");
  if (*n < 0) throw UsageError(flag + " " + quote(value) + ": must not be negative");
  return static_cast<int>(*n);
}

std::optional<fs::path> findExecutable(const std::string& name, const EnvLookup& env) {
  if (name.empty()) return std::nullopt;
  if (name.find('/') != std::string::npos) {
    std::error_code ec;
    if (fs::exists(name, ec)) return fs::path(name);
    return std::nullopt;
  }
  std::string path = env("PATH").value_or("/usr/local/bin:/usr/bin:/bin");
  std::optional<fs::path> nonExecutable;
  for (const auto& dir : split(path, ':')) {
    fs::path candidate = fs::path(dir.empty() ? "." : dir) / name;
    std::error_code ec;
    if (!fs::exists(candidate, ec)) continue;
    if (isExecutableFile(candidate)) return candidate;
    if (!nonExecutable && fs::is_regular_file(candidate, ec)) nonExecutable = candidate;
  }
  return nonExecutable;  // execvp reports EACCES for these: so do we
}

} // namespace ctorch::launcher
