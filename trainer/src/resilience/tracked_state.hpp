// The objects a loop registered with ResilientTraining, and the one way they become a snapshot and
// come back from one (a file, or the state another rank sent during an in-place recovery).
#pragma once

#include "snapshot/capture_pool.hpp"

#include "resilience/resume_plan.hpp"
#include "ctorch/sampler.hpp"
#include "ctorch/snapshot.hpp"
#include "ctorch/stateful.hpp"

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::detail {

// User-state keys of the library's own (names a loop cannot register; shard_files.hpp has the rest).
inline constexpr const char* kEpochCompleteKey = "epoch_complete";

// Where a snapshot stands: its counters, and whether the epoch's data had run out.
SnapshotPoint pointOf(const Snapshot& snapshot);

class TrackedState {
 public:
  // Registration: each throws ConfigError naming what is registered twice or missing.
  // A plain model, trained without a Stateful around it.
  void setModel(torch::nn::Module& module);
  void setOptimizer(torch::optim::Optimizer& optimizer);
  // A Stateful (ctorch/stateful.hpp): the run's model when it has a trackedModule(), its optimizer
  // when it tracksOptimizer(), else state beside them.
  void add(Stateful& object);
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
  DistributedSampler* sampler() const { return sampler_; }
  // Every rank writes a shard file of its own beside each snapshot (a sharded optimizer's, FSDP's
  // model, a pipeline stage's).
  bool sharded() const { return shardSource() != nullptr; }
  // This rank's shard file's content (shard_files.hpp), for a sharded() run.
  Snapshot captureRankShard(const SnapshotIdentity& identity, const TrainingProgress& progress, int rank) const;
  // This rank's shard as restore() takes it among `shards` (a shard file's content, in memory): what
  // ResilienceOptions::shardCopies keeps on the next rank.
  ItemDict rankShard() const;
  // Why a lost rank's shard cannot come back from a neighbour's copy in place (empty: it can; a run
  // that is not sharded() needs no copy).
  std::string whyNoShardCopies() const;
  // The tracked objects' entries of USER_STATE as they are now (a DDP's bucket layout, ...).
  ItemDict entries() const;
  // At resume, before anything is restored: the USER_STATE of the snapshot chosen (null: none).
  void prepareLoad(const ItemDict* userState) const;
  // After every optimizer step.
  void stepEnded() const;
  // The tensors the optimizer steps (a sharded model's shards, else the model's parameters).
  std::vector<at::Tensor> steppedParameters() const;
  // In-place recovery: every tracked object lets go of the failed group, then follows the re-formed
  // one with `userState`'s entries (null: as freshly made).
  void leaveGroups() const;
  void joinGroups(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) const;

  // Every USER_STATE field the library and the registered loads read, judged by its kind while the
  // snapshot is chosen (LoadNewestOptions::accept): throws SnapshotCorrupt naming the first wrong
  // one, so the file is set aside like a damaged one and the next resumes, instead of a load failing
  // after the choice (a c10::Error from toBool(), an exit 1 with .1 never tried).
  void checkFields(const Snapshot& snapshot) const;

  // A snapshot of this moment: the objects' copies, the scheduler, the user items, whether the
  // epoch's data ran out, and the tracked objects' `entries` (as they were before a group was left;
  // null: as they are now, entries()). `pool`: reused capture buffers.
  Snapshot capture(const SnapshotIdentity& identity, const TrainingProgress& progress, bool epochComplete,
                   const ItemDict* entries, CapturePool* pool) const;
  // Every registered object as `snapshot` holds it (a sharded object's share from `shards`,
  // shard_files.hpp's findShards); returns where it stands.
  SnapshotPoint restore(const Snapshot& snapshot, const RestoreOptions& options,
                        const std::vector<ItemDict>& shards = {}) const;

 private:
  // Refuses an empty name, one of the library's own, or one registered twice; records it.
  void claimName(const std::string& name);
  // The object whose shard this rank writes: a sharded optimizer's, else a sharded model's.
  Stateful* shardSource() const;
  // A snapshot whose USER_STATE carries an entry of a kind no tracked object claims is refused.
  void refuseUnclaimed(const Snapshot& snapshot, const RestoreOptions& options) const;

  struct Items {
    std::function<void(ItemDict&)> save;
    std::function<void(const ItemDict&)> load;
  };

  torch::nn::Module* model_ = nullptr;
  torch::optim::Optimizer* optimizer_ = nullptr;
  Stateful* modelObject_ = nullptr;      // the Stateful that brought the model
  Stateful* optimizerObject_ = nullptr;  // the Stateful that is the optimizer
  std::vector<Stateful*> objects_;       // every Stateful, in registration order
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
