// The default process group, created from the environment a worker gets from torchrun, ctorchrun or
// plain srun (or a world of 1 with none), with the vocabulary of torch.distributed:
//   ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::minutes(5)));  ...  ctorch::getRank(), ctorch::barrier(), ctorch::destroyProcessGroup()
#pragma once

#include "ctorch/distributed_env.hpp"
#include "ctorch/errors.hpp"

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace ctorch {

enum class Backend {
  kAuto,  // Gloo for CPU tensors; plus NCCL for CUDA tensors when LibTorch has NCCL and a GPU is there
  kGloo,
  kNccl,  // CUDA tensors only
};

const char* toString(Backend backend);

struct ProcessGroupOptions {
  TORCH_ARG(Backend, backend) = Backend::kAuto;
  // Every collective and store operation, and Gloo's connection to its peers (Python's
  // init_process_group timeout, default 30 minutes).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  // Connecting to the TCPStore and, on the rank hosting it, waiting for every rank to connect.
  // Unset: the same as `timeout` (as in Python).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, storeTimeout);
  // Network interface(s) for Gloo, comma-separated ("eth0,eth1"). Empty: GLOO_SOCKET_IFNAME, else the
  // address this host's name resolves to (Python's rule).
  TORCH_ARG(std::string, glooInterface);
  // With NCCL: make cuda:LOCAL_RANK this process's current device (cuda:0 when each process sees a
  // single GPU), so that ranks sharing a node do not all land on GPU 0.
  TORCH_ARG(bool, bindCudaDevice) = true;
  // Environment to read instead of the process's (tests, embedding). Unset: the process environment.
  TORCH_ARG(EnvLookup, environment);

 public:
  // Throws ConfigError for a value that cannot work (non-positive timeouts, NCCL without NCCL).
  void validate() const;
  std::chrono::milliseconds effectiveStoreTimeout() const { return storeTimeout_.value_or(timeout_); }
};

// Creates the default process group from the environment (see detectDistributedEnv for the rules)
// and returns it. With TORCHELASTIC_USE_AGENT_STORE=True every rank connects as a client to the
// launcher's TCPStore under the prefix /worker/attempt_<TORCHELASTIC_RESTART_COUNT>; otherwise rank 0
// hosts the TCPStore; a world of 1 without any variables uses an in-memory store and no network.
// Keys are laid out exactly as Python's init_process_group lays them out, so C++ and Python workers
// can share one job. Reads TORCH_DISTRIBUTED_DEBUG. Ignores SIGPIPE unless the program set its own
// disposition (as Python does at start-up): a peer's death is then an error, not this process's end.
// Throws ConfigError (bad environment or options, called twice), DistributedTimeout (a peer or the
// store never came), DistributedError (anything else that failed while connecting).
c10::intrusive_ptr<c10d::ProcessGroup> initProcessGroup(const ProcessGroupOptions& options = {});

bool isInitialized();
// The default group; throws ConfigError when initProcessGroup() has not been called.
c10::intrusive_ptr<c10d::ProcessGroup> getDefaultGroup();
// The environment the default group was built from (rank, local rank, launcher, store address).
const DistributedEnv& getDistributedEnv();
// The backend actually in use: "gloo" or "nccl" (auto resolved).
std::string getBackendName();

int getRank();
int getWorldSize();
int getLocalRank();
int getLocalWorldSize();
// Rank 0: the one process that logs summaries and writes snapshots.
inline bool isMainProcess() { return getRank() == 0; }

// A process group over some ranks of the default group (Python's dist.new_group): every rank of the
// default group calls it, in the same order, with the same ranks. The ranks in it get the group (a
// rank's place in it is its place among `ranks` sorted), the others an empty handle. It has the
// default group's backends and timeout, and its keys lie beside the default group's under Python's
// name for it (a counter: "1", "2", ... in the order groups are made), so that C++ and Python ranks
// making the same groups meet. Its members wait for each other to connect; the others return at
// once. Throws ConfigError for an empty list, a rank outside the world or given twice.
c10::intrusive_ptr<c10d::ProcessGroup> newGroup(std::vector<int> ranks);

// Blocks until every rank arrives (bounded by the group's timeout).
void barrier();

// Drops the default group (and the store this rank hosts, if any). Call barrier() first when other
// ranks may still use a store hosted here.
void destroyProcessGroup();

// ---- In-place recovery (ctorchrun --recovery in-place; docs/in-place-recovery.md) ------------------
// True when the default group was created under ctorchrun --recovery in-place: a failed rank is then
// replaced alone and the survivors re-form the group with it (ResilientTraining::recover does it all).
bool inPlaceRecoveryEnabled();
// 0 for the group the job started with; each re-forming makes a newer one.
std::int64_t groupGeneration();
// Drops the default group and, once every rank (the survivors and the replacements the launcher
// started) is in, creates it again over the same store at a newer generation, with the same ranks.
// All of it is agreed with the job's coordinator on ctorchrun's authenticated control channel,
// nothing through the store. A rank that neither comes nor dies within half the group's timeout is
// named to the coordinator, whose agent kills and replaces it (a replacement that never joins is
// given far longer: it starts a process first). Release every other reference to the old group
// first (DDP, your own copies): its connections close when the last goes, which frees peers still
// waiting on them. Throws ConfigError without in-place recovery, Stopped on a stop signal, and
// DistributedTimeout when the group does not re-form within the timeout after the coordinator's
// last news of a replacement on its way (10 x the timeout at most).
c10::intrusive_ptr<c10d::ProcessGroup> reformProcessGroup();

// Tells ctorchrun whether this rank's loop can recover in place (ResilientTraining::resume() says
// it for its loop): until every rank said it can, and from the moment one says it cannot (`why`),
// ctorchrun restarts the whole group at once after a failure instead of replacing the failed worker
// alone. Nothing happens without --recovery in-place.
void declareInPlaceRecovery(bool capable, const std::string& why = "");

namespace detail {
// A replacement between initProcessGroup() and receiving the training state: DDP's construction
// skips its collectives (the survivors are not running them; the state comes from them instead).
bool joiningInPlace();
void joinedInPlace();
} // namespace detail

} // namespace ctorch
