// The default group re-formed in place after a rank failed (ctorchrun --recovery in-place): a
// survivor asks the job's coordinator for the next generation and, once every rank's current
// process waits or joins, builds the group again under that generation's keys; and what a loop
// tells the coordinator (declareInPlaceRecovery), what it asks (inPlaceRecoveryEnabled,
// groupGeneration). The re-forming as a whole is docs/in-place-recovery.md.
#include "ctorch/distributed.hpp"

#include "comm/control_channel.hpp"
#include "comm/group_state.hpp"

#include <ctorch/contract/control_protocol.hpp>

#include <iostream>
#include <mutex>

namespace ctorch {

bool inPlaceRecoveryEnabled() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.group && s.inPlace;
}

std::int64_t groupGeneration() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return detail::initializedGroupState(s).generation;
}

void declareInPlaceRecovery(bool capable, const std::string& why) {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.group || !s.inPlace || !s.control) return;
  namespace cc = contract::control;
  cc::Message m = cc::message(cc::Type::kDeclare);
  m.value = capable ? 1 : 0;
  m.text = why.substr(0, 200);
  try {
    s.control->send(m);
  } catch (const std::exception& e) {
    // The coordinator is gone (its host was lost): ctorchrun restarts the group after a failure.
    std::cerr << "ctorch: rank " + std::to_string(s.env.rank) + ": could not tell the coordinator: " + e.what() + "\n"
              << std::flush;
  }
}

namespace detail {
bool joiningInPlace() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.group && s.joining;
}

void joinedInPlace() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.joining = false;
}
} // namespace detail

c10::intrusive_ptr<c10d::ProcessGroup> reformProcessGroup() {
  detail::GroupState& s = detail::groupState();
  c10::intrusive_ptr<c10d::ProcessGroup> old;
  c10::intrusive_ptr<c10d::Store> root;
  DistributedEnv env;
  ProcessGroupOptions options;
  EnvLookup lookup;
  detail::GroupRecipe recipe;
  std::int64_t failed = 0;
  bool holdsState = true;
  contract::control::BlockingClient* control = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    detail::initializedGroupState(s);
    if (!s.inPlace || !s.control)
      throw ConfigError("reformProcessGroup() needs a job launched with ctorchrun --recovery in-place");
    control = s.control.get();
    holdsState = !s.joining;
    old = std::move(s.group);
    root = s.store;
    env = s.env;
    options = s.options;
    lookup = s.lookup;
    recipe = s.recipe;
    failed = s.generation;
  }
  // Closes this rank's connections of the failed group (when nothing else holds it): a peer still
  // waiting on one of them fails now instead of at its timeout, and comes to re-form too.
  old.reset();
  const std::string where = "rank " + std::to_string(env.rank) + "/" + std::to_string(env.worldSize);
  std::string phase = "waiting for the group to re-form after generation " + std::to_string(failed) + " failed";
  try {
    namespace cc = contract::control;
    cc::Message reform = cc::message(cc::Type::kReform);
    reform.generation = failed;
    reform.value = holdsState ? 1 : 0;
    control->send(reform);
    const detail::Joined joined = detail::awaitFormed(*control, env, failed, options.timeout());
    const std::int64_t generation = joined.generation;
    phase = "connecting to the other ranks of group generation " + std::to_string(generation) + " (timeout " +
            detail::seconds(options.timeout()) + ")";
    auto pg = detail::buildGroup(root, cc::groupPrefix(generation, joined.nonce), env, options, lookup, recipe, phase);
    detail::tellGroupBuilt(*control, env, generation);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.group = pg;
    s.prefix = cc::groupPrefix(generation, joined.nonce);
    s.groupCount = 1;  // groups made by newGroup belong to the old generation: make them again
    s.generation = generation;
    return pg;
  } catch (...) {
    detail::rethrowDuring(where, phase);
  }
}

} // namespace ctorch
