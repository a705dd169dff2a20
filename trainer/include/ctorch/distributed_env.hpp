// Where a worker stands in a distributed job, read from its environment: torchrun / ctorchrun
// variables, a plain `srun` step, or nothing (a world of 1). A pure function of an environment
// lookup, so every rule is unit-testable without processes. No LibTorch here.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace ctorch {

// Returns the value of an environment variable, or nullopt when it is unset. An empty value counts
// as unset (as Python's env:// rendezvous does).
using EnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The real process environment.
EnvLookup processEnvironment();

// Who started this process, as far as the environment tells.
enum class Launcher {
  kNone,      // no distributed variables: a world of 1
  kTorchrun,  // RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun, ctorchrun, or by hand)
  kSlurm,     // SLURM_PROCID / SLURM_NTASKS without RANK: a plain `srun` step
};

const char* toString(Launcher launcher);

struct DistributedEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  int localWorldSize = 1;
  std::string masterAddr;         // empty when there is no store to reach (a world of 1)
  int masterPort = 0;             // 0 when there is no store to reach
  bool useAgentStore = false;     // connect as a client to the launcher's store, under a key prefix
  std::int64_t restartCount = 0;  // TORCHELASTIC_RESTART_COUNT (0 when unset)
  // USE_LIBUV, as Python reads it: unset or "1" asks for LibTorch's libuv store backend (2.2+),
  // anything else for the classic one. Builds without libuv (Debian's) need USE_LIBUV=0.
  bool useLibUV = true;

  // Where each value came from, for messages and logs: "RANK", "SLURM_PROCID",
  // "first host of SLURM_STEP_NODELIST=node[01-04]", "derived from SLURM_JOB_ID=1234", "default".
  std::string rankFrom = "default";
  std::string worldSizeFrom = "default";
  std::string localRankFrom = "default";
  std::string localWorldSizeFrom = "default";
  std::string masterAddrFrom = "default";
  std::string masterPortFrom = "default";

  // True when the job needs a store (more than one rank, or a launcher's agent store).
  bool needsStore() const { return !masterAddr.empty(); }
  // One line for logs: "rank 1/4 (local 1/2) from torchrun, store 10.0.0.1:29500 hosted by rank 0".
  std::string describe() const;
};

// Detects the distributed environment. Precedence: RANK or WORLD_SIZE set -> torchrun rules;
// else SLURM_PROCID set -> srun rules; else a world of 1 with no store.
//
// torchrun rules: RANK and WORLD_SIZE are required together; MASTER_ADDR and MASTER_PORT are
// required unless WORLD_SIZE is 1; LOCAL_RANK / LOCAL_WORLD_SIZE default to RANK / WORLD_SIZE (one
// node); TORCHELASTIC_USE_AGENT_STORE=True needs TORCHELASTIC_RESTART_COUNT.
// srun rules: rank SLURM_PROCID, world SLURM_NTASKS, local rank SLURM_LOCALID, local world from
// SLURM_TASKS_PER_NODE at SLURM_NODEID; master MASTER_ADDR else the first host of
// SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST); port MASTER_PORT else
// contract::slurmDerivedPort(SLURM_JOB_ID).
//
// Throws ConfigError naming the variable and its value when one is malformed, out of range or
// missing.
DistributedEnv detectDistributedEnv(const EnvLookup& lookup);

} // namespace ctorch
