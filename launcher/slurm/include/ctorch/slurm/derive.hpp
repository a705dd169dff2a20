// `srun ctorchrun ...`: fill in what the user left out from the Slurm step's environment
// (--nnodes, node rank, rendezvous endpoint and id, --nproc-per-node), and say where each value
// came from. A pure function of the environment (given as a lookup) and the user's choices; the
// launcher logs `lines` and `warnings` and merges the values into its configuration.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch::slurm {

// A Slurm variable with a value that makes no sense (names it and quotes the value).
struct SlurmEnvError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
EnvLookup processEnv();                                          // getenv
EnvLookup mapEnv(std::map<std::string, std::string> vars);       // for tests

enum class SlurmMode {
  Auto,  // derive under srun (default)
  On,    // derive, and fail if not under srun
  Off,   // never look at Slurm variables (--slurm off)
};
// "auto" | "on" | "off" (also true/false/1/0). Throws std::invalid_argument quoting the value.
SlurmMode parseSlurmMode(const std::string& text);

// What the user gave on the command line (unset: not given).
struct UserChoices {
  SlurmMode mode = SlurmMode::Auto;
  bool standalone = false;                 // --standalone: single node, nothing to derive
  std::optional<std::string> nnodes;       // --nnodes as given ("2", "1:4")
  std::optional<int> nodeRank;             // --node-rank
  std::optional<std::string> rdzvBackend;  // --rdzv-backend
  std::optional<std::string> rdzvEndpoint; // --rdzv-endpoint
  std::optional<std::string> rdzvId;       // --rdzv-id
  std::optional<std::string> masterAddr;   // --master-addr (static rendezvous)
  std::optional<int> masterPort;           // --master-port
  std::optional<std::string> nprocPerNode; // --nproc-per-node as given ("4", "gpu", "auto")
};

// The values to use for what the user left out. Only the fields that were derived are set.
struct Derivation {
  bool active = false;         // under srun and not disabled
  std::string inactiveReason;  // why not, when !active (for the debug log)
  std::optional<int> nnodes;   // MIN = MAX = the step's number of ctorchrun tasks
  std::optional<int> nodeRank; // requested node rank (c10d) / node rank (static)
  std::optional<std::string> rdzvBackend;   // "c10d" when the user chose none
  std::optional<std::string> rdzvEndpoint;  // "host:port" for c10d
  std::optional<std::string> masterAddr;    // for --rdzv-backend static
  std::optional<int> masterPort;
  std::optional<std::string> rdzvId;
  std::optional<int> nprocPerNode;
  int tasksOnThisNode = 1;     // ctorchrun tasks srun started on this node
  std::vector<std::string> lines;     // "derived --nnodes=2 from SLURM_NNODES=2", in order
  std::vector<std::string> warnings;  // e.g. more than one ctorchrun per node
};

// The rules (docs/rendezvous.md, "Slurm"):
//  - active when mode != Off, not --standalone, and SLURM_JOB_ID, SLURM_NODEID, SLURM_NNODES and
//    SLURM_STEP_NODELIST are all set (a batch script outside srun has no SLURM_STEP_NODELIST);
//  - --nnodes from SLURM_NNODES (the step's node count; SLURM_JOB_NUM_NODES is the allocation's);
//  - node rank from SLURM_NODEID;
//  - one ctorchrun per node is expected: if srun started more (SLURM_NTASKS > SLURM_NNODES, or
//    SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE like "2(x2)"), warn, and count every task
//    as a node (--nnodes from SLURM_NTASKS, node rank from SLURM_PROCID) so that ranks stay unique;
//  - backend c10d unless the user chose one; endpoint host = first host of SLURM_STEP_NODELIST
//    (never SLURM_JOB_NODELIST: a step may run on a subset), port = MASTER_PORT if set, else
//    contract::slurmDerivedPort(SLURM_JOB_ID); with --rdzv-backend static the same host and
//    port become --master-addr / --master-port;
//  - --rdzv-id = "slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>";
//  - --nproc-per-node from SLURM_GPUS_ON_NODE, else the number of CUDA_VISIBLE_DEVICES (not when
//    several ctorchrun share the node).
// Throws SlurmEnvError for malformed values, std::invalid_argument for mode On outside srun.
Derivation deriveFromSlurm(const UserChoices& user, const EnvLookup& env);

// "2(x3),1" → {2, 2, 2, 1} (SLURM_TASKS_PER_NODE syntax). Throws SlurmEnvError.
std::vector<int> expandTasksPerNode(const std::string& text);

} // namespace ctorch::slurm
