// The objects a loop registered with ResilientTraining, and the one way they become a snapshot and
// come back from one (a file, or the state another rank sent during an in-place recovery).
#pragma once

#include "snapshot/capture_pool.hpp"

#include "ctorch/ddp.hpp"
#include "ctorch/fully_sharded_data_parallel.hpp"
#include "resilience/resume_plan.hpp"
#include "ctorch/sampler.hpp"
#include "ctorch/snapshot.hpp"
#include "ctorch/zero_redundancy_optimizer.hpp"

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ctorch {
class PipelineSchedule;
}

namespace ctorch::detail {

// User-state keys of the library's own (names a loop cannot register; zero_shards.hpp has one more).
inline constexpr const char* kEpochCompleteKey = "epoch_complete";
inline constexpr const char* kDdpBucketsKey = "ddp_buckets";

// DDP's gradient buckets: the parameter indices of each, in reduction order.
using BucketLayout = std::vector<std::vector<std::size_t>>;

// Where a snapshot stands: its counters, and whether the epoch's data had run out.
SnapshotPoint pointOf(const Snapshot& snapshot);
// The bucket layout the snapshot's run reduced with (none for a run without DDP); SnapshotCorrupt
// when the entry is malformed.
std::optional<BucketLayout> bucketsOf(const Snapshot& snapshot);

// A sharded optimizer's state (ZeroRedundancyOptimizer, ParameterServer): this rank's shard in the
// global-index layout, and the restore of this rank's share from every rank's shard.
struct ShardedOptimizer {
  std::function<ItemDict()> shard;
  std::function<void(const std::vector<ItemDict>&)> load;
  // In-place recovery (null: it cannot follow a re-formed group).
  std::function<void()> releaseGroup;
  std::function<void(c10::intrusive_ptr<c10d::ProcessGroup>)> rejoin;
};

class TrackedState {
 public:
  // Registration: each throws ConfigError naming what is registered twice or missing.
  void setModel(torch::nn::Module& module, DDPCore* ddp);
  // A fully sharded model: its parameters (and the optimizer's state) are written per rank.
  void setModel(FSDPCore& fsdp);
  // A pipeline stage (its schedule's): its parameters, buffers and optimizer state, its layout and
  // the schedule's step count are written per rank.
  void setModel(PipelineSchedule& pipeline);
  void setOptimizer(torch::optim::Optimizer& optimizer);
  // A sharded optimizer: its state is written per rank (zero_shards.hpp), not in the snapshot.
  void setOptimizer(ZeroRedundancyOptimizer& optimizer);
  void setOptimizer(ShardedOptimizer sharded);
  void setSampler(DistributedSampler& sampler);
  void setScheduler(std::function<ItemDict()> save, std::function<void(const ItemDict&)> load);
  void addItems(std::function<void(ItemDict&)> save, std::function<void(const ItemDict&)> load);
  // USER_STATE[name]: a name of the library's own or one registered twice is refused. `check`
  // (optional) judges the file's value while the snapshot is chosen (checkFields).
  void addNamed(const std::string& name, std::function<c10::IValue()> save,
                std::function<void(const c10::IValue&)> load,
                std::function<void(const c10::IValue&)> check = {});
  // USER_STATE[name]: a number of each rank's own, saved as a list indexed by rank.
  void addPerRank(const std::string& name, std::function<double()> save, std::function<void(std::optional<double>)> load);
  bool hasPerRank() const { return !perRank_.empty(); }
  // This rank's values, in registration order.
  std::vector<double> perRankValues() const;
  // Into `userState`: every rank's values (`all`: world x count, rank-major, as gathered).
  void insertPerRank(ItemDict& userState, const std::vector<double>& all, int world) const;
  // Each load gets this rank's value when `snapshot` holds one list per rank of `world` entries, else nullopt.
  void restorePerRank(const Snapshot& snapshot, int rank, int world) const;

  torch::nn::Module* model() const { return model_; }
  DDPCore* ddp() const { return ddp_; }
  DistributedSampler* sampler() const { return sampler_; }
  const ShardedOptimizer* zero() const { return zero_ ? &*zero_ : nullptr; }
  FSDPCore* fsdp() const { return fsdp_; }
  // Every rank writes a shard file of its own beside each snapshot (a sharded optimizer's, FSDP's
  // model, a pipeline stage's).
  bool sharded() const { return zero_.has_value() || fsdp_ != nullptr || pipeline_ != nullptr; }
  // This rank's shard file's content (shard_files.hpp), for a sharded() run.
  Snapshot captureRankShard(const SnapshotIdentity& identity, const TrainingProgress& progress, int rank) const;
  // This rank's shard as restore() takes it among `shards` (a shard file's content, in memory): what
  // ResilienceOptions::shardCopies keeps on the next rank.
  ItemDict rankShard() const;
  // Why a lost rank's shard cannot come back from a neighbour's copy in place (empty: it can; a run
  // that is not sharded() needs no copy).
  std::string whyNoShardCopies() const;
  // In-place recovery: the sharded objects let go of the failed group, then follow the re-formed one.
  void releaseShardedGroups() const;
  void rejoinShardedGroups(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const;

  // Every USER_STATE field the library and the registered loads read, judged by its kind while the
  // snapshot is chosen (LoadNewestOptions::accept): throws SnapshotCorrupt naming the first wrong
  // one, so the file is set aside like a damaged one and the next resumes, instead of a load failing
  // after the choice (a c10::Error from toBool(), an exit 1 with .1 never tried).
  void checkFields(const Snapshot& snapshot) const;

  // A snapshot of this moment: the objects' copies, the scheduler, the user items, whether the
  // epoch's data ran out, and `buckets` (DDP's layout) when given. `pool`: reused capture buffers.
  Snapshot capture(const SnapshotIdentity& identity, const TrainingProgress& progress, bool epochComplete,
                   const std::optional<BucketLayout>& buckets, CapturePool* pool) const;
  // Every registered object as `snapshot` holds it (a ZeroRedundancyOptimizer's share from `shards`,
  // zero_shards.hpp's findShards); returns where it stands.
  SnapshotPoint restore(const Snapshot& snapshot, const RestoreOptions& options,
                        const std::vector<ItemDict>& shards = {}) const;

 private:
  // Refuses an empty name, one of the library's own, or one registered twice; records it.
  void claimName(const std::string& name);
  // The pipeline stage's layout (kPipelineStageKey's dict).
  ItemDict pipelineLayout() const;
  // restore() of a pipeline stage: its shard among `shards` (rank options.rank's when it holds this
  // stage, else another replica's of the same stage), the layout checked first.
  SnapshotPoint restorePipeline(const Snapshot& snapshot, const RestoreOptions& options,
                                const std::vector<ItemDict>& shards) const;

  struct Items {
    std::function<void(ItemDict&)> save;
    std::function<void(const ItemDict&)> load;
  };

  torch::nn::Module* model_ = nullptr;
  DDPCore* ddp_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  std::optional<ShardedOptimizer> zero_;
  FSDPCore* fsdp_ = nullptr;
  PipelineSchedule* pipeline_ = nullptr;
  DistributedSampler* sampler_ = nullptr;
  std::function<ItemDict()> schedulerSave_;
  std::function<void(const ItemDict&)> schedulerLoad_;
  std::vector<std::string> names_;  // registered user-state names
  std::vector<std::pair<std::string, std::function<void(const c10::IValue&)>>> checks_;  // addNamed's checks
  std::vector<Items> items_;
  struct PerRank {
    std::string name;
    std::function<double()> save;
    std::function<void(std::optional<double>)> load;
  };
  std::vector<PerRank> perRank_;
};

} // namespace ctorch::detail
