// ParameterServer as a checkpoint sees it (ctorch/stateful.hpp): the run's optimizer, the servers'
// shards of its state written as a ZeroRedundancyOptimizer's are (every rank its own file; a
// worker's holds nothing), resharded over another number of servers on resume. Its servers and
// workers play fixed roles: it cannot follow a group re-formed in place.
#include "ctorch/parameter_server.hpp"

#include "resilience/shard_files.hpp"

namespace ctorch {

ItemDict ParameterServer::shardState(torch::optim::Optimizer* optimizer) const {
  (void)optimizer;
  return shardStateDict();
}

Snapshot ParameterServer::shardFile(const ShardContext& context) const {
  return detail::captureShard(shardStateDict(), context.identity, context.progress);
}

void ParameterServer::loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) {
  if (load.options.optimizer) loadShardStateDicts(detail::optimizerShardsOf(snapshot, shards, stateName()));
}

std::string ParameterServer::whyNotInPlace() const {
  return "its parameter server's servers and workers play fixed roles, which a re-formed group does not keep";
}

} // namespace ctorch
