// The worker contract: everything ctorchrun and a worker agree on, and nothing else.
// Environment variable names (exactly torchrun's), exit codes, the error-file schema and the agent
// store key prefix. Owned by the launcher, included by the LibTorch library; header-only, no deps.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ctorch::contract {

// ---- Environment variables a worker receives (torchrun's names) ---------------------------------
namespace env {
inline constexpr const char* kRank = "RANK";
inline constexpr const char* kLocalRank = "LOCAL_RANK";
inline constexpr const char* kGroupRank = "GROUP_RANK";
inline constexpr const char* kRoleRank = "ROLE_RANK";
inline constexpr const char* kRoleName = "ROLE_NAME";
inline constexpr const char* kLocalWorldSize = "LOCAL_WORLD_SIZE";
inline constexpr const char* kWorldSize = "WORLD_SIZE";
inline constexpr const char* kRoleWorldSize = "ROLE_WORLD_SIZE";
inline constexpr const char* kGroupWorldSize = "GROUP_WORLD_SIZE";
inline constexpr const char* kMasterAddr = "MASTER_ADDR";
inline constexpr const char* kMasterPort = "MASTER_PORT";
inline constexpr const char* kRestartCount = "TORCHELASTIC_RESTART_COUNT";
inline constexpr const char* kMaxRestarts = "TORCHELASTIC_MAX_RESTARTS";
inline constexpr const char* kRunId = "TORCHELASTIC_RUN_ID";
inline constexpr const char* kUseAgentStore = "TORCHELASTIC_USE_AGENT_STORE";
inline constexpr const char* kErrorFile = "TORCHELASTIC_ERROR_FILE";
inline constexpr const char* kNcclAsyncErrorHandling = "TORCH_NCCL_ASYNC_ERROR_HANDLING";
inline constexpr const char* kOmpNumThreads = "OMP_NUM_THREADS";
// ctorchrun --recovery in-place: "in-place" on every worker of such a job.
inline constexpr const char* kRecovery = "CTORCH_RECOVERY";
// On a worker started in place of a failed one (--recovery in-place): how many replacements its node
// has started so far (1, 2, ...). Such a worker joins the running group instead of starting one.
inline constexpr const char* kReplacement = "CTORCH_REPLACEMENT";
// On a spare worker (--spare-workers): its id. A spare starts like a worker of its node but without
// the rank variables (kSpareAssigned): it loads its program and waits in ctorch::initProcessGroup()
// until the agent hands it a failed worker's rank (inplace::spareKey), then sets them and joins.
inline constexpr const char* kSpare = "CTORCH_SPARE";
// On a spare: the attempt's log directory. Its error file becomes <dir>/<LOCAL_RANK>/error.json
// once it holds a rank (a path is never read from the store).
inline constexpr const char* kSpareLogDir = "CTORCH_SPARE_LOG_DIR";
// On a preloaded worker (--preloaded-workers): "1", with kSpare naming it. It waits for its
// assignment before its program's main() runs (LibTorch loaded, nothing of the program done), then
// runs the program from the start as the replacement it was given: what a new process would do,
// without loading LibTorch first. Only a program linked with ctorch's library waits.
inline constexpr const char* kPreloaded = "CTORCH_PRELOADED";
// The job's control key (hex), with which a worker proves itself on in-place recovery's control
// channel (control_protocol.hpp). Only in the workers' environment, never in a store or a log.
inline constexpr const char* kControlKey = "CTORCH_CONTROL_KEY";
// The process's incarnation (16 hex digits): a random id its agent gave this one process. The
// coordinator knows each rank by the process that holds it now; a kill names one incarnation, so
// nothing said about an earlier process (or launch, or a reused pid) can touch this one.
inline constexpr const char* kIncarnation = "CTORCH_INCARNATION";
// The rendezvous round the worker's group was formed in (0, 1, ...: every completed rendezvous of
// the run counts one; the nodes of a round agree on it). A fencing token: a worker of a later round
// of the same run outranks one of an earlier round, which the group has left behind (a node removed
// while it was frozen). ctorch's snapshot writer takes the slot's lock over from an earlier round's
// holder, and refuses to write once a later round holds it (docs/snapshot.md).
inline constexpr const char* kRendezvousRound = "CTORCH_RDZV_ROUND";

// Slurm variables read by the library when a worker is started by plain `srun` (no launcher).
inline constexpr const char* kSlurmProcId = "SLURM_PROCID";
inline constexpr const char* kSlurmNTasks = "SLURM_NTASKS";
inline constexpr const char* kSlurmLocalId = "SLURM_LOCALID";
inline constexpr const char* kSlurmNTasksPerNode = "SLURM_NTASKS_PER_NODE";
inline constexpr const char* kSlurmTasksPerNode = "SLURM_TASKS_PER_NODE";
inline constexpr const char* kSlurmStepNodeList = "SLURM_STEP_NODELIST";
inline constexpr const char* kSlurmJobNodeList = "SLURM_JOB_NODELIST";
inline constexpr const char* kSlurmJobId = "SLURM_JOB_ID";
inline constexpr const char* kSlurmStepId = "SLURM_STEP_ID";
inline constexpr const char* kSlurmNodeId = "SLURM_NODEID";
inline constexpr const char* kSlurmNNodes = "SLURM_NNODES";
} // namespace env

// One line of documentation per variable; `ctorchrun --help` prints this table.
struct VariableDoc {
  const char* name;
  const char* meaning;
};

inline constexpr VariableDoc kWorkerVariables[] = {
    {env::kRank, "global rank of the worker (0 .. WORLD_SIZE-1)"},
    {env::kLocalRank, "rank of the worker on its node (0 .. LOCAL_WORLD_SIZE-1)"},
    {env::kGroupRank, "rank of the worker's node (the agent) in the rendezvous"},
    {env::kRoleRank, "rank among workers of the same role (equals RANK: one role)"},
    {env::kRoleName, "the --role value (default: default)"},
    {env::kLocalWorldSize, "number of workers on this node (--nproc-per-node)"},
    {env::kWorldSize, "total number of workers in the job"},
    {env::kRoleWorldSize, "number of workers of this role (equals WORLD_SIZE)"},
    {env::kGroupWorldSize, "number of nodes (agents) in the rendezvous"},
    {env::kMasterAddr, "host of the c10d TCPStore the workers use"},
    {env::kMasterPort, "port of that TCPStore"},
    {env::kRestartCount, "how many times the worker group has been restarted"},
    {env::kMaxRestarts, "the --max-restarts value"},
    {env::kRunId, "the --rdzv-id value (the job id)"},
    {env::kUseAgentStore, "True: the store at MASTER_ADDR:MASTER_PORT is hosted by the agent"},
    {env::kErrorFile, "JSON file where the worker may record its fatal error (see below)"},
    {env::kNcclAsyncErrorHandling, "1 unless already set"},
    {env::kOmpNumThreads, "1 when unset and more than one worker runs on the node"},
};

// ctorchrun's own additions, on every worker.
inline constexpr VariableDoc kCtorchVariables[] = {
    {env::kRendezvousRound, "the rendezvous round this group formed in (0, 1, ...): a later round outranks an earlier one"},
};

// ctorchrun's own additions (only with --recovery in-place).
inline constexpr VariableDoc kInPlaceVariables[] = {
    {env::kRecovery, "in-place with --recovery in-place (else unset)"},
    {env::kReplacement, "on a worker started in place of a failed one: 1, 2, ..."},
    {env::kSpare, "on a spare worker (--spare-workers): its id; it gets the rank variables when it takes over"},
    {env::kSpareLogDir, "on a spare worker: the attempt's log directory (its error file, once it holds a rank)"},
    {env::kPreloaded, "1 on a preloaded worker (--preloaded-workers): a spare that waits before its program's main()"},
    {env::kControlKey, "the job's key for in-place recovery's control channel (secret: never logged or stored)"},
    {env::kIncarnation, "this process's random id on the control channel (a kill names one process, never a rank)"},
};

// The variables above are ctorchrun's to set: one inherited from the environment ctorchrun was
// started in (left in a shell or a batch script) would make workers wait as spares or act on a
// stale key, so ctorchrun removes them from what its workers inherit, and says so.
inline constexpr const char* kLauncherOwnedVariables[] = {env::kRecovery,   env::kReplacement, env::kSpare,
                                                          env::kSpareLogDir, env::kPreloaded,   env::kControlKey,
                                                          env::kIncarnation, env::kRendezvousRound};

// ---- The agent store ------------------------------------------------------------------------------
// With TORCHELASTIC_USE_AGENT_STORE=True a worker connects as a client to the TCPStore the agent
// hosts at MASTER_ADDR:MASTER_PORT and uses this key prefix, exactly as Python's
// torch.distributed.rendezvous does, so C++ and Python workers see the store the same way.
inline std::string agentStorePrefix(std::int64_t restartCount) {
  return "/worker/attempt_" + std::to_string(restartCount);
}

// ---- In-place recovery (ctorchrun --recovery in-place) ----------------------------------------------
// The launcher replaces only a failed worker; the survivors keep their processes and state, re-form
// the process group with the replacement over the same agent store, and one of them sends it the
// training state (docs/in-place-recovery.md). These are the variables and store keys both sides use.
inline constexpr const char* kRecoveryInPlace = "in-place";

// In-place recovery's commands travel on the control channel (control_protocol.hpp), none through
// the c10d store.
namespace inplace {
// The variables a spare does not have until it takes a rank over (the coordinator's kAssign sets
// them; the error file follows from kSpareLogDir and LOCAL_RANK, the world from its environment).
inline constexpr const char* kSpareAssigned[] = {env::kRank, env::kLocalRank, env::kRoleRank, env::kReplacement};
} // namespace inplace

// "True"/"true"/"1" mean yes, as Python's `os.environ.get(...) == str(True)` plus common spellings.
inline bool isTruthy(std::string_view v) {
  return v == "True" || v == "true" || v == "TRUE" || v == "1" || v == "yes";
}

// ---- Slurm port rule ------------------------------------------------------------------------------
// Under Slurm without an explicit MASTER_PORT (plain `srun` workers) or rendezvous port
// (`srun ctorchrun`), the port is derived from the job id so that every task of the job computes
// the same one and concurrent jobs on a node rarely collide: 20000 + (SLURM_JOB_ID mod 12000).
// The range 20000-31999 stays below Linux's default ephemeral range (32768-60999).
inline constexpr int kSlurmPortBase = 20000;
inline constexpr int kSlurmPortSpan = 12000;
inline constexpr int slurmDerivedPort(std::uint64_t jobId) {
  return kSlurmPortBase + static_cast<int>(jobId % kSlurmPortSpan);
}

// ---- Exit codes ------------------------------------------------------------------------------------
// ctorchrun exits with 0 when every worker succeeded; otherwise with the root-cause worker's own
// code (128+N when it died of signal N). Its own failures use the codes below.
inline constexpr int kExitSuccess = 0;
inline constexpr int kExitFailure = 1;          // generic failure inside the launcher
inline constexpr int kExitUsage = 2;            // bad command line or environment
inline constexpr int kExitRendezvousFailed = 3; // rendezvous timed out / store unreachable
inline constexpr int kExitCannotExecute = 126;  // program exists but cannot be executed
inline constexpr int kExitNotFound = 127;       // program not found
inline constexpr int kExitSignalBase = 128;     // 128 + signal number

// A worker that stopped on request (SIGTERM / SIGUSR1, e.g. Slurm preemption) after writing its
// snapshot exits with this code (EX_TEMPFAIL: "try again later"); the job can be requeued.
inline constexpr int kExitPreempted = 75;

// A worker that could not write a file the run depends on (a snapshot, a checkpoint copy, the
// final weights: ENOSPC, EDQUOT, EIO) exits with this code (EX_IOERR) after every rank agreed to
// stop at the same step; the files written before are intact. ctorchrun neither restarts the group
// nor replaces the worker for it (a restart would redo the steps since the last snapshot and meet
// the same disk) and exits with it: free space, run the same command again, it resumes.
inline constexpr int kExitWriteFailed = 74;

// Copies of one stop arrive together: `timeout` signals ctorchrun and then its process group,
// slurmstepd signals the whole step while ctorchrun forwards too, so a worker may see the same
// SIGTERM two or three times within milliseconds. A stop signal within this window of the first is
// the same request (ctorchrun and ctorch's stop handling both ignore it); only a later one, a
// deliberate second Ctrl-C, means "now".
inline constexpr std::int64_t kDuplicateStopWindowMs = 1000;

inline constexpr int exitCodeForSignal(int signo) { return kExitSignalBase + signo; }

// ---- The error file (torchrun's JSON schema) --------------------------------------------------------
// {"message": {"message": "<Type>: <what>", "extraInfo": {"py_callstack": "<text>",
//                                                          "timestamp": "<unix seconds>"}}}
// torchrun also accepts {"message": "<text>"}. The library writes the first form
// (ctorch::recordError); the launcher reads both and shows the message in its failure summary.
namespace error_file {
inline constexpr const char* kMessage = "message";
inline constexpr const char* kExtraInfo = "extraInfo";
inline constexpr const char* kCallstack = "py_callstack";
inline constexpr const char* kTimestamp = "timestamp";
// extraInfo.ctorch_retry = "never": the error is deterministic (a bad command line, a configuration
// or an incompatible snapshot); a restart would fail the same way, so ctorchrun does not restart
// the group for it and exits with the worker's code. Absent (torchrun's schema): retried as usual.
inline constexpr const char* kRetry = "ctorch_retry";
inline constexpr const char* kRetryNever = "never";
} // namespace error_file

} // namespace ctorch::contract
