// The worker contract made concrete: the environment each worker starts with (the agent's own
// environment plus torchrun's variables). Pure functions; the variable names come from
// ctorch/contract/worker_contract.hpp.
#pragma once

#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/rendezvous.hpp"

#include <map>
#include <string>
#include <vector>

namespace ctorch::launcher {

// The contract variables of one worker (what torchrun sets), in name order.
std::map<std::string, std::string> contractVariables(const LaunchConfig& config,
                                                     const RendezvousInfo& info, int localRank,
                                                     int restartCount, const std::string& errorFile);

// `base` ("KEY=VALUE" entries, e.g. environ) less ctorchrun's own variables (contract::
// kLauncherOwnedVariables) and CTORCH_JOB_SECRET, with the contract variables set, plus defaults that
// apply only when unset: TORCH_NCCL_ASYNC_ERROR_HANDLING and NCCL_ASYNC_ERROR_HANDLING (the
// name LibTorch 1.x reads) = 1, and OMP_NUM_THREADS = 1 when `defaultOmpThreads`.
std::vector<std::string> workerEnvironment(const std::vector<std::string>& base,
                                           const std::map<std::string, std::string>& contract,
                                           bool defaultOmpThreads);

// Whether OMP_NUM_THREADS=1 should be added (torchrun: unset and more than one worker per node).
bool shouldDefaultOmpThreads(const std::vector<std::string>& base, int localNproc);

std::vector<std::string> currentEnvironment();

} // namespace ctorch::launcher
