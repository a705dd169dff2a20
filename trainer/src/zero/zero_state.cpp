// ZeroRedundancyOptimizer as a checkpoint sees it (ctorch/stateful.hpp): a ShardedOptimizerState
// (its shards saved and resharded there); in place, it follows the re-formed default group when it
// runs on it.
#include "ctorch/zero_redundancy_optimizer.hpp"

namespace ctorch {

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
