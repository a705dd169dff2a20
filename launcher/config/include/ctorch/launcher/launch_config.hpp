// LaunchConfig: everything ctorchrun was asked to do, validated once. The command line (cli.hpp)
// produces RawOptions — the strings as typed or taken from PET_* variables — and
// makeLaunchConfig() turns them into this struct or throws UsageError/ProgramError naming the bad
// value. Everything downstream (rendezvous, agent, logs) trusts it.
#pragma once

#include "ctorch/rdzv/c10d/settings.hpp"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace ctorch::launcher {

// Which of a worker's streams a --redirects / --tee value selects (torchrun's Std flags).
enum class StdStreams : std::uint8_t { None = 0, Out = 1, Err = 2, All = 3 };

inline bool hasOut(StdStreams s) { return (static_cast<int>(s) & 1) != 0; }
inline bool hasErr(StdStreams s) { return (static_cast<int>(s) & 2) != 0; }

// A parsed --redirects / --tee value: "3" (every local rank) or "0:3,1:1" (per local rank).
struct StdSpec {
  StdStreams all = StdStreams::None;
  std::map<int, StdStreams> perRank;
  bool mapped = false;  // true for the per-rank form
  StdStreams forRank(int localRank) const;
  // Throws UsageError naming `flag` and the value.
  static StdSpec parse(const std::string& value, const std::string& flag);
};

struct LaunchConfig {
  // --- Nodes and workers
  int minNodes = 1;
  int maxNodes = 1;
  int nprocPerNode = 1;
  std::string nprocSource;        // "2", or how gpu/cpu/auto was resolved
  bool standalone = false;
  std::optional<int> nodeRank;    // --node-rank when given

  // --- Rendezvous
  std::string rdzvBackend = "static";  // "static", "standalone", or a registered backend
  std::string rdzvEndpointHost;        // static: the master address
  int rdzvEndpointPort = 29500;        // static: the master port
  std::string rdzvId = "none";
  // --rdzv-conf, parsed once: with --rdzv-backend c10d its keys are checked and typed here (the
  // c10d rendezvous reads them from this value); another backend's only for their syntax.
  rdzv::c10d::RdzvConf rdzvConf;
  std::string localAddr;

  // --- Restarts and signals
  int maxRestarts = 0;
  // --recovery: restart (torchrun's: any failure restarts every worker) or in-place (only a failed
  // worker is replaced; the others re-form the group with it, counted against --max-restarts).
  bool inPlaceRecovery = false;
  // --spare-workers: processes per node started ahead, loaded and waiting, that take a failed
  // worker's rank over at once (--recovery in-place).
  int spareWorkers = 0;
  // --preloaded-workers: processes per node started ahead with LibTorch loaded, waiting before their
  // program's main(); a failed worker's replacement starts from one (auto: 1 with --recovery
  // in-place and no spare workers, else 0).
  int preloadedWorkers = 0;
  // --store-failover (c10d): every agent keeps a standby rendezvous store; the survivors of the
  // store host's loss re-form on the next node's (docs/store-failover.md).
  bool storeFailover = false;
  // --store-failover with CTORCH_JOB_SECRET: the key that signs each node's loss mark (32 bytes,
  // rdzv::c10d::deriveFailoverKey; never logged). Empty without a secret: marks are unsigned.
  std::string failoverKey;
  // --recovery in-place: the key that signs the commands of in-place recovery in the workers' store
  // (ctorch/contract/control_auth.hpp; 32 bytes, given to the workers as CTORCH_CONTROL_KEY, never
  // logged), and where it came from. In-place recovery across nodes needs CTORCH_JOB_SECRET: without
  // it in-place recovery is turned off and `recoveryWarning` says why.
  std::string controlKey;
  std::string controlKeySource;
  std::string recoveryWarning;
  // ctorchrun's own worker variables (CTORCH_SPARE, ...) found in the environment it was started
  // in: removed from what the workers inherit, and named in a warning.
  std::vector<std::string> inheritedLauncherVariables;
  std::chrono::milliseconds monitorInterval{100};  // accepted for compatibility; unused
  std::chrono::milliseconds shutdownTimeout{std::chrono::seconds(30)};
  std::vector<int> signalsToHandle;

  // --- Workers
  std::string role = "default";
  std::string program;                  // as given
  std::vector<std::string> programArgs; // untouched
  std::string executable;               // resolved path that is executed
  std::vector<std::string> workerArgv;  // argv of every worker (interpreter + program + args)
  bool usesPython = false;
  std::string pythonChoice;   // how the interpreter was chosen, for the log
  std::string pythonWarning;  // e.g. no interpreter here can import torch

  // --- Logs
  std::optional<std::filesystem::path> logDir;
  StdSpec redirects;
  StdSpec tee;
  std::optional<std::set<int>> localRanksFilter;
  std::string logLevel;  // empty: SPDLOG_LEVEL, else info

  // --- This machine
  std::string hostname;

  // --- Slurm (`srun ctorchrun ...`): what was derived from the step, for the log
  std::vector<std::string> slurmLines;     // "derived --nnodes=2 from SLURM_NNODES=2 ..."
  std::vector<std::string> slurmWarnings;  // e.g. more than one ctorchrun per node

  bool elastic() const { return minNodes != maxNodes; }
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup processEnvironment();

// The strings the user gave (command line over PET_* over defaults).
struct RawOptions {
  std::string nnodes = "1";
  std::string nprocPerNode = "1";
  bool standalone = false;
  std::optional<std::string> nodeRank;
  std::string masterAddr = "127.0.0.1";
  std::string masterPort = "29500";
  std::string rdzvBackend = "static";
  std::string rdzvEndpoint;
  std::string rdzvId = "none";
  std::string rdzvConf;
  std::string maxRestarts = "0";
  std::string recovery = "restart";
  std::string spareWorkers = "0";
  std::string preloadedWorkers = "auto";
  bool storeFailover = false;
  std::string monitorInterval = "0.1";
  std::string role = "default";
  std::string logDir;
  std::string redirects = "0";
  std::string tee = "0";
  std::string localRanksFilter;
  std::string localAddr;
  std::string shutdownTimeout = "30";
  std::string signalsToHandle = "SIGINT,SIGTERM,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2";
  bool module = false;
  bool noPython = false;
  bool runPath = false;
  std::string logLevel;
  std::string slurm = "auto";  // auto | on | off
  std::vector<std::string> command;  // training_program [args...]
  // Long names (kebab-case, "nnodes", "rdzv-endpoint") given on the command line or through
  // PET_*: what Slurm must not override.
  std::vector<std::string> givenFlags;
  bool given(const std::string& name) const;
};

// Things the machine answers (for --nproc-per-node gpu/cpu/auto); injectable for tests.
struct MachineProbe {
  std::function<int()> visibleGpus;
  std::function<int()> cpuCount;
  std::function<std::string()> hostname;
  // Whether a Python interpreter (a path) can import torch; unset: assume it can.
  std::function<bool(const std::string&)> pythonHasTorch;
  static MachineProbe real(const EnvLookup& env);
};

// Validates everything; throws UsageError / ProgramError with one line naming the bad value.
LaunchConfig makeLaunchConfig(const RawOptions& raw, const EnvLookup& env, const MachineProbe& probe);

// ---- The pieces, exposed for unit tests ------------------------------------------------------------
std::pair<int, int> parseNnodes(const std::string& value);
int parseNproc(const std::string& value, const MachineProbe& probe, std::string* source = nullptr);
int parsePort(const std::string& value, const std::string& flag);
std::pair<std::string, std::optional<int>> parseEndpoint(const std::string& value);
std::set<int> parseRanksFilter(const std::string& value);
std::vector<int> parseSignals(const std::string& value);
std::chrono::milliseconds parseSeconds(const std::string& value, const std::string& flag);
int parseNonNegative(const std::string& value, const std::string& flag);

// Resolves `name` like execvp would (PATH search when it has no '/'); nullopt when not found.
std::optional<std::filesystem::path> findExecutable(const std::string& name, const EnvLookup& env);

} // namespace ctorch::launcher
