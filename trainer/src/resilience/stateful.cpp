// The defaults of ctorch::Stateful (ctorch/stateful.hpp): an object that says nothing of shards has
// none, and one that says nothing of in-place recovery cannot follow a re-formed group.
#include "ctorch/stateful.hpp"

#include "ctorch/errors.hpp"
#include "resilience/shard_files.hpp"

namespace ctorch {

ItemDict Stateful::shardState(torch::optim::Optimizer* optimizer) const {
  (void)optimizer;
  throw ConfigError("ResilientTraining: " + stateName() + " is not sharded: it has no shard of its own");
}

// A shard file of its own: no parameters, its shardState()'s entries in USER_STATE (a shard's
// entries come back as they were, beside the optimizer's "state", "param_groups" and
// "optimizer_type"), and the rank that wrote it.
Snapshot Stateful::shardFile(const ShardContext& context) const {
  Snapshot s = captureSnapshot(TrainingObjects{&detail::noModel(), nullptr, nullptr}, context.identity, context.progress);
  for (const auto& entry : shardState(context.optimizer)) s.userState.insert(entry.key(), entry.value());
  s.userState.insert(detail::kShardRankKey, static_cast<std::int64_t>(context.rank));
  return s;
}

ItemDict ShardedOptimizerState::shardState(torch::optim::Optimizer* optimizer) const {
  (void)optimizer;
  return shardStateDict();
}

Snapshot ShardedOptimizerState::shardFile(const ShardContext& context) const {
  return detail::captureShard(shardStateDict(), context.identity, context.progress);
}

void ShardedOptimizerState::loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) {
  if (load.options.optimizer) loadShardStateDicts(detail::optimizerShardsOf(snapshot, shards, stateName()));
}

std::string Stateful::whyNotInPlace() const {
  return "its " + stateName() + " does not say how it follows a re-formed process group (Stateful::joinGroup)";
}

} // namespace ctorch
