// ResilientTraining: the run's position and its lifecycle, the three moments a loop gives it
// (resume, step done, epoch done) and recover(). Its own state and the rest of its methods are in
// resilient_training_impl.hpp (saving.cpp, resume_source.cpp, rejoin.cpp). Its parts have their own
// rooms: what is tracked and its one capture and restore (tracked_state.cpp; the track() calls in
// tracking.cpp), the agreements between ranks (rank_agreement.cpp), rank 0's writes and their
// failures (snapshot_saver.cpp), in-place recovery (in_place_recovery.cpp); what to resume from is
// decided purely (resume_plan.cpp).
#include "resilience/resilient_training_impl.hpp"

namespace ctorch {

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
      const std::optional<ResumePoint> joined = s.rejoinSharded(-1, nullptr);
      detail::joinedInPlace();
      if (joined) {
        s.declareInPlace();
        return *joined;
      }
    } else {
      const bool joined = s.joinWithState(-1, nullptr);
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
  // The tracked objects first (a DDP's bucket layout, the one the snapshot's run reduced with),
  // before any forward of this process.
  s.state.prepareLoad(snap ? &snap->userState : nullptr);
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
  // The tracked objects' end of a step (a DDP regroups its buckets now rather than in the next
  // forward, so that a snapshot of this step records the layout the next step uses).
  s.state.stepEnded();
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
  const ItemDict entries = s.state.entries();  // a DDP's bucket layout, ... as they are before it leaves
  s.state.leaveGroups();
  s.ranks->replaceGroup({});
  s.ranks->replaceGroup(reformProcessGroup());
  if (s.state.sharded()) {
    const std::optional<ResumePoint> point = s.rejoinSharded(atCountedStep ? s.globalStep : Impl::kMovedOn, &entries);
    if (point) return *point;
    throw DistributedError("in-place recovery: no rank holds any state");  // unreachable: this rank does
  }
  s.joinWithState(s.globalStep, &entries);
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
