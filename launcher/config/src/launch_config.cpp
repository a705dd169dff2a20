#include "ctorch/launcher/launch_config.hpp"

#include "launch_config_parts.hpp"

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
using namespace config_parts;
using text::split;
using text::trim;

namespace {

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
