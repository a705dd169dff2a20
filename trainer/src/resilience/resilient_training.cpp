// ResilientTraining: the run's position and its lifecycle, the three moments a loop gives it
// (resume, step done, epoch done) and recover(). Its parts have their own rooms: what is tracked and
// its one capture and restore (tracked_state.cpp; the track() calls in tracking.cpp), the agreements between ranks (rank_agreement.cpp),
// rank 0's writes and their failures (snapshot_saver.cpp), in-place recovery (in_place_recovery.cpp);
// what to resume from is decided purely (resume_plan.cpp).
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

namespace {

// The seed of one rank's step: a pure function of (seed, rank, step).
std::uint64_t stepSeedFor(std::uint64_t seed, int rank, std::int64_t step) {
  return mixBits(seed, static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step));
}

// A random whole number below 2^52 (exact in the double the agreement carries), at least 1.
double drawRunId() {
  std::random_device device;
  const std::uint64_t bits = (static_cast<std::uint64_t>(device()) << 32) ^ device();
  return static_cast<double>((bits & ((std::uint64_t{1} << 52) - 1)) | 1);
}

std::string runIdText(double id) {
  char text[24];
  std::snprintf(text, sizeof text, "%013llx", static_cast<unsigned long long>(id));
  return text;
}

}  // namespace

void ResilienceOptions::validate() const {
  if (auto problem = snapshotPathProblem(snapshotPath_, "ResilienceOptions::snapshotPath")) throw ConfigError(*problem);
  if (saveEverySteps_ < 0)
    throw ConfigError("ResilienceOptions::saveEverySteps must be >= 0, got " + std::to_string(saveEverySteps_));
  if (saveEveryEpochs_ < 0)
    throw ConfigError("ResilienceOptions::saveEveryEpochs must be >= 0, got " + std::to_string(saveEveryEpochs_));
  if (keepPrevious_ < 0 || keepPrevious_ > 100)
    throw ConfigError("ResilienceOptions::keepPrevious must be between 0 and 100, got " + std::to_string(keepPrevious_));
  if (runName_.empty()) throw ConfigError("ResilienceOptions::runName is empty");
  if (stepsPerEpoch_ && *stepsPerEpoch_ < 0)
    throw ConfigError("ResilienceOptions::stepsPerEpoch must be >= 0, got " + std::to_string(*stepsPerEpoch_));
  if (shardCopies_ < 0 || shardCopies_ > 1)
    throw ConfigError("ResilienceOptions::shardCopies must be 0 or 1, got " + std::to_string(shardCopies_));
}


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

  std::optional<detail::BucketLayout> ddpBuckets() const {
    if (!state.ddp()) return std::nullopt;
    return state.ddp()->bucketAssignment();
  }

  // "1 epoch + 7 steps, global step 23": in the numbers epoch() and stepInEpoch() return.
  std::string label(Kind) const {
    return progressText(epoch, stepInEpoch) + ", global step " + std::to_string(globalStep);
  }

  // Every rank calls it (the generator states are gathered); rank 0 captures a copy and hands it to
  // the writer (SnapshotSaver::write says where).
  using Targets = detail::SnapshotSaver::Targets;
  // `announce`: a "snapshot written" line even for a save within an epoch (a stop's, the final one).
  void save(Kind kind, const SaveExtras& extras, Targets targets, bool announce = false) {
    std::vector<RngState> rankRng;
    if (!o.stepSeed()) rankRng = ranks->gatherRng();
    // Every rank's own numbers (trackPerRank): each in its place, summed with zeros elsewhere.
    std::vector<double> perRank;
    if (state.hasPerRank()) {
      const auto mine = state.perRankValues();
      perRank.assign(mine.size() * static_cast<std::size_t>(world), 0.0);
      std::copy(mine.begin(), mine.end(), perRank.begin() + static_cast<std::ptrdiff_t>(mine.size()) * rank);
      perRank = ranks->allReduce(std::move(perRank), c10d::ReduceOp::SUM, "gathering the ranks' own values");
    }
    if (state.sharded()) {  // every rank writes its own shard (no gather to rank 0)
      Snapshot shard = state.captureRankShard(identity(), progress(), rank);
      shard.header.saveId = saveId();
      saver->writeShard(std::move(shard), kind == Kind::kEpochBoundary, extras, targets, label(kind));
    }
    if (rank == 0) {
      if (!state.model())
        throw ConfigError("ResilientTraining: no model registered (track(ddp) or track(model) before resume())");
      Snapshot s = state.capture(identity(), progress(), kind == Kind::kEpochComplete, ddpBuckets(),
                                 saver->pool(o.reuseCaptureBuffers()));
      s.rankRng = std::move(rankRng);
      s.header.saveId = saveId();
      if (state.hasPerRank()) state.insertPerRank(s.userState, perRank, world);
      saver->write(std::move(s), kind == Kind::kEpochBoundary, extras, targets, label(kind), globalStep,
                   announce || kind == Kind::kEpochBoundary);
    }
    if (targets == Targets::kSlotAndExtras) saver->markSaved(globalStep, kind == Kind::kEpochBoundary);
  }

  bool saved() const { return saver->saved(globalStep, stepInEpoch); }

  // An agreed stop: the snapshot of exactly this point is durable on rank 0 before anyone leaves.
  bool stopHere() {
    if (!saved()) save(currentKind(), {}, Targets::kSlotAndExtras, /*announce=*/true);
    settleWrites("the stop's barrier");
    status = TrainingStatus::kStopped;
    const int signo = ctorch::stopSignal();
    const std::string at = describeProgress(epoch, stepInEpoch, globalStep);
    std::cerr << o.programName() << ": rank " << rank << "/" << world << " stopped after " << at << ": "
              << (signo != 0 ? std::string(strsignal(signo)) + " here" : std::string("a stop signal on another rank"))
              << std::endl;
    say("stopped on request after " + at + "; snapshot " + saver->slot().string() +
        " written; run the same command again to resume (exit code " + std::to_string(contract::kExitPreempted) + ")");
    return true;
  }

  void checkFinished(const char* call) const {
    if (status == TrainingStatus::kFinished)
      throw ConfigError(std::string("ResilientTraining::") + call + "() after finish()");
  }

  // A point every rank agreed on: the next step starts here.
  void agreed() {
    recovery->commit(state);
    seedStep();
    refreshShardCopy();
  }

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
  void refreshShardCopy() {
    if (!copiesOn() || world == 1 || copiedAt == globalStep) return;
    const auto start = std::chrono::steady_clock::now();
    const std::vector<char> mine = torch::pickle_save(c10::IValue(state.rankShard()));
    heldCopyStep = -1;
    heldCopy = at::Tensor();
    heldCopy = ranks->passToNext(mine, copyLimit(), "the shard copies of global step " + std::to_string(globalStep));
    heldCopyStep = globalStep;
    copiedAt = globalStep;
    copySeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // Said once a step has run (an optimizer's state appears with its first step).
    if (globalStep > 0 && !copySizeSaid) {
      copySizeSaid = true;
      say("shard copies: each rank's shard (" + std::to_string((mine.size() + (1 << 19)) >> 20) +
          " MiB on rank 0) is sent to the next rank at every step and kept there for in-place recovery");
    }
  }

  static ItemDict decodeShard(const at::Tensor& bytes, const std::string& what) {
    try {
      const auto* d = reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>());
      const c10::IValue value = torch::pickle_load(std::vector<char>(d, d + bytes.numel()));
      if (!value.isGenericDict()) throw DistributedError(what + " is not a dict");
      ItemDict out = newItemDict();
      for (const auto& item : value.toGenericDict()) {
        if (!item.key().isString()) throw DistributedError(what + " has a key that is not a string");
        out.insert(item.key().toStringRef(), item.value());
      }
      return out;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError(what + " cannot be read: " + detail::messageOf(e));
    }
  }

  // After the group re-formed, in a sharded run with shard copies: every rank (survivors from
  // recover(), replacements from resume()) says where its state stands, and together they either
  // heal (each replacement takes its shard from the next rank's copy, the rest of the state from the
  // lowest survivor; the survivors keep theirs) or, when a lost shard has no copy of the agreed step,
  // all reload the snapshot files. `held`: this rank's global step when its state is exactly the last
  // agreed point, kMovedOn when an update ran since, -1 for a replacement. nullopt: no rank holds
  // any state (every rank is new): the caller resumes from the files as after a restart.
  static constexpr std::int64_t kMovedOn = -2;
  std::optional<ResumePoint> rejoinSharded(std::int64_t held, std::optional<detail::BucketLayout> buckets) {
    const int w = world;
    const int prev = (rank + w - 1) % w;
    std::vector<double> v(2 * static_cast<std::size_t>(w), -3.0);
    v[static_cast<std::size_t>(rank)] = static_cast<double>(held);
    v[static_cast<std::size_t>(w + prev)] = held == -1 ? -1.0 : static_cast<double>(heldCopyStep);
    const auto all = ranks->allReduce(v, c10d::ReduceOp::MAX, "in-place recovery (where each rank's shard stands)");
    std::vector<int> lost;
    std::int64_t at = -1;
    bool anySurvivor = false;
    std::string why;
    for (int i = 0; i < w; ++i) {
      const auto step = static_cast<std::int64_t>(all[static_cast<std::size_t>(i)]);
      if (step == -1) {
        lost.push_back(i);
        continue;
      }
      anySurvivor = true;
      if (step < 0) {
        if (why.empty()) why = "rank " + std::to_string(i) + " had begun a step's update";
      } else if (at < 0) {
        at = step;
      } else if (step != at && why.empty()) {
        why = "the surviving ranks stand at different steps";
      }
    }
    if (!anySurvivor) return std::nullopt;
    if (why.empty())
      for (int f : lost) {
        const int holder = (f + 1) % w;
        if (all[static_cast<std::size_t>(holder)] == -1) {
          why = "rank " + std::to_string(f) + " and rank " + std::to_string(holder) + ", which kept its copy, were both lost";
          break;
        }
        if (static_cast<std::int64_t>(all[static_cast<std::size_t>(w + f)]) != at) {
          why = "rank " + std::to_string(holder) + "'s copy of rank " + std::to_string(f) + "'s shard is not of global step " +
                std::to_string(at) + " (the failure came between a step's update and its copy)";
          break;
        }
      }
    if (!why.empty()) return reloadFromFiles(why, held == -1);

    // Heal: the replicated state from the lowest survivor, each lost shard from its neighbour's copy.
    const auto exchange = recovery->exchangeState(*ranks, held >= 0 ? held : -1, stepInEpoch == 0 && epoch > 0, [&] {
      Snapshot mine = state.capture(identity(), progress(), currentKind() == Kind::kEpochComplete, buckets, nullptr);
      mine.header.saveId = saveId();
      return encodeSnapshot(mine);
    });
    std::optional<ItemDict> myShard;
    std::string healed;
    for (int f : lost) {
      const int holder = (f + 1) % w;
      const std::string during = "in-place recovery (rank " + std::to_string(f) + "'s shard from rank " +
                                 std::to_string(holder) + "'s copy)";
      if (rank == holder) ranks->sendTo(heldCopy, f, during);
      if (rank == f) {
        myShard = decodeShard(ranks->receiveFrom(holder, copyLimit(), during),
                              "rank " + std::to_string(holder) + "'s copy of rank " + std::to_string(f) + "'s shard");
      }
      healed += (healed.empty() ? "rank " : ", rank ") + std::to_string(f) + "'s shard from rank " + std::to_string(holder) +
                "'s copy";
    }
    if (held == -1) {
      if (!exchange || !exchange->received || !myShard)
        throw DistributedError("in-place recovery: rank " + std::to_string(rank) + " received no state to join with");
      const std::string& id = exchange->received->header.saveId;
      if (runId.empty() && id.find('-') != std::string::npos) runId = id.substr(0, id.find('-'));
      buckets = detail::bucketsOf(*exchange->received);
      resumeShards.clear();
      resumeShards[exchange->received->source] = {*myShard};
      restore(*exchange->received, /*rng=*/false);
      resumeShards.clear();
      saver->forgetSaved();  // nothing on disk holds this point
    } else if (state.sampler()) {
      // As on the ranks that restored it: the loop's setEpoch(epoch) keeps this position (a failure
      // inside an agreement left it as the step moved it, not restored).
      state.sampler()->loadState(state.sampler()->state());
    }
    if (state.ddp()) state.ddp()->rejoin(ranks->group(), buckets);
    state.rejoinShardedGroups(ranks->group());
    copiedAt = -1;
    say("in-place recovery: healed " + healed + "; continuing from " +
        describeProgress(epoch, stepInEpoch, globalStep) + " with rank " + std::to_string(exchange ? exchange->donor : 0) +
        "'s state (group generation " + std::to_string(groupGeneration()) + ")");
    agreed();
    return pointFromMemory(held == -1 ? "joined the running group in place of a failed rank, its shard from a copy, at "
                                      : "recovered in place (shards healed from copies) at ");
  }

  // Every rank (survivors and replacements) back to the newest snapshot the files hold, in place.
  ResumePoint reloadFromFiles(const std::string& why, bool replacement) {
    say("in-place recovery: a lost shard cannot come back from memory (" + why + "): every rank reloads the snapshot files");
    // The run's id first: a replacement takes the survivors' (which names this run's own saves).
    const double id = ranks->allReduce({runIdValue()}, c10d::ReduceOp::MAX, "in-place recovery (the run's id)")[0];
    if (replacement || runId.empty()) runId = runIdText(id);
    ResumePoint point;
    std::vector<SkippedSnapshot> unusable;
    resumeShards.clear();
    // The slot's newest (not ResilienceOptions::resumeFrom's file, which started this run).
    std::optional<Snapshot> snap = chooseResumeSource(point, unusable, /*slotOnly=*/true);
    // Without resuming, a file the slot held before this run (another run's) is none of this run's.
    if (snap && !o.resume() && snap->header.saveId.rfind(runId + "-", 0) != 0) snap.reset();
    const double g = snap ? static_cast<double>(snap->globalStep) : -1.0;
    const auto agreedValues = ranks->allReduce({g, -g}, c10d::ReduceOp::MAX, "in-place recovery (reloading the snapshot files)");
    if (agreedValues[0] != -agreedValues[1])
      throw DistributedError("in-place recovery: the ranks found different snapshots to reload (global steps " +
                             std::to_string(-agreedValues[1]) + " to " + std::to_string(agreedValues[0]) +
                             "): every rank must see the same snapshot files");
    if (!snap)
      throw DistributedError("in-place recovery: " + why + ", and no snapshot of this run holds an earlier step to reload");
    if (state.ddp()) state.ddp()->rejoin(ranks->group(), detail::bucketsOf(*snap));
    state.rejoinShardedGroups(ranks->group());
    restore(*snap);
    resumeShards.clear();
    heldCopyStep = -1;
    copiedAt = -1;
    say("in-place recovery: " + point.message);
    agreed();
    point.resumed = true;
    point.file = snap->source;
    point.epoch = epoch;
    point.stepInEpoch = stepInEpoch;
    point.globalStep = globalStep;
    return point;
  }

  // ---- in-place recovery -----------------------------------------------------------------------
  // After the group re-formed: the newest state any rank holds reaches every rank, DDP joins the
  // new group with its bucket layout. False when no rank holds any state (every rank is new): the
  // caller resumes from the snapshot files instead.
  bool joinWithState(std::int64_t heldStep, std::optional<detail::BucketLayout> buckets) {
    const auto exchange = recovery->exchangeState(*ranks, heldStep, stepInEpoch == 0 && epoch > 0, [&] {
      Snapshot mine = state.capture(identity(), progress(), currentKind() == Kind::kEpochComplete, buckets, nullptr);
      mine.header.saveId = saveId();
      return encodeSnapshot(mine);
    });
    if (!exchange) {
      if (state.ddp()) state.ddp()->rejoin(ranks->group(), std::nullopt);
      return false;
    }
    if (exchange->received) {
      // A replacement takes the run's id from the state it receives (its own draw was never agreed).
      const std::string& id = exchange->received->header.saveId;
      if (runId.empty() && id.find('-') != std::string::npos) runId = id.substr(0, id.find('-'));
      buckets = detail::bucketsOf(*exchange->received);
      restore(*exchange->received, /*rng=*/false);
      saver->forgetSaved();  // nothing on disk holds this point
    } else if (state.sampler()) {
      // As on the ranks that restored it: the loop's setEpoch(epoch) keeps this position.
      state.sampler()->loadState(state.sampler()->state());
    }
    if (state.ddp()) state.ddp()->rejoin(ranks->group(), buckets);
    say("in-place recovery: continuing from " + describeProgress(epoch, stepInEpoch, globalStep) + " with rank " +
        std::to_string(exchange->donor) + "'s state (group generation " + std::to_string(groupGeneration()) + ")");
    agreed();
    return true;
  }

  // Where an in-place recovery left this rank (the state came from memory, step for step).
  ResumePoint pointFromMemory(const std::string& what) const {
    ResumePoint point;
    point.resumed = true;
    point.exact = true;
    point.epoch = epoch;
    point.stepInEpoch = stepInEpoch;
    point.globalStep = globalStep;
    point.message = what + describeProgress(epoch, stepInEpoch, globalStep);
    return point;
  }

  // ---- resuming --------------------------------------------------------------------------------
  struct Found {
    std::optional<Snapshot> snapshot;
    std::vector<SkippedSnapshot> skipped;
  };

  Found loadSlot(const std::filesystem::path& path, const LoadNewestOptions& load, bool allowNothingValid) {
    auto search = loadNewestValid(path, load);
    if (!search.skipped.empty()) say("resume: " + search.describeSkipped());
    if (!search.snapshot && !search.skipped.empty() && !allowNothingValid)
      throw ResumeRefused("no usable snapshot in " + path.string() + " (" + search.describeSkipped() +
                          "); remove the files, or start over from scratch");
    return Found{std::move(search.snapshot), std::move(search.skipped)};
  }

  // The snapshot to continue from (every rank reads the files itself); `unusable` gets the slot
  // files that were skipped as damaged.
  std::optional<Snapshot> chooseResumeSource(ResumePoint& point, std::vector<SkippedSnapshot>& unusable, bool slotOnly = false) {
    // (slotOnly: an in-place reload mid-run; without resuming, only this run's own saves count.)
    if (!o.resume() && !slotOnly) {
      point.message = "resuming is off: starting from scratch";
      return std::nullopt;
    }
    LoadNewestOptions load;
    load.expect.modelName = o.runName();  // another model's state never fits: always refused
    if (!o.allowConfigChange()) {
      load.expect.config = o.config();
      load.expect.stepsPerEpoch = o.stepsPerEpoch();
      load.expect.stepsPerEpochWorldSize = world;
    }
    // Every field read back is judged here, where the file is chosen: a wrong one sets the file aside
    // like a damaged one and the next resumes. A sharded optimizer's snapshot is usable only with
    // every rank's shard of its step: one whose shards are not all there (a crash between the ranks'
    // writes) is skipped like a damaged one.
    load.accept = [this, expect = load.expect](const Snapshot& candidate) {
      state.checkFields(candidate);
      if (state.sharded() && candidate.userState.contains(detail::kZeroShardsKey)) {
        auto shards = detail::findShards(candidate, {saver->slot(), saver->boundarySlot(), candidate.source}, expect);
        detail::checkFullyShardedPieces(candidate, shards);  // pieces that cannot be: set aside like damage
        resumeShards[candidate.source] = std::move(shards);
      }
    };
    Found newest;
    if (o.resumeFrom() && !slotOnly) {
      newest.snapshot = loadSnapshot(*o.resumeFrom(), load.expect);
      if (load.accept) load.accept(*newest.snapshot);
    } else {
      newest = loadSlot(saver->slot(), load, /*allowNothingValid=*/false);
    }
    unusable = newest.skipped;

    std::optional<SnapshotPoint> newestPoint, boundaryPoint;
    if (newest.snapshot) newestPoint = detail::pointOf(*newest.snapshot);
    Found boundary;
    if (needsEpochBoundary(newestPoint, world)) {
      boundary = loadSlot(saver->boundarySlot(), load, /*allowNothingValid=*/true);
      unusable.insert(unusable.end(), boundary.skipped.begin(), boundary.skipped.end());
      if (boundary.snapshot) boundaryPoint = detail::pointOf(*boundary.snapshot);
    }
    const ResumePlan plan = planResume(newestPoint, boundaryPoint, world, saver->boundarySlot());
    point.message = plan.message;
    point.exact = plan.exact;
    switch (plan.source) {
      case ResumeSource::kNone: return std::nullopt;
      case ResumeSource::kNewest: return std::move(newest.snapshot);
      case ResumeSource::kBoundary: return std::move(boundary.snapshot);
    }
    return std::nullopt;
  }

  // `rng`: the generator states too (from a file; a state sent in place carries the sender's only,
  // and each rank keeps its own).
  // The shards found for each candidate snapshot while choosing (a ZeroRedundancyOptimizer's run).
  std::map<std::filesystem::path, std::vector<ItemDict>> resumeShards;

  void restore(const Snapshot& snap, bool rng = true) {
    RestoreOptions options;
    options.rng = rng && !o.stepSeed();
    options.rank = rank;
    const auto shards = resumeShards.find(snap.source);
    const SnapshotPoint p =
        state.restore(snap, options, shards == resumeShards.end() ? std::vector<ItemDict>{} : shards->second);
    state.restorePerRank(snap, rank, world);
    epoch = p.epochsRun;
    stepInEpoch = p.stepInEpoch;
    globalStep = p.globalStep;
    // What this process would save now is what the file holds.
    saver->markSaved(globalStep, stepInEpoch == 0);
  }

  // Tells ctorchrun whether this loop can recover in place, once it is about to run its steps: until
  // every rank has, a failure restarts the group (a failure during start-up is no loop's to repair).
  void declareInPlace() const {
    if (!inPlaceRecoveryEnabled()) return;
    if (o.processGroup())
      declareInPlaceRecovery(false, "its ResilientTraining runs on a process group of its own");
    else if (!o.inPlaceRecovery())
      declareInPlaceRecovery(false, "ResilienceOptions::inPlaceRecovery is off in its loop");
    else if (state.sharded() && o.shardCopies() == 0)
      declareInPlaceRecovery(false, "its training state is sharded (ZeRO, FSDP, a parameter server or pipeline stages) without shard "
                                    "copies (ResilienceOptions::shardCopies, ctorch-train --shard-copies 1): a lost "
                                    "rank's shard comes back from the snapshot files with a group restart");
    else if (state.sharded() && !state.whyNoShardCopies().empty())
      declareInPlaceRecovery(false, state.whyNoShardCopies());
    else
      declareInPlaceRecovery(true);
  }
};

ResilientTraining::ResilientTraining(ResilienceOptions options) : impl_(std::make_unique<Impl>()) {
  options.validate();
  Impl& s = *impl_;
  s.o = std::move(options);
  auto group = s.o.processGroup() ? s.o.processGroup() : getDefaultGroup();
  const bool nccl = s.o.processGroup() ? group->getBackendName() == "nccl" : getBackendName() == "nccl";
  s.rank = group->getRank();
  s.world = group->getSize();
  s.ranks = std::make_unique<detail::RankAgreement>(std::move(group), nccl);
  detail::SnapshotSaver::Options saving;
  saving.slot = s.o.snapshotPath();
  saving.rank = s.rank;
  saving.keepPrevious = s.o.keepPrevious();
  saving.backgroundWrite = s.o.backgroundWrite();
  saving.logEverySave = s.o.logEverySave();
  saving.programName = s.o.programName();
  saving.say = [impl = impl_.get()](const std::string& line) { impl->say(line); };
  s.saver = std::make_unique<detail::SnapshotSaver>(std::move(saving));
  s.recovery = std::make_unique<detail::InPlaceRecovery>(s.o.inPlaceRecovery() && !s.o.processGroup() &&
                                                        inPlaceRecoveryEnabled());
  if (s.o.handleSignals()) installStopHandlers();
}

ResilientTraining::~ResilientTraining() = default;

detail::TrackedState& ResilientTraining::tracked() { return impl_->state; }

ResumePoint ResilientTraining::resume() {
  Impl& s = *impl_;
  if (s.resumed) throw ConfigError("ResilientTraining::resume() called twice");
  if (!s.state.model()) throw ConfigError("ResilientTraining: register the model (track(ddp) or track(model)) before resume()");
  s.resumed = true;
  ResumePoint point;
  if (detail::joiningInPlace()) {
    // A replacement: the survivors send the state they hold (no snapshot is read). A new rank 0
    // takes the slot's lock over from the one it replaces (gone, so the lock is free).
    std::string holder;
    if (s.rank == 0 && !s.saver->lockSlot(holder))
      std::cerr << s.o.programName() << ": warning: snapshot slot " << s.saver->slot().string() << " is locked by " << holder
                << std::endl;
    if (s.state.sharded()) {
      // Shard copies (else this rank would not have been started in place): its shard from its
      // neighbour's copy, or every rank back to the files.
      const std::optional<ResumePoint> joined = s.rejoinSharded(-1, std::nullopt);
      detail::joinedInPlace();
      if (joined) {
        s.declareInPlace();
        return *joined;
      }
    } else {
      const bool joined = s.joinWithState(-1, std::nullopt);
      detail::joinedInPlace();
      if (joined) {
        s.declareInPlace();
        return s.pointFromMemory("joined the running group in place of a failed rank at ");
      }
    }
  }
  // One job per slot: rank 0 locks it before reading it; a slot in use is refused on every rank
  // (agreed below) before anything is read, rotated or set aside.
  std::string holder;
  const bool slotBusy = s.rank == 0 && !s.saver->lockSlot(holder);
  if (s.ranks->allReduce({slotBusy ? 1.0 : 0.0}, c10d::ReduceOp::MAX, "resume (the slot's lock)")[0] > 0)
    s.saver->refuseBusySlot(holder);
  std::vector<SkippedSnapshot> unusable;
  const std::optional<Snapshot> snap = s.chooseResumeSource(point, unusable);
  // DDP first: the bucket layout the snapshot's run reduced with (and gradients defined, for
  // gradientAsBucketView) before any forward of this process.
  if (s.state.ddp()) s.state.ddp()->resetReducer(snap ? detail::bucketsOf(*snap) : std::nullopt);
  if (snap) {
    try {
      s.restore(*snap);
    } catch (const SnapshotIncompatible& e) {
      // Said before anything claims to resume: the model (or another tracked object) no longer
      // fits the snapshot, and what the loop can do about it.
      throw SnapshotIncompatible(e.file(), e.differences(),
                                 "to go on: ResilienceOptions::resume(false) starts over (the next save replaces "
                                 "the slot), resumeFrom(<file>) continues from another snapshot, or another "
                                 "snapshotPath keeps this one");
    }
    point.resumed = true;
    point.file = snap->source;
  }
  // Only now that the state is restored: "resuming ... exactly where it stopped" is true.
  s.say("resume: " + point.message);
  point.epoch = s.epoch;
  point.stepInEpoch = s.stepInEpoch;
  point.globalStep = s.globalStep;

  // Every rank read the files itself: all must stand at the same step. A stop requested while
  // starting up is agreed here too.
  // This launch's id is agreed in the same allreduce: the largest of the ranks' draws.
  const double g = static_cast<double>(s.globalStep);
  const auto agreed = s.ranks->allReduce({g, -g, s.stopFlag(), drawRunId()}, c10d::ReduceOp::MAX, "resume");
  s.runId = runIdText(agreed[3]);
  if (agreed[0] != -agreed[1])
    throw DistributedError("ranks resumed from different points (global steps " + std::to_string(-agreed[1]) + " to " +
                           std::to_string(agreed[0]) + "): every rank must see the same snapshot files (a shared file system)");
  if (agreed[2] > 0) {
    s.stop = true;
    s.status = TrainingStatus::kStopped;
    s.say("stopped on request before the first step; nothing new to save; run the same command again to start (exit code " +
          std::to_string(contract::kExitPreempted) + ")");
  }
  // Damaged files are set aside now that every rank has read the slot: left in place, the next save
  // would rotate one into the place of a good fallback.
  if (s.rank == 0)
    for (const auto& line : setAsideSkipped(unusable)) s.say("resume: " + line);
  s.agreed();
  s.declareInPlace();
  return point;
}

bool ResilientTraining::stepDone() {
  std::vector<double> none;
  // One rank has nobody to agree with: its own stop flag is read at once.
  return impl_->o.overlapAgreement() && impl_->world > 1 ? finishStep(StopAgreement::kOverlapped, nullptr)
                                                         : finishStep(StopAgreement::kNow, &none);
}

bool ResilientTraining::stepDone(std::vector<double>& sums) { return finishStep(StopAgreement::kNow, &sums); }

bool ResilientTraining::finishStep(StopAgreement agreement, std::vector<double>* sums) {
  if (agreement == StopAgreement::kNow && !sums) throw std::logic_error("finishStep: an agreement now needs sums");
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before the first step");
  s.checkFinished("stepDone");
  if (s.stop) return true;  // stopped at start-up (or the loop went on after a stop): nothing new is saved
  // A bucket regrouping due after this process's first step happens now rather than in the next
  // forward, so that a snapshot of this step records the layout the next step uses.
  if (s.state.ddp()) s.state.ddp()->rebuildBuckets();
  ++s.stepInEpoch;
  ++s.globalStep;
  s.recovery->enter(detail::InPlaceRecovery::Phase::kStepAgreement);
  // Shard copies first: the sooner each rank's updated shard is on its neighbour, the shorter the
  // time in which a loss finds no copy of the step the survivors hold.
  s.refreshShardCopy();
  // The previous step's agreement, when it was left running (long finished by now, unless a rank
  // is slower): a stop asked before that step ends the run at this one.
  Impl::Vote vote = s.finishAgreement();
  if (agreement == StopAgreement::kNow) {
    std::vector<double> values{s.stopFlag(), s.saver->writeFlag()};
    values.insert(values.end(), sums->begin(), sums->end());
    values = s.ranks->allReduce(std::move(values), c10d::ReduceOp::SUM, "step " + std::to_string(s.globalStep));
    std::copy(values.begin() + 2, values.end(), sums->begin());
    vote.stop = vote.stop || values[0] > 0;
    vote.writeFailed = vote.writeFailed || values[1] > 0;
  }
  // A failed snapshot write stops every rank here: no training on without snapshots.
  if (vote.writeFailed) s.saver->throwWriteFailed(s.globalStep);
  const bool stopAgreed = vote.stop;
  if (stopAgreed) {
    s.stop = true;
    return s.stopHere();
  }
  if (agreement == StopAgreement::kOverlapped) s.startAgreement();
  const bool epochEnds = s.state.sampler() && s.state.sampler()->exhausted();  // epochDone() saves that one
  if (s.o.saveEverySteps() > 0 && s.globalStep % s.o.saveEverySteps() == 0 && !epochEnds)
    s.save(Impl::Kind::kMidEpoch, {}, Impl::Targets::kSlotAndExtras);
  s.agreed();
  return false;
}

bool ResilientTraining::epochDone(const SaveExtras& extras) {
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before the first step");
  s.checkFinished("epochDone");
  if (s.stop) return true;
  ++s.epoch;
  s.stepInEpoch = 0;
  s.recovery->enter(detail::InPlaceRecovery::Phase::kEpochAgreement);
  const Impl::Vote vote = s.finishAgreement();  // the epoch's last step's, when left running
  const bool due = extras.force || s.o.saveEverySteps() > 0 ||
                   (s.o.saveEveryEpochs() > 0 && s.epoch % s.o.saveEveryEpochs() == 0);
  if (due) s.save(Impl::Kind::kEpochBoundary, extras, Impl::Targets::kSlotAndExtras);
  else if (!extras.alsoWriteTo.empty()) s.save(Impl::Kind::kEpochBoundary, extras, Impl::Targets::kExtrasOnly);
  // A stop requested during the evaluation (or the last step's agreement) ends the run here; a
  // failed snapshot write stops every rank with WriteFailed.
  const auto agreed = s.ranks->allReduce({s.stopFlag(), s.saver->writeFlag()}, c10d::ReduceOp::SUM,
                                         "end of epoch " + std::to_string(s.epoch));
  if (agreed[1] > 0 || vote.writeFailed) s.saver->throwWriteFailed(s.globalStep);
  if (agreed[0] > 0 || vote.stop) {
    s.stop = true;
    return s.stopHere();
  }
  s.agreed();
  return false;
}

ResumePoint ResilientTraining::recover() {
  Impl& s = *impl_;
  const std::exception_ptr failure = std::current_exception();
  if (!failure) throw ConfigError("ResilientTraining::recover() must be called while handling the exception of a failed step");
  if (!s.recovery->enabled() || (s.state.sharded() && !s.copiesOn()) || !s.resumed || s.status != TrainingStatus::kRunning ||
      s.stop)
    std::rethrow_exception(failure);
  std::string cause;
  bool communication = false;
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    // Gloo's and the Reducer's own errors reach the loop through autograd as c10::Error.
    communication = isLostPeer(e);
    cause = detail::messageOf(e);
  } catch (...) {
  }
  if (!communication) std::rethrow_exception(failure);
  // Bounded: recoveries that never get a step further (every rank alive, the same failure again)
  // end in place; the failure goes to the loop, and the launcher's restarts take it from there.
  constexpr int kMaxRecoveriesPerStep = 5;
  s.recoveriesAtStep = s.globalStep == s.lastRecoveryStep ? s.recoveriesAtStep + 1 : 1;
  s.lastRecoveryStep = s.globalStep;
  if (s.recoveriesAtStep > kMaxRecoveriesPerStep)
    throw DistributedError("rank " + std::to_string(s.rank) + ": " + std::to_string(kMaxRecoveriesPerStep) +
                           " in-place recoveries at global step " + std::to_string(s.globalStep) +
                           " without a step completing; giving up in place after: " + cause);
  std::cerr << s.o.programName() << ": rank " << s.rank << "/" << s.world << ": in-place recovery after: " << cause
            << std::endl;
  // A sharded run heals only where the survivors' state is exactly its counters' step (the copies
  // are of a step): at the last agreement, or inside one (the step's update ran and is counted).
  const bool atCountedStep = s.recovery->atCommit(s.state) || s.recovery->inAgreement();
  if (s.recovery->settleAfterFailure(s.state)) {  // the step in progress counts: its update ran
    ++s.stepInEpoch;
    ++s.globalStep;
  }
  s.ranks->dropPending();  // an agreement left running on the failed group ends with it (a stop signal is asked again)
  // Every reference to the failed group goes, so that its connections close now (peers still waiting
  // on this rank fail at once and come to re-form too).
  const std::optional<detail::BucketLayout> buckets = s.ddpBuckets();
  if (s.state.ddp()) s.state.ddp()->releaseGroup();
  if (s.state.sharded()) s.state.releaseShardedGroups();
  s.ranks->replaceGroup({});
  s.ranks->replaceGroup(reformProcessGroup());
  if (s.state.sharded()) {
    const std::optional<ResumePoint> point = s.rejoinSharded(atCountedStep ? s.globalStep : Impl::kMovedOn, buckets);
    if (point) return *point;
    throw DistributedError("in-place recovery: no rank holds any state");  // unreachable: this rank does
  }
  s.joinWithState(s.globalStep, buckets);
  return s.pointFromMemory("recovered in place at ");
}

// A sharded run's state is spread over the ranks: a lost rank's shard comes back from a neighbour's
// copy (ResilienceOptions::shardCopies), or else from the snapshot files with a group restart.
bool ResilientTraining::canRecoverInPlace() const {
  return impl_->recovery->enabled() && (!impl_->state.sharded() || impl_->copiesOn());
}

void ResilientTraining::save(const SaveExtras& extras) {
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before save()");
  s.checkFinished("save");
  if (s.stop) throw ConfigError("ResilientTraining::save() after the run stopped on request: return exitCode() from the loop");
  s.save(s.currentKind(), extras, Impl::Targets::kSlotAndExtras, /*announce=*/true);
}

void ResilientTraining::wait() { impl_->saver->wait(); }

int ResilientTraining::finish() {
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before finish()");
  s.checkFinished("finish");
  if (s.stop) return s.saver->wait(), contract::kExitPreempted;  // stopped at start-up: nothing to save
  // The last step's agreement, when left running: the training is complete, so a stop asked during
  // that step changes nothing (the final state is saved and the run ends with 0).
  s.finishAgreement();
  const bool scheduled = s.o.saveEverySteps() > 0 || s.o.saveEveryEpochs() > 0;
  if (scheduled && !s.saved()) s.save(s.currentKind(), {}, Impl::Targets::kSlotAndExtras, /*announce=*/true);
  s.settleWrites("the final barrier");  // nobody exits before rank 0's snapshot is durable (or failed)
  s.status = TrainingStatus::kFinished;
  return contract::kExitSuccess;
}

std::int64_t ResilientTraining::epoch() const { return impl_->epoch; }
std::int64_t ResilientTraining::stepInEpoch() const { return impl_->stepInEpoch; }
std::int64_t ResilientTraining::globalStep() const { return impl_->globalStep; }
bool ResilientTraining::stopRequested() const { return impl_->stop; }
int ResilientTraining::stopSignal() const { return ctorch::stopSignal(); }
TrainingStatus ResilientTraining::status() const { return impl_->status; }
int ResilientTraining::exitCode() const {
  return impl_->stop ? contract::kExitPreempted : contract::kExitSuccess;
}
const ResilienceOptions& ResilientTraining::options() const { return impl_->o; }

} // namespace ctorch
