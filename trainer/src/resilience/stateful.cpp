// The defaults of ctorch::Stateful (ctorch/stateful.hpp): an object that says nothing of shards has
// none, and one that says nothing of in-place recovery cannot follow a re-formed group.
#include "ctorch/stateful.hpp"

#include "ctorch/errors.hpp"

namespace ctorch {

ItemDict Stateful::shardState(torch::optim::Optimizer* optimizer) const {
  (void)optimizer;
  throw ConfigError("ResilientTraining: " + stateName() + " is not sharded: it has no shard of its own");
}

Snapshot Stateful::shardFile(const ShardContext& context) const {
  (void)context;
  throw ConfigError("ResilientTraining: " + stateName() + " is not sharded: it writes no shard file");
}

std::string Stateful::whyNotInPlace() const {
  return "its " + stateName() + " does not say how it follows a re-formed process group (Stateful::joinGroup)";
}

} // namespace ctorch
