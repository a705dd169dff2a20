// Private: the worker's end of ctorchrun's control channel (contract/control_protocol.hpp), through which
// in-place recovery happens: a spare or preloaded worker waits for a failed rank's assignment, a
// replacement joins the running group, survivors ask for the group to be re-formed and for silent
// ranks to be evicted. comm/process_group.cpp uses it while a group is set up,
// comm/group_reform.cpp when one is re-formed.
#pragma once

#include "ctorch/distributed_env.hpp"

#include <ctorch/contract/control_client.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace ctorch::detail {

// This worker on the job's control channel, behind the workers' store (node rank 0's ctorchrun).
std::unique_ptr<contract::control::BlockingClient> connectControl(const DistributedEnv& env, const EnvLookup& lookup,
                                                                  std::chrono::milliseconds timeout);

struct Joined {
  std::int64_t generation = 0;
  std::string nonce;           // the group's key nonce (hex)
  std::int64_t survivors = 0;  // ranks that kept their training state
};

// Waits on the control channel until the coordinator re-forms the group. A replacement said it joins;
// a survivor that it waits in the re-form of the failed generation, and every `timeout` / 2 it asks
// the coordinator to have the processes that stopped answering killed (their agents replace them).
// While a replacement is on its way (a LibTorch process on a loaded machine takes longer to start
// than the collectives' timeout), the wait goes on a `timeout` past the coordinator's last word:
// each replacement costs one of ctorchrun's restarts, which bounds it, and so does kMaxWaits.
Joined awaitFormed(contract::control::BlockingClient& control, const DistributedEnv& env, std::int64_t failed,
                   std::chrono::milliseconds timeout);

// Tells the coordinator that this rank built the group of `generation` (one formed in place). Its
// agent counts the group as re-formed only once every rank did: a rank that fails before, in the
// re-form, makes the group restart for this failure instead of being replaced. Never throws: a
// coordinator that is gone only leaves the agent thinking the re-form is still under way.
void tellGroupBuilt(contract::control::BlockingClient& control, const DistributedEnv& env, std::int64_t generation);

// A spare worker (ctorchrun --spare-workers): waits on the control channel until the coordinator
// hands it a failed worker's rank (its agent chose it), then makes the assignment this process's
// environment (the rest of the program, and initProcessGroup, read it from there) and returns the
// channel, which from then on speaks for that rank. Waits as long as the job runs: the agent kills
// unused spares when the group ends. The assignment arrives authenticated on this connection only
// and carries numbers only, each checked: the error file follows from CTORCH_SPARE_LOG_DIR and
// LOCAL_RANK. A stop signal while it waits ends it (ctorch::Stopped): it holds nothing to save.
std::unique_ptr<contract::control::BlockingClient> awaitSpareAssignment(const std::string& id, const EnvLookup& lookup);

} // namespace ctorch::detail
