// ZeroRedundancyOptimizer as a checkpoint sees it (ctorch/stateful.hpp): the run's optimizer, whose
// state is in every rank's shard file (this rank's share, in the global-index layout), resharded on
// resume when the world size changed; a snapshot saved with a whole optimizer resumes too (its state
// as one shard). In place, it follows the re-formed default group when it runs on it.
#include "ctorch/zero_redundancy_optimizer.hpp"

#include "resilience/shard_files.hpp"

namespace ctorch {

ItemDict ZeroRedundancyOptimizer::shardState(torch::optim::Optimizer* optimizer) const {
  (void)optimizer;
  return shardStateDict();
}

Snapshot ZeroRedundancyOptimizer::shardFile(const ShardContext& context) const {
  return detail::captureShard(shardStateDict(), context.identity, context.progress);
}

void ZeroRedundancyOptimizer::loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) {
  if (load.options.optimizer) loadShardStateDicts(detail::optimizerShardsOf(snapshot, shards, stateName()));
}

std::string ZeroRedundancyOptimizer::whyNotInPlace() const {
  if (followsDefaultGroup()) return {};
  return "its ZeroRedundancyOptimizer runs on a process group of its own (ZeroOptions::processGroup), which is not re-formed";
}

void ZeroRedundancyOptimizer::leaveGroup() {
  if (followsDefaultGroup()) releaseGroup();
}

void ZeroRedundancyOptimizer::joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) {
  (void)userState;
  if (followsDefaultGroup()) rejoin(group);
}

} // namespace ctorch
