// Hybrid sharding's two groups: the layout decided from the world and the shard size alone, then the
// groups made with newGroup, every rank making all of them in the same order.
#include "ctorch/hybrid_shard_groups.hpp"

#include "ctorch/distributed.hpp"

#include "comm/group_state.hpp"

#include <string>
#include <vector>

namespace ctorch {

HybridShardLayout hybridShardLayout(int worldSize, int rank, int shardSize) {
  if (worldSize < 1 || rank < 0 || rank >= worldSize)
    throw ConfigError("hybrid sharding: rank " + std::to_string(rank) + " is not in a world of " + std::to_string(worldSize));
  if (shardSize < 1 || worldSize % shardSize != 0)
    throw ConfigError("hybrid sharding: a world of " + std::to_string(worldSize) + " ranks is not nodes x " +
                      std::to_string(shardSize) + " ranks (the shard group's size must divide the world)");
  HybridShardLayout out;
  out.shardSize = shardSize;
  out.replicas = worldSize / shardSize;
  out.node = rank / shardSize;
  out.localRank = rank % shardSize;
  out.shardGroups.resize(out.replicas);
  out.replicateGroups.resize(shardSize);
  for (int r = 0; r < worldSize; ++r) {
    out.shardGroups[r / shardSize].push_back(r);
    out.replicateGroups[r % shardSize].push_back(r);
  }
  return out;
}

namespace {

// Every rank's (shard size, local rank), through the default group's store: ranks that disagree are
// refused together rather than left waiting in groups that never fill.
std::vector<std::pair<int, int>> everyRanksShardSize(int shardSize, int localRank) {
  detail::GroupState& s = detail::groupState();
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  DistributedEnv env;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    detail::initializedGroupState(s);
    store = c10::make_intrusive<c10d::PrefixStore>(s.prefix, s.store);
    key = "hybrid_shard_groups/" + std::to_string(s.groupCount) + "/";
    env = s.env;
  }
  const std::string mine = std::to_string(shardSize) + " " + std::to_string(localRank);
  store->set(key + std::to_string(env.rank), std::vector<std::uint8_t>(mine.begin(), mine.end()));
  std::vector<std::pair<int, int>> out;
  for (int r = 0; r < env.worldSize; ++r) {
    const auto bytes = store->get(key + std::to_string(r));
    const std::string text(bytes.begin(), bytes.end());
    const auto space = text.find(' ');
    out.emplace_back(std::stoi(text.substr(0, space)), std::stoi(text.substr(space + 1)));
  }
  return out;
}

} // namespace

HybridShardGroups hybridShardGroups(const HybridShardOptions& options) {
  const DistributedEnv env = getDistributedEnv();
  const bool fromEnvironment = !options.shardSize().has_value();
  const int shardSize = options.shardSize().value_or(env.localWorldSize);
  const int localRank = fromEnvironment ? env.localRank : (shardSize > 0 ? env.rank % shardSize : 0);
  const auto all = everyRanksShardSize(shardSize, localRank);
  const char* what = fromEnvironment ? "LOCAL_WORLD_SIZE" : "shardSize";
  for (int r = 0; r < env.worldSize; ++r) {
    if (all[r].first != shardSize)
      throw ConfigError("hybrid sharding needs nodes of equal size: rank " + std::to_string(r) + " has " + what + "=" +
                        std::to_string(all[r].first) + ", rank " + std::to_string(env.rank) + " " +
                        std::to_string(shardSize) + " (world " + std::to_string(env.worldSize) + ")");
    if (shardSize > 0 && all[r].second != r % shardSize)
      throw ConfigError("hybrid sharding needs ranks numbered node by node (torchrun's numbering): rank " +
                        std::to_string(r) + " has LOCAL_RANK=" + std::to_string(all[r].second) + ", not " +
                        std::to_string(r % shardSize) + " with " + what + "=" + std::to_string(shardSize));
  }
  HybridShardGroups out;
  out.layout = hybridShardLayout(env.worldSize, env.rank, shardSize);
  for (std::size_t n = 0; n < out.layout.shardGroups.size(); ++n) {
    auto group = newGroup(out.layout.shardGroups[n]);
    if (static_cast<int>(n) == out.layout.node) out.shard = group;
  }
  if (out.layout.replicas > 1)
    for (std::size_t l = 0; l < out.layout.replicateGroups.size(); ++l) {
      auto group = newGroup(out.layout.replicateGroups[l]);
      if (static_cast<int>(l) == out.layout.localRank) out.replicate = group;
    }
  return out;
}

} // namespace ctorch
