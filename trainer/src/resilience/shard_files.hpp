// A sharded run's part of a snapshot: every rank writes its shard (ZeRO's optimizer share, FSDP's
// parameters and optimizer state, a pipeline stage's; each Stateful's shardFile()) to its own file in the slot's shard folder ("<slot>.shards/rank<r>.pt", rotated like
// the slot), and a chosen snapshot finds the shards it was saved with.
#pragma once

#include "ctorch/snapshot.hpp"
#include "ctorch/state_dict.hpp"

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::detail {

// USER_STATE of a snapshot saved with a ZeroRedundancyOptimizer: the world size its shards were
// saved at (one shard file per rank; the snapshot itself holds no optimizer state).
inline constexpr const char* kZeroShardsKey = "zero_shards";
// USER_STATE of a snapshot saved with FullyShardedDataParallel (it holds no parameters), and the key
// of the parameter shard in each rank's file (its optimizer shard: "fsdp_optimizer").
inline constexpr const char* kShardedModelKey = "fsdp_model";
// USER_STATE of a snapshot saved by pipeline stages (the number of stages; it holds no parameters),
// and of each rank's shard file: its stage's layout (a dict: "stages", "stage", "children" — the
// model's children it holds, by their index in the model —, "parameters", "steps": the schedule's
// step count); the shard's MODEL_STATE and OPTIMIZER_STATE are the stage's.
inline constexpr const char* kPipelineStageKey = "pipeline_stage";
// The stage's parameters and buffers in a shard as restore() takes it (a shard file's MODEL_STATE).
inline constexpr const char* kPipelineModelKey = "pipeline_model";

// USER_STATE of a snapshot saved with DistributedDataParallel: its gradient buckets, the parameter
// indices of each in reduction order (ddp/ddp_state.cpp).
inline constexpr const char* kDdpBucketsKey = "ddp_buckets";
// USER_STATE of FSDP's shard file: its optimizer's state shard (its parameter shard is kShardedModelKey's).
inline constexpr const char* kShardedOptimizerKey = "fsdp_optimizer";
// USER_STATE of every shard file: the rank that wrote it.
inline constexpr const char* kShardRankKey = "zero_rank";

// The empty module a snapshot without parameters is captured from.
torch::nn::Module& noModel();

// Rank `rank`'s shard file for the snapshot slot (or any snapshot file) `slot`.
std::filesystem::path shardSlotFor(const std::filesystem::path& slot, int rank);

// This rank's shard (ZeroRedundancyOptimizer::shardStateDict's layout) as a snapshot file's content: no model, the optimizer state of its share (with
// the parameters' global indices), and the run's point, so that a shard checks itself (magic, digest,
// run, configuration) and says which step it belongs to.
Snapshot captureShard(const ItemDict& shard, const SnapshotIdentity& identity,
                      const TrainingProgress& progress);

// A pipeline stage's: its module's parameters and buffers, `optimizer`'s state (indexed by the stage's
// parameters), `layout` (kPipelineStageKey's dict) and `rank`.
Snapshot captureShard(torch::nn::Module& stageModule, torch::optim::Optimizer* optimizer, const ItemDict& layout,
                      int rank, const SnapshotIdentity& identity, const TrainingProgress& progress);

// A pipeline stage's layout (kPipelineStageKey's dict), checked: SnapshotCorrupt naming `snapshot`
// when an entry is missing or of another type.
struct PipelineStageLayout {
  std::int64_t stages = 0, stage = 0, parameters = 0, steps = 0;
  std::vector<std::string> children;  // the model's children the stage holds, by their index in it
};
PipelineStageLayout pipelineStageLayout(const Snapshot& snapshot, const c10::IValue& layout);
// The same of a pipeline shard as findShards returns it (its parameters there too).
PipelineStageLayout pipelineShardLayout(const Snapshot& snapshot, const ItemDict& shard);

// One rank's shard of `snapshot` among the shard files of `slots`: the first intact one of its step,
// world size, save and configuration; else why none fits (and the file that came closest).
struct ShardLookup {
  std::optional<Snapshot> found;
  std::filesystem::path file;
  std::string why;
};
ShardLookup lookForShard(const Snapshot& snapshot, int world, int rank, const std::vector<std::filesystem::path>& slots,
                         const SnapshotExpectation& expect);

// The world size the shards of `snapshot` (which records kZeroShardsKey) were saved at.
int shardWorld(const Snapshot& snapshot);

// Where the shards of the snapshot file `file` may be: its own, and its slot's when it is a rotated
// "<slot>.N".
std::vector<std::filesystem::path> slotsOf(const std::filesystem::path& file);

// The shards of `snapshot` (which records kZeroShardsKey): every rank's, at the snapshot's global
// step, from the shard files of `slots` (the snapshot's own file and the slots it may have been
// rotated from), newest first. Throws SnapshotError naming the first rank whose shard is missing or damaged.
std::vector<ItemDict> findShards(const Snapshot& snapshot, const std::vector<std::filesystem::path>& slots,
                                 const SnapshotExpectation& expect);

// FSDP's shards of `snapshot` (as findShards returns them): the ranks' pieces of every flat buffer
// and of each optimizer state tile it exactly once, in one dtype (snapshot/shard_pieces.hpp); else
// SnapshotCorrupt naming `snapshot`, so that a resume sets the set aside like a damaged file. Shards
// of another kind pass. Allocates nothing but a replica's comparison.
void checkFullyShardedPieces(const Snapshot& snapshot, const std::vector<ItemDict>& shards);

// A shard file's content as findShards returns it: the optimizer's "state", "param_groups" and
// "optimizer_type", every entry its writer left in USER_STATE, and a pipeline stage's parameters.
ItemDict shardOf(const Snapshot& shardFile);

// A snapshot saved without sharding holds the whole optimizer's state: as one shard (its parameters
// are the model's in order, the global indices ZeRO uses), so that a run can switch to ZeRO.
ItemDict wholeOptimizerAsShard(const Snapshot& snapshot);

// What a sharded optimizer (`name`: ZeroRedundancyOptimizer, ParameterServer) restores its share
// from: the snapshot's shards when it was saved sharded, else its whole optimizer's state as one
// shard; SnapshotIncompatible when it holds neither.
std::vector<ItemDict> optimizerShardsOf(const Snapshot& snapshot, const std::vector<ItemDict>& shards,
                                        const std::string& name);

} // namespace ctorch::detail
