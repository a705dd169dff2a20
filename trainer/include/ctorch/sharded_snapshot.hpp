// A sharded run's snapshot (ZeRO-1, FSDP, a parameter server) keeps part of its state in one shard
// file per rank ("<file>.shards/rank<r>.pt"): what such a snapshot is made of, whether its shards are
// all there and belong to it, and the whole state in one file — MODEL_STATE and OPTIMIZER_STATE in
// Python's layout, as a run without sharding writes them, so that torch.load opens it and a run
// without sharding resumes from it. Offline: no process group, no model. The ctorch-snapshot
// program is built on these (docs/snapshot.md).
#pragma once

#include "ctorch/snapshot.hpp"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace ctorch {

enum class SnapshotSharding {
  kNone,                // the whole state is in the snapshot file
  kOptimizer,           // ZeRO-1 or a parameter server: the optimizer's state is in the shards
  kFullyShardedModel,   // FSDP: the parameters and the optimizer's state are in the shards
  kPipelineStages,      // pipeline stages: each stage's parameters and optimizer state in its ranks' shards
};
const char* toString(SnapshotSharding sharding);

// How `snapshot` was saved.
SnapshotSharding shardingOf(const Snapshot& snapshot);

// One rank's shard of a sharded snapshot, as found beside it.
struct SnapshotShard {
  int rank = 0;
  std::filesystem::path file;  // the file taken, or the first looked at when none fits
  bool usable = false;         // found, intact, of this snapshot's save, step and world size
  std::string problem;         // why not, in one line, when not usable
};

// Every rank's shard of `snapshot` (loaded from a file: its source names where to look; a rotated
// "<slot>.N" is looked for among its slot's shards too). Empty for a snapshot without sharding.
std::vector<SnapshotShard> findSnapshotShards(const Snapshot& snapshot);

// The whole state of a sharded snapshot in one snapshot: its progress, sampler, RNG, scheduler and
// user state as they are, MODEL_STATE whole (FSDP's parameters gathered from the shards' flat
// buffers; a pipeline's stages side by side, under the model's own names), OPTIMIZER_TYPE and
// OPTIMIZER_STATE whole, indexed by the model's parameters in order as
// a run without sharding saves them (one group per distinct set of options). A snapshot without
// sharding comes back as it is. Throws SnapshotError naming the first shard that is missing, damaged
// or of another save, and SnapshotIncompatible for an FSDP snapshot written before its shards
// recorded their layout.
Snapshot consolidateSnapshot(const Snapshot& snapshot);

} // namespace ctorch
