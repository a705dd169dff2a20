// What ResilientTraining resumes from (resilient_training_impl.hpp): the newest valid snapshot of the
// slot (or the epoch-boundary slot), checked against this run; the state restored from it; and what
// the ranks declare about in-place recovery.
#include "resilience/resilient_training_impl.hpp"

namespace ctorch {

ResilientTraining::Impl::Found ResilientTraining::Impl::loadSlot(const std::filesystem::path& path, const LoadNewestOptions& load, bool allowNothingValid) {
  auto search = loadNewestValid(path, load);
  if (!search.skipped.empty()) say("resume: " + search.describeSkipped());
  if (!search.snapshot && !search.skipped.empty() && !allowNothingValid)
    throw ResumeRefused("no usable snapshot in " + path.string() + " (" + search.describeSkipped() +
                        "); remove the files, or start over from scratch");
  return Found{std::move(search.snapshot), std::move(search.skipped)};
}

std::optional<Snapshot> ResilientTraining::Impl::chooseResumeSource(ResumePoint& point, std::vector<SkippedSnapshot>& unusable, bool slotOnly) {
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

void ResilientTraining::Impl::restore(const Snapshot& snap, bool rng) {
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

void ResilientTraining::Impl::declareInPlace() const {
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

} // namespace ctorch
