// The two process groups of hybrid sharding (Python's HYBRID_SHARD, FSDP2's 2-D device mesh): shard
// within a node, replicate across nodes.
//   auto groups = ctorch::hybridShardGroups();   // after initProcessGroup(); every rank calls it
//   ctorch::FullyShardedDataParallel fsdp(net, ctorch::FSDPOptions()
//       .processGroup(groups.shard).replicateGroup(groups.replicate));
#pragma once

#include "ctorch/errors.hpp"

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <optional>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace ctorch {

// Who is in which group, for a world of `worldSize` ranks numbered node by node (torchrun's
// numbering: node n holds ranks n*S .. n*S+S-1, S = shardSize).
struct HybridShardLayout {
  int shardSize = 1;  // ranks per node: the shard group's size
  int replicas = 1;   // nodes: the replicate group's size
  std::vector<std::vector<int>> shardGroups;      // node n's ranks
  std::vector<std::vector<int>> replicateGroups;  // local rank l on every node: l, S+l, 2S+l, ...
  int node = 0, localRank = 0;                    // `rank`'s shard group and replicate group
};

// Pure. Throws ConfigError (one line, the values named) when shardSize is not positive or does not
// divide the world, or rank is outside it.
HybridShardLayout hybridShardLayout(int worldSize, int rank, int shardSize);

struct HybridShardOptions {
  // Ranks per shard group. Unset: LOCAL_WORLD_SIZE (the ranks of this node), checked equal on every
  // rank and consistent with the ranks' numbering. Set it to group processes of one host as if they
  // were several nodes (tests), or to shard over part of a node.
  TORCH_ARG(std::optional<int>, shardSize);
};

struct HybridShardGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> shard;      // this node's ranks (FSDPOptions::processGroup)
  c10::intrusive_ptr<c10d::ProcessGroup> replicate;  // the ranks with this local rank on every node;
                                                     // empty when there is one node (plain FSDP)
  HybridShardLayout layout;
};

// Makes every node's shard group and every local rank's replicate group (newGroup, in that order, on
// every rank: a collective of the default group) and returns this rank's two. Throws ConfigError when
// the world is not nodes x equal local world sizes (ranks disagree on LOCAL_WORLD_SIZE, or a rank's
// LOCAL_RANK is not its place on its node), naming the values.
HybridShardGroups hybridShardGroups(const HybridShardOptions& options = {});

} // namespace ctorch
