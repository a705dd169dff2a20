// Private: the default process group's state, kept by comm/process_group.cpp (initProcessGroup, the
// getters, destroyProcessGroup) and changed by comm/group_reform.cpp (re-forming the group in
// place after a failure), and the pieces both use to build a group.
#pragma once

#include "core/compat.hpp"

#include "ctorch/distributed.hpp"

#include <ctorch/contract/control_client.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace ctorch::detail {

// Which backends a group has (decided once, from the options and the machine).
struct GroupRecipe {
  bool useNccl = false;
  bool useGloo = true;
  compat::BackendKind defaultKind = compat::BackendKind::kGloo;
};

struct GroupState {
  std::mutex mutex;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;  // keeps a TCPStore server hosted here alive
  std::string prefix;                     // the default group's keys under `store` ("default_pg")
  int groupCount = 1;                     // Python's group counter: the next newGroup's name ("0" is the default group)
  DistributedEnv env;
  std::string backendName;
  // What re-forming the group in place needs (ctorchrun --recovery in-place).
  ProcessGroupOptions options;
  EnvLookup lookup;
  GroupRecipe recipe;
  bool inPlace = false;
  bool joining = false;          // a replacement that has not received the training state yet
  std::int64_t generation = 0;
  // In-place recovery's authenticated channel to the job's coordinator (contract/control_client.hpp).
  std::unique_ptr<contract::control::BlockingClient> control;
};

// The one state of this process (lock its mutex to read or change it).
GroupState& groupState();
// `s` when it holds a group; else a ConfigError saying initProcessGroup() was not called.
GroupState& initializedGroupState(GroupState& s);

// "1.5 s", for messages.
std::string seconds(std::chrono::milliseconds d);

// The process group over `root`, its keys under `prefix` (Python's "default_pg" for the group a run
// starts with), as Python's init_process_group builds it. `phase` is updated for error messages.
c10::intrusive_ptr<c10d::ProcessGroup> buildGroup(const c10::intrusive_ptr<c10d::Store>& root,
                                                  const std::string& prefix, const DistributedEnv& env,
                                                  const ProcessGroupOptions& options, const EnvLookup& lookup,
                                                  const GroupRecipe& recipe, std::string& phase);

// The Gloo devices of this process (GLOO_SOCKET_IFNAME or options.glooInterface, else the host's
// address; loopback for a world of 1 without a store).
std::vector<std::shared_ptr<::gloo::transport::Device>> glooDevices(const ProcessGroupOptions& options,
                                                                   const EnvLookup& lookup,
                                                                   const DistributedEnv& env);

// From a handler: the error of a failed set-up in one line naming the rank and the phase. A
// DistributedTimeout stays one, the library's other errors pass as they are, anything else (Gloo's,
// the store's) becomes a DistributedError.
[[noreturn]] void rethrowDuring(const std::string& where, const std::string& phase);

} // namespace ctorch::detail
