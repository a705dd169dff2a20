// What a checkpoint needs of a training object that holds state of its own: a way of sharing the
// step (DistributedDataParallel, ZeroRedundancyOptimizer, FullyShardedDataParallel and its hybrid,
// ParameterServer, a pipeline stage's PipelineSchedule) or a user's own. ResilientTraining tracks
// a list of them (`training.track(x)` for any Stateful) and knows none by name: each says here what
// it adds to rank 0's snapshot, what this rank's shard is, how it loads both back (resharded where
// it can), and whether it can follow a process group re-formed in place (docs/resilience.md).
//
// A plain torch::nn::Module and torch::optim::Optimizer need no Stateful: ResilientTraining saves
// them whole. A run tracks one model (a plain module, or a Stateful whose trackedModule() is set)
// and at most one optimizer (a plain one, or a Stateful whose tracksOptimizer() is true).
#pragma once

#include "ctorch/snapshot.hpp"
#include "ctorch/state_dict.hpp"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace ctorch {

// What a sharded object writes as this rank's shard file.
struct ShardContext {
  // The whole optimizer tracked beside a sharded model (its state is sharded with the model's), or null.
  torch::optim::Optimizer* optimizer = nullptr;
  int rank = 0;
  SnapshotIdentity identity;
  TrainingProgress progress;
};

// One restore in progress: every tracked Stateful's loadState() runs in turn, then the rest of the
// run (the model when it is whole, the whole optimizer, the sampler, the RNG) is restored from
// `whole` with `options`, then `after` runs.
struct StateLoad {
  // What the rest is restored from: the snapshot, or a Stateful's rewrite of it (a pipeline stage
  // puts its stage's parameters and optimizer state in from its shard).
  Snapshot whole;
  // The whole optimizer tracked beside it (null: none); a sharded model loads its shard of its state.
  torch::optim::Optimizer* optimizer = nullptr;
  // options.model / options.optimizer: whether the rest restores the model's parameters and the
  // whole optimizer's state (a Stateful that loaded them clears them); options.rank: this rank.
  RestoreOptions options;
  std::vector<std::function<void()>> after;  // once everything fits and is restored
};

class Stateful {
 public:
  virtual ~Stateful() = default;

  // How messages name it: "DistributedDataParallel", "a ZeroRedundancyOptimizer".
  virtual std::string stateName() const = 0;

  // ---- its role in the run
  // The model it trains (its parameters are the run's), or null (an optimizer).
  virtual torch::nn::Module* trackedModule() { return nullptr; }
  // Whether it stands for the run's optimizer (a sharded one: its state is in the rank shards).
  virtual bool tracksOptimizer() const { return false; }

  // ---- rank 0's snapshot
  // Entries of its own in the snapshot's USER_STATE (a layout, a marker that the state is in the
  // shards), written at every save and into a state sent to a replacement in place.
  virtual void saveEntries(ItemDict& userState) const { (void)userState; }
  // The USER_STATE names saveEntries() writes: a snapshot carrying one that no tracked object
  // claims was saved by another kind of run.
  virtual std::vector<std::string> entryNames() const { return {}; }
  // Judges its entries of a file's USER_STATE while the snapshot is chosen: throws SnapshotCorrupt
  // naming the file when one is malformed (it is set aside like a damaged file).
  virtual void checkEntries(const Snapshot& snapshot) const { (void)snapshot; }

  // ---- this rank's shard
  // Whether every rank writes its own shard of the state beside each snapshot
  // ("<file>.shards/rank<r>.pt", docs/snapshot.md).
  virtual bool sharded() const { return false; }
  // Whether its model's parameters (and the state of the optimizer tracked beside it) are in the
  // shards rather than in the snapshot's MODEL_STATE and OPTIMIZER_STATE.
  virtual bool modelInShards() const { return false; }
  // This rank's shard as loadState() takes it among the ranks' shards (what shard copies keep on the
  // next rank; required of a sharded object), and the same as the content of this rank's shard file
  // (by default: shardState()'s entries in the file's USER_STATE, which come back as they were).
  virtual ItemDict shardState(torch::optim::Optimizer* optimizer) const;
  virtual Snapshot shardFile(const ShardContext& context) const;

  // ---- loading back
  // At resume, before any state is restored: the USER_STATE of the snapshot the run continues from
  // (null: it starts afresh).
  virtual void prepareLoad(const ItemDict* userState) { (void)userState; }
  // Its part of `snapshot` (its shards among `shards`, every rank's as saved, in rank order),
  // resharded when the world size changed where it can; throws SnapshotIncompatible, before
  // changing anything, naming what does not fit. Says in `load` what the rest must not restore.
  virtual void loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) {
    (void)snapshot, (void)shards, (void)load;
  }

  // ---- the loop
  // After every optimizer step, before a snapshot of it may be taken.
  virtual void stepEnded() {}
  // The tensors the optimizer steps when they are not the module's parameters (a sharded model's
  // shards): in-place recovery reads their versions to tell whether a step's update ran.
  virtual std::vector<at::Tensor> steppedParameters() const { return {}; }

  // ---- in-place recovery (ctorchrun --recovery in-place)
  // Why it cannot follow a re-formed process group, in words that end "...: " would precede; empty
  // when it can. The default: it cannot.
  virtual std::string whyNotInPlace() const;
  // Lets go of the failed group (every reference to it), then joins the re-formed one with the
  // entries (saveEntries()) of the state the run continues from: a state received from another
  // rank, the snapshot reloaded, or its own as saved before it left; null: as a freshly made one.
  virtual void leaveGroup() {}
  virtual void joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) {
    (void)group, (void)userState;
  }
};

// A sharded optimizer (ZeroRedundancyOptimizer, ParameterServer): the run's optimizer, each rank's
// share of its state in its shard file, in ZeroRedundancyOptimizer's shard layout (global parameter
// indices), restored over another world size; a snapshot saved with a whole optimizer resumes too
// (its state as one shard). What differs is the in-place part.
class ShardedOptimizerState : public Stateful {
 public:
  // This rank's shard of the optimizer state, and the restore of this rank's share from every
  // rank's (ConfigError naming what does not fit).
  virtual ItemDict shardStateDict() const = 0;
  virtual void loadShardStateDicts(const std::vector<ItemDict>& shards) = 0;

  bool tracksOptimizer() const override { return true; }
  bool sharded() const override { return true; }
  ItemDict shardState(torch::optim::Optimizer* optimizer) const override;
  Snapshot shardFile(const ShardContext& context) const override;
  void loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) override;
};

} // namespace ctorch
