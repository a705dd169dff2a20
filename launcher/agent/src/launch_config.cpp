#include "ctorch/launcher/launch_config.hpp"

#include <arpa/inet.h>

#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/exit_status.hpp"
#include "ctorch/launcher/machine.hpp"
#include "ctorch/launcher/c10d_rendezvous.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/failover.hpp"
#include "ctorch/slurm/derive.hpp"
#include "ctorch/contract/control_auth.hpp"
#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/text/text.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>

namespace ctorch::launcher {

namespace fs = std::filesystem;
using text::split;
using text::trim;

namespace {

std::string quote(const std::string& s) { return "'" + s + "'"; }

// Strict decimal integer in [lo, hi], nothing around it (" 2" is not one); nullopt otherwise.
std::optional<long long> toInt(const std::string& s, long long lo, long long hi) {
  if (s.size() > 18 || !text::isDecimalInteger(s)) return std::nullopt;
  long long v = std::stoll(s);
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

bool isExecutableFile(const fs::path& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
}

// `n` bytes from the kernel's random source.
std::string randomBytes(std::size_t n) {
  std::string out(n, '\0');
  std::size_t have = 0;
  while (have < n) {
    const ssize_t got = ::getrandom(out.data() + have, n - have, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw LauncherError(std::string("cannot read random bytes for the job's control key: ") + std::strerror(errno));
    }
    have += static_cast<std::size_t>(got);
  }
  return out;
}

// A value the user gave, quoted, shortened to its first 40 characters when long (a 100,000-character
// --rdzv-id must not become a 100,000-character error line).
std::string quoteShort(const std::string& v) {
  if (v.size() <= 60) return "'" + v + "'";
  return "'" + v.substr(0, 40) + "...' (" + std::to_string(v.size()) + " characters)";
}

std::string randomRunId() {
  // A UUID4-shaped id, as torchrun's --standalone uses.
  std::random_device rd;
  std::mt19937_64 gen((static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
                      static_cast<std::uint64_t>(::getpid()));
  const char* hex = "0123456789abcdef";
  std::string id;
  for (int i = 0; i < 32; ++i) {
    if (i == 8 || i == 12 || i == 16 || i == 20) id += '-';
    int v = static_cast<int>(gen() & 15);
    if (i == 12) v = 4;
    if (i == 16) v = 8 + (v & 3);
    id += hex[v];
  }
  return id;
}

bool endsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const char* kLogLevels[] = {"trace", "debug", "info", "warn", "warning", "error", "critical", "off"};

} // namespace

bool RawOptions::given(const std::string& name) const {
  return std::find(givenFlags.begin(), givenFlags.end(), name) != givenFlags.end();
}

namespace {

// `srun ctorchrun ...`: fills what the user left out from the Slurm step (docs/rendezvous.md).
RawOptions applySlurm(const RawOptions& raw, const EnvLookup& env, LaunchConfig& c) {
  slurm::UserChoices u;
  try {
    u.mode = slurm::parseSlurmMode(std::string(trim(raw.slurm)));
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(e.what()) + " (--slurm auto derives the settings under srun)");
  }
  u.standalone = raw.standalone;
  if (raw.given("nnodes")) u.nnodes = raw.nnodes;
  if (raw.nodeRank) u.nodeRank = parseNonNegative(*raw.nodeRank, "--node-rank");
  if (raw.given("rdzv-backend")) u.rdzvBackend = trim(raw.rdzvBackend);
  if (raw.given("rdzv-endpoint")) u.rdzvEndpoint = trim(raw.rdzvEndpoint);
  if (raw.given("rdzv-id")) u.rdzvId = trim(raw.rdzvId);
  if (raw.given("master-addr")) u.masterAddr = trim(raw.masterAddr);
  if (raw.given("master-port")) u.masterPort = parsePort(raw.masterPort, "--master-port");
  if (raw.given("nproc-per-node")) u.nprocPerNode = trim(raw.nprocPerNode);
  slurm::Derivation d;
  try {
    d = slurm::deriveFromSlurm(u, [&env](const std::string& name) { return env(name); });
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--slurm: ") + e.what());
  }
  RawOptions r = raw;
  if (!d.active) return r;
  if (d.nnodes) r.nnodes = std::to_string(*d.nnodes);
  if (d.nodeRank) r.nodeRank = std::to_string(*d.nodeRank);
  if (d.rdzvBackend) r.rdzvBackend = *d.rdzvBackend;
  if (d.rdzvEndpoint) r.rdzvEndpoint = *d.rdzvEndpoint;
  if (d.masterAddr) r.masterAddr = *d.masterAddr;
  if (d.masterPort) r.masterPort = std::to_string(*d.masterPort);
  if (d.rdzvId) r.rdzvId = *d.rdzvId;
  if (d.nprocPerNode) r.nprocPerNode = std::to_string(*d.nprocPerNode);
  c.slurmLines = d.lines;
  c.slurmWarnings = d.warnings;
  return r;
}

// The interpreter of a Python program: PYTHON_EXEC when set (as torchrun), else the first of
// python3 on PATH and /usr/bin/python3 that can import torch (a venv's python3 without torch
// must not shadow the system one that has it). Logged, and when none has torch, a warning that
// says what was tried and how to choose.
void choosePython(LaunchConfig& c, const EnvLookup& env, const MachineProbe& probe) {
  auto hasTorch = [&](const std::string& path) { return !probe.pythonHasTorch || probe.pythonHasTorch(path); };
  const std::string exec(trim(env("PYTHON_EXEC").value_or("")));
  if (!exec.empty()) {
    auto interp = findExecutable(exec, env);
    if (!interp)
      throw ProgramError("PYTHON_EXEC " + quote(exec) + " not found (the Python interpreter for " +
                             quote(c.program) + "; or use --no-python)",
                         contract::kExitNotFound);
    if (!isExecutableFile(*interp))
      throw ProgramError("PYTHON_EXEC " + quote(interp->string()) + " is not executable",
                         contract::kExitCannotExecute);
    c.executable = interp->string();
    c.pythonChoice = c.executable + " (PYTHON_EXEC)";
    if (!hasTorch(c.executable))
      c.pythonWarning = "PYTHON_EXEC " + c.executable +
                        " cannot import torch: a torch program will fail with \"No module named 'torch'\"";
    return;
  }
  std::vector<std::string> tried;
  std::optional<std::string> first;
  for (const std::string candidate : {"python3", "/usr/bin/python3"}) {
    auto interp = findExecutable(candidate, env);
    const std::string what = candidate == "python3" ? "python3 on PATH" : candidate;
    if (!interp || !isExecutableFile(*interp)) {
      tried.push_back(what + ": not found");
      continue;
    }
    std::error_code ec;
    std::string path = interp->string();
    if (first && fs::equivalent(*first, path, ec)) continue;  // PATH's python3 is /usr/bin/python3
    if (!first) first = path;
    if (hasTorch(path)) {
      c.executable = path;
      c.pythonChoice = path + " (" + what + ", can import torch)";
      return;
    }
    tried.push_back(what + " = " + path + ": no torch");
  }
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : "; ") + t;
  if (!first)
    throw ProgramError("no Python interpreter for " + quote(c.program) + " (" + list +
                           "): set PYTHON_EXEC=/path/to/python, or use --no-python",
                       contract::kExitNotFound);
  c.executable = *first;
  c.pythonChoice = *first + " (python3 on PATH)";
  c.pythonWarning = "no Python interpreter found here can import torch (" + list + "); running " + *first +
                    " anyway: a torch program will fail with \"No module named 'torch'\". Set "
                    "PYTHON_EXEC=/path/to/python of the environment that has torch";
}

} // namespace

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

namespace {

// The program and the argv of every worker (checked first: without it nothing else matters).
void resolveProgram(LaunchConfig& c, const RawOptions& raw, const EnvLookup& env, const MachineProbe& probe) {
  std::vector<std::string> command = raw.command;
  if (!command.empty() && command.front() == "--") command.erase(command.begin());
  if (command.empty())
    throw UsageError("missing the training program (usage: ctorchrun [options] training_program "
                     "[program args...]; see --help)");
  if (command.front().size() > 1 && command.front()[0] == '-' && !raw.module)
    throw UsageError("unknown option " + quote(command.front()) + " (see --help)");
  c.program = command.front();
  c.programArgs.assign(command.begin() + 1, command.end());
  if (raw.module && raw.noPython)
    throw UsageError("--module and --no-python cannot be used together: a module needs the "
                     "Python interpreter");

  c.usesPython = !raw.noPython && (raw.module || raw.runPath || endsWith(c.program, ".py"));
  if (c.usesPython) {
    choosePython(c, env, probe);
    c.workerArgv = {c.executable, "-u"};
    if (raw.module) {
      c.workerArgv.push_back("-m");
    } else {
      std::error_code ec;
      if (!fs::exists(c.program, ec))
        throw ProgramError("training script " + quote(c.program) + " not found",
                           contract::kExitNotFound);
    }
    c.workerArgv.push_back(c.program);
  } else {
    auto exe = findExecutable(c.program, env);
    if (!exe) {
      // As a shell: a bare name is looked up on PATH only, never in the current directory.
      std::error_code ec;
      const bool here = c.program.find('/') == std::string::npos && fs::is_regular_file(c.program, ec);
      throw ProgramError("training program " + quote(c.program) + " not found" +
                             (c.program.find('/') == std::string::npos ? " on PATH" : "") +
                             (here ? "; did you mean ./" + c.program + "?" : ""),
                         contract::kExitNotFound);
    }
    std::error_code ec;
    if (fs::is_directory(*exe, ec))
      throw ProgramError("training program " + quote(c.program) + " is a directory",
                         contract::kExitCannotExecute);
    if (!isExecutableFile(*exe))
      throw ProgramError("training program " + quote(c.program) +
                             " is not executable (permission denied; chmod +x it, or run a "
                             "script through its interpreter)",
                         contract::kExitCannotExecute);
    c.executable = exe->string();
    c.workerArgv = {c.program};
  }
  c.workerArgv.insert(c.workerArgv.end(), c.programArgs.begin(), c.programArgs.end());
}

// --rdzv-conf, parsed once: the c10d rendezvous' keys typed and checked; another backend's
// (which reads none, as torchrun's static one) only for their key=value syntax.
rdzv::c10d::RdzvConf parseRdzvConf(const std::string& text, const std::string& backend) {
  try {
    return rdzv::c10d::parseRdzvConf(text, backend == "c10d" ? rdzv::c10d::RdzvConfKeys::kC10d
                                                             : rdzv::c10d::RdzvConfKeys::kAny);
  } catch (const rdzv::c10d::RendezvousConfigError& e) {
    throw UsageError(e.what());
  }
}

// The backend, its endpoint, the run id and --rdzv-conf.
void resolveRendezvous(LaunchConfig& c, const RawOptions& raw) {
  c.localAddr = trim(raw.localAddr);
  if (c.standalone) {
    if (c.maxNodes != 1)
      throw UsageError("--standalone runs a single node, but --nnodes " + quote(raw.nnodes) +
                       " asks for more");
    if (c.nodeRank && *c.nodeRank != 0)
      throw UsageError("--standalone runs a single node, but --node-rank is " +
                       std::to_string(*c.nodeRank));
    c.rdzvBackend = "standalone";
    c.rdzvEndpointHost = "127.0.0.1";
    c.rdzvEndpointPort = 0;
    c.rdzvId = randomRunId();
  } else {
    c.rdzvBackend = trim(raw.rdzvBackend);
    c.rdzvId = trim(raw.rdzvId).empty() ? "none" : trim(raw.rdzvId);
    // It names the log directory (<run id>_<random>) and every store key prefix: checked before the
    // rendezvous, not at the first file it names.
    if (c.rdzvId.size() > 128)
      throw UsageError("--rdzv-id " + quoteShort(c.rdzvId) + ": at most 128 characters (it names the log directory)");
    if (c.rdzvId.find_first_of(std::string("/\0", 2)) != std::string::npos ||
        std::any_of(c.rdzvId.begin(), c.rdzvId.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }))
      throw UsageError("--rdzv-id " + quoteShort(c.rdzvId) +
                       ": must not contain '/' or control characters (it names the log directory)");
    const auto& torchrunBackends = torchrunRendezvousBackends();
    bool known = std::find(torchrunBackends.begin(), torchrunBackends.end(), c.rdzvBackend) !=
                 torchrunBackends.end();
    if (!rendezvousBackendAvailable(c.rdzvBackend)) {
      const std::string available = text::join(availableRendezvousBackends(), ", ");
      if (known)
        throw UsageError("--rdzv-backend " + quote(c.rdzvBackend) +
                         " is not available in this ctorchrun (available: " + available +
                         "; for one node use --standalone)");
      throw UsageError("unknown --rdzv-backend " + quote(c.rdzvBackend) + " (available: " +
                       available + ")");
    }
    auto [host, port] = parseEndpoint(raw.rdzvEndpoint);
    if (c.rdzvBackend == "static") {
      c.rdzvEndpointHost = host.empty() ? trim(raw.masterAddr) : host;
      c.rdzvEndpointPort = port ? *port : parsePort(raw.masterPort, "--master-port");
      if (c.rdzvEndpointHost.empty()) throw UsageError("--master-addr '': empty address");
      if (c.elastic())
        throw UsageError("--nnodes " + quote(raw.nnodes) +
                         ": the static rendezvous needs a fixed number of nodes (elastic MIN:MAX "
                         "needs --rdzv-backend c10d)");
      int rank = c.nodeRank.value_or(0);
      if (rank >= c.maxNodes)
        throw UsageError("--node-rank " + std::to_string(rank) + " is out of range for --nnodes " +
                         std::to_string(c.maxNodes) + " (node ranks are 0.." +
                         std::to_string(c.maxNodes - 1) + ")");
      if (c.maxNodes > 1 && c.rdzvEndpointPort == 0)
        throw UsageError("--master-port 0: several nodes must agree on a fixed port");
    } else {
      c.rdzvEndpointHost = host.empty() ? "localhost" : host;
      c.rdzvEndpointPort = port.value_or(29400);
      if (c.rdzvEndpointPort == 0)
        throw UsageError("--rdzv-endpoint port 0: the nodes must agree on a fixed port");
    }
  }
  c.rdzvConf = parseRdzvConf(raw.rdzvConf, c.rdzvBackend);
}

// Restarts, recovery, store failover, the monitor interval, the shutdown grace and the signals.
void resolveRestarts(LaunchConfig& c, const RawOptions& raw) {
  c.maxRestarts = parseNonNegative(raw.maxRestarts, "--max-restarts");
  {
    std::string r(trim(raw.recovery));
    std::replace(r.begin(), r.end(), '_', '-');
    if (r == "in-place" || r == "inplace") c.inPlaceRecovery = true;
    else if (r != "restart")
      throw UsageError("--recovery '" + raw.recovery + "': expected restart (every worker restarts after a "
                       "failure) or in-place (only the failed worker is replaced)");
  }
  c.spareWorkers = parseNonNegative(raw.spareWorkers, "--spare-workers");
  if (c.spareWorkers > 0 && !c.inPlaceRecovery)
    throw UsageError("--spare-workers " + std::to_string(c.spareWorkers) +
                     ": spares take over a failed worker's rank, which needs --recovery in-place");
  if (c.spareWorkers > 64) throw UsageError("--spare-workers " + std::to_string(c.spareWorkers) + ": at most 64 per node");
  if (trim(raw.preloadedWorkers) == "auto") {
    c.preloadedWorkers = c.inPlaceRecovery && c.spareWorkers == 0 ? 1 : 0;
  } else {
    c.preloadedWorkers = parseNonNegative(raw.preloadedWorkers, "--preloaded-workers");
    if (c.preloadedWorkers > 0 && !c.inPlaceRecovery)
      throw UsageError("--preloaded-workers " + std::to_string(c.preloadedWorkers) +
                       ": a preloaded worker becomes a failed worker's replacement, which needs --recovery in-place");
    if (c.preloadedWorkers > 64)
      throw UsageError("--preloaded-workers " + std::to_string(c.preloadedWorkers) + ": at most 64 per node");
  }
  c.storeFailover = raw.storeFailover;
  c.monitorInterval = parseSeconds(raw.monitorInterval, "--monitor-interval");
  c.shutdownTimeout = parseSeconds(raw.shutdownTimeout, "--shutdown-timeout");
  c.signalsToHandle = parseSignals(raw.signalsToHandle);
}

// The role, where the logs go and what is shown, and the log level.
void resolveLogs(LaunchConfig& c, const RawOptions& raw) {
  c.role = trim(raw.role);
  if (c.role.empty()) throw UsageError("--role '': the role name must not be empty");
  if (!trim(raw.logDir).empty()) c.logDir = fs::path(trim(raw.logDir));
  c.redirects = StdSpec::parse(raw.redirects, "--redirects");
  c.tee = StdSpec::parse(raw.tee, "--tee");
  if (!trim(raw.localRanksFilter).empty()) {
    c.localRanksFilter = parseRanksFilter(raw.localRanksFilter);
    // A rank that does not exist would silently hide everything (a typo, or 5 with 2 workers).
    for (int r : *c.localRanksFilter)
      if (r >= c.nprocPerNode)
        throw UsageError("--local-ranks-filter " + quote(raw.localRanksFilter) + ": local rank " +
                         std::to_string(r) + " does not exist with --nproc-per-node " +
                         std::to_string(c.nprocPerNode) + " (local ranks are 0.." +
                         std::to_string(c.nprocPerNode - 1) + ")");
  }

  // Empty: SPDLOG_LEVEL (spdlog's own syntax, applied by main) or info.
  std::string level = text::toLower(trim(raw.logLevel));
  if (!level.empty() &&
      std::find(std::begin(kLogLevels), std::end(kLogLevels), level) == std::end(kLogLevels))
    throw UsageError("--log-level " + quote(raw.logLevel) +
                     ": expected trace, debug, info, warn, error, critical or off");
  if (level == "warning") level = "warn";
  c.logLevel = level;
}

// CTORCH_JOB_SECRET, checked once for every key derived from it; nullopt when none is given.
std::optional<std::string> jobSecret(const EnvLookup& env) {
  namespace auth = contract::auth;
  const auto secret = env(auth::kJobSecretEnv);
  if (!secret || secret->empty()) return std::nullopt;
  if (secret->size() < auth::kMinSecretLength)
    throw UsageError(std::string(auth::kJobSecretEnv) + " is " + std::to_string(secret->size()) +
                     " characters long: at least " + std::to_string(auth::kMinSecretLength) +
                     " (e.g. head -c 32 /dev/urandom | base64), the same on every node");
  return secret;
}

// --store-failover: the key that signs the loss marks the successor counts (failover.hpp), from
// CTORCH_JOB_SECRET where one is given; without, marks are unsigned (docs/store-failover.md says what
// an outsider can then do).
void resolveFailoverKey(LaunchConfig& c, const EnvLookup& env) {
  if (!c.storeFailover) return;
  if (const auto secret = jobSecret(env)) c.failoverKey = rdzv::c10d::deriveFailoverKey(*secret, c.rdzvId);
}

// --recovery in-place: the key that signs its commands (ctorch/contract/control_auth.hpp); across
// nodes without CTORCH_JOB_SECRET, in-place recovery is turned off with a warning.
void resolveControlKey(LaunchConfig& c, const EnvLookup& env) {
  if (c.inPlaceRecovery) {
    namespace auth = contract::auth;
    if (const auto secret = jobSecret(env)) {
      c.controlKey = auth::deriveControlKey(*secret, c.rdzvId);
      c.controlKeySource = auth::kJobSecretEnv;
    } else if (c.maxNodes == 1) {
      c.controlKey = randomBytes(32);
      c.controlKeySource = "random (one node)";
    } else {
      c.recoveryWarning = std::string("--recovery in-place across nodes needs ") + auth::kJobSecretEnv +
                          " (the same secret of 16+ characters on every node; scripts/slurm/*.sbatch set one) to "
                          "sign its commands in the workers' store, which anyone who reaches that port could "
                          "otherwise forge: a failed worker restarts the group instead";
      c.inPlaceRecovery = false;
      c.spareWorkers = 0;
      c.preloadedWorkers = 0;
    }
  }
}

} // namespace

LaunchConfig makeLaunchConfig(const RawOptions& given, const EnvLookup& env, const MachineProbe& probe) {
  LaunchConfig c;
  c.hostname = probe.hostname ? probe.hostname() : hostName();
  const RawOptions raw = applySlurm(given, env, c);
  resolveProgram(c, raw, env, probe);

  // --- nodes and workers
  std::tie(c.minNodes, c.maxNodes) = parseNnodes(raw.nnodes);
  c.nprocPerNode = parseNproc(raw.nprocPerNode, probe, &c.nprocSource);
  c.standalone = raw.standalone;
  if (raw.nodeRank) c.nodeRank = parseNonNegative(*raw.nodeRank, "--node-rank");
  resolveRendezvous(c, raw);
  resolveRestarts(c, raw);
  resolveLogs(c, raw);

  // The c10d rendezvous' settings (run id, node counts, --rdzv-conf times): checked now, not at
  // the first rendezvous.
  if (c.rdzvBackend == "c10d") (void)c10dOptionsFrom(c);
  if (c.storeFailover && c.rdzvBackend != "c10d")
    throw UsageError("--store-failover needs --rdzv-backend c10d (the " + c.rdzvBackend +
                     " rendezvous has no store to fail over: node rank 0 serves the workers' store)");
  for (const char* name : contract::kLauncherOwnedVariables)
    if (env(name)) c.inheritedLauncherVariables.push_back(name);
  resolveControlKey(c, env);
  resolveFailoverKey(c, env);
  // A Python program's survivors cannot re-form in place (torch.distributed has no such protocol):
  // each would fail and be replaced in turn, meeting the dead group's keys in the same store.
  if (c.inPlaceRecovery && c.usesPython)
    throw UsageError("--recovery in-place needs a program built on ctorch's library (its survivors re-form the "
                     "group); '" + c.program + "' runs under Python: use --recovery restart");
  return c;
}

} // namespace ctorch::launcher
