// ResilientTraining's state (ResilientTraining::Impl), shared by the files that each hold one of its
// concerns: the calls a loop makes and the lifecycle (resilient_training.cpp), rank 0's saves and
// the stop agreement's outcome (saving.cpp), what a resume starts from (resume_source.cpp), and the
// state after an in-place recovery: shard copies, joining with a peer's state, reloading the files
// (rejoin.cpp). Internal.
#pragma once

#include "ctorch/resilience.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/mix_bits.hpp"
#include "core/exception_text.hpp"
#include "resilience/in_place_recovery.hpp"
#include "resilience/rank_agreement.hpp"
#include "resilience/snapshot_saver.hpp"
#include "resilience/tracked_state.hpp"
#include "resilience/shard_files.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/optimizer.h>
#include <torch/utils.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <random>

namespace ctorch {

namespace resilience_parts {

// The seed of one rank's step: a pure function of (seed, rank, step).
inline std::uint64_t stepSeedFor(std::uint64_t seed, int rank, std::int64_t step) {
  return mixBits(seed, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step));
}

// A random whole number below 2^52 (exact in the double the agreement carries), at least 1.
inline double drawRunId() {
  std::random_device device;
  const std::uint64_t bits = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  return static_cast<double>((bits & ((std::uint64_t{1} << 52) - 1)) | 1);
}

inline std::string runIdText(double id) {
  char text[24];
  std::snprintf(text, sizeof text, "%013llx", static_cast<unsigned long long>(id));
  return text;
}

} // namespace resilience_parts
using namespace resilience_parts;

struct ResilientTraining::Impl {
  ResilienceOptions o;
  detail::TrackedState state;
  std::unique_ptr<detail::RankAgreement> ranks;
  std::unique_ptr<detail::SnapshotSaver> saver;
  std::unique_ptr<detail::InPlaceRecovery> recovery;
  int rank = 0;
  int world = 1;

  std::int64_t epoch = 0, stepInEpoch = 0, globalStep = 0;
  // This launch's id, agreed by the ranks in resume(): with the global step, the id of each save
  // (SnapshotHeader::saveId), which a snapshot and its shards carry.
  std::string runId;
  // runId as the number it was drawn as (0: none yet; a replacement takes the text from the state it receives).
  double runIdValue() const {
    if (runId.empty()) return 0;
    try {
      return static_cast<double>(std::stoull(runId, nullptr, 16));
    } catch (const std::exception&) {
      return 0;
    }
  }
  bool resumed = false;
  // recover(): the global step of the last recovery and how many in a row came there.
  std::int64_t lastRecoveryStep = -1;
  int recoveriesAtStep = 0;
  bool stop = false;
  TrainingStatus status = TrainingStatus::kRunning;

  void say(const std::string& line) const {
    if (rank != 0) return;
    if (o.log()) o.log()(line);
    else std::cerr << (o.programName() + ": " + line + "\n") << std::flush;  // one write: whole, beside other threads' output
  }

  TrainingProgress progress() const { return TrainingProgress{epoch, stepInEpoch, globalStep}; }
  std::string saveId() const { return runId.empty() ? std::string() : runId + "-" + std::to_string(globalStep); }
  SnapshotIdentity identity() const { return SnapshotIdentity{o.runName(), world, o.config()}; }

  // 1.0 when this process was asked to stop: summed over the ranks, whether any was.
  static double stopFlag() { return ctorch::stopSignal() != 0 ? 1.0 : 0.0; }

  // At a point where every rank waits for rank 0's snapshot (a stop, the end): the write finishes,
  // and its success or failure is agreed instead of a plain barrier.
  void settleWrites(const std::string& during) {
    saver->collectWriteError();
    if (ranks->allReduce({saver->writeFlag()}, c10d::ReduceOp::SUM, during)[0] > 0)
      saver->throwWriteFailed(globalStep);
  }

  // What the ranks agreed: some rank asked to stop; rank 0's snapshot write failed.
  struct Vote {
    bool stop = false;
    bool writeFailed = false;
  };

  // Starts this step's stop agreement without waiting for it (overlapAgreement).
  void startAgreement() {
    ranks->startPending({stopFlag(), saver->writeFlag()}, c10d::ReduceOp::SUM,
                        "step " + std::to_string(globalStep) + "'s agreement");
  }

  // Waits for the agreement startAgreement() left running.
  Vote finishAgreement() {
    const auto v = ranks->finishPending();
    if (!v) return {};
    return {(*v)[0] > 0, (*v)[1] > 0};
  }

  void seedStep() const {
    if (o.stepSeed()) torch::manual_seed(stepSeedFor(*o.stepSeed(), rank, globalStep));
  }

  // ---- saving ----------------------------------------------------------------------------------
  enum class Kind { kMidEpoch, kEpochComplete, kEpochBoundary };

  Kind currentKind() const {
    if (stepInEpoch == 0) return Kind::kEpochBoundary;
    return state.sampler() && state.sampler()->exhausted() ? Kind::kEpochComplete : Kind::kMidEpoch;
  }


  // "1 epoch + 7 steps, global step 23": in the numbers epoch() and stepInEpoch() return.
  std::string label(Kind) const {
    return progressText(epoch, stepInEpoch) + ", global step " + std::to_string(globalStep);
  }

  // Every rank calls it (the generator states are gathered); rank 0 captures a copy and hands it to
  // the writer (SnapshotSaver::write says where).
  using Targets = detail::SnapshotSaver::Targets;
  // `announce`: a "snapshot written" line even for a save within an epoch (a stop's, the final one).
  void save(Kind kind, const SaveExtras& extras, Targets targets, bool announce = false);

  bool saved() const { return saver->saved(globalStep, stepInEpoch); }

  // An agreed stop: the snapshot of exactly this point is durable on rank 0 before anyone leaves.
  bool stopHere();

  void checkFinished(const char* call) const {
    if (status == TrainingStatus::kFinished)
      throw ConfigError(std::string("ResilientTraining::") + call + "() after finish()");
  }

  // A point every rank agreed on: the next step starts here.
  void agreed();

  // ---- shard copies (ResilienceOptions::shardCopies) ------------------------------------------
  // The copy of the previous rank's shard this rank keeps (its pickled rankShard()), the global step
  // it is of (-1: none complete), and the step of this rank's last refresh (-1: due).
  at::Tensor heldCopy;
  std::int64_t heldCopyStep = -1;
  std::int64_t copiedAt = -1;
  double copySeconds = 0;  // time spent refreshing
  bool copySizeSaid = false;

  bool copiesOn() const {
    return o.shardCopies() > 0 && state.sharded() && recovery->enabled() && state.whyNoShardCopies().empty();
  }
  // The most bytes a neighbour's copy may take: no shard holds more than the whole model's
  // parameters with three tensors of state each (Adam's moments and more), whatever the partition
  // (ZeRO's may be uneven: whole parameters, never split), plus room for the dicts around them.
  std::int64_t copyLimit() const {
    std::int64_t bytes = 0;
    if (state.model())
      // (float32 at least: a mixed-precision model's parameters are gathered narrower than its shards)
      for (const auto& p : state.model()->parameters())
        bytes += p.numel() * std::max<std::int64_t>(4, static_cast<std::int64_t>(p.element_size()));
    return 4 * bytes + (std::int64_t{64} << 20);
  }

  // At every agreed point: each rank's shard to the next rank (a ring), the previous rank's kept.
  // A failure here leaves the copy incomplete (heldCopyStep -1): that shard heals from the files.
  void refreshShardCopy();

  static ItemDict decodeShard(const at::Tensor& bytes, const std::string& what);

  // After the group re-formed, in a sharded run with shard copies: every rank (survivors from
  // recover(), replacements from resume()) says where its state stands, and together they either
  // heal (each replacement takes its shard from the next rank's copy, the rest of the state from the
  // lowest survivor; the survivors keep theirs) or, when a lost shard has no copy of the agreed step,
  // all reload the snapshot files. `held`: this rank's global step when its state is exactly the last
  // agreed point, kMovedOn when an update ran since, -1 for a replacement. nullopt: no rank holds
  // any state (every rank is new): the caller resumes from the files as after a restart.
  static constexpr std::int64_t kMovedOn = -2;
  std::optional<ResumePoint> rejoinSharded(std::int64_t held, const ItemDict* entries);

  // Every rank (survivors and replacements) back to the newest snapshot the files hold, in place.
  ResumePoint reloadFromFiles(const std::string& why, bool replacement);

  // ---- in-place recovery -----------------------------------------------------------------------
  // After the group re-formed: the newest state any rank holds reaches every rank, DDP joins the
  // new group with its bucket layout. False when no rank holds any state (every rank is new): the
  // caller resumes from the snapshot files instead.
  bool joinWithState(std::int64_t heldStep, const ItemDict* entries);

  // Where an in-place recovery left this rank (the state came from memory, step for step).
  ResumePoint pointFromMemory(const std::string& what) const;

  // ---- resuming --------------------------------------------------------------------------------
  struct Found {
    std::optional<Snapshot> snapshot;
    std::vector<SkippedSnapshot> skipped;
  };

  Found loadSlot(const std::filesystem::path& path, const LoadNewestOptions& load, bool allowNothingValid);

  // The snapshot to continue from (every rank reads the files itself); `unusable` gets the slot
  // files that were skipped as damaged.
  std::optional<Snapshot> chooseResumeSource(ResumePoint& point, std::vector<SkippedSnapshot>& unusable, bool slotOnly = false);

  // `rng`: the generator states too (from a file; a state sent in place carries the sender's only,
  // and each rank keeps its own).
  // The shards found for each candidate snapshot while choosing (a ZeroRedundancyOptimizer's run).
  std::map<std::filesystem::path, std::vector<ItemDict>> resumeShards;

  void restore(const Snapshot& snap, bool rng = true);

  // Tells ctorchrun whether this loop can recover in place, once it is about to run its steps: until
  // every rank has, a failure restarts the group (a failure during start-up is no loop's to repair).
  void declareInPlace() const;
};

} // namespace ctorch
