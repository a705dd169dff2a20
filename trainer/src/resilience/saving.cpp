// ResilientTraining's saves (resilient_training_impl.hpp): every rank's part of a snapshot, rank 0's
// write, and what the ranks agreed at a step: stop here or go on.
#include "resilience/resilient_training_impl.hpp"

namespace ctorch {

void ResilientTraining::Impl::save(Kind kind, const SaveExtras& extras, Targets targets, bool announce) {
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
    Snapshot s = state.capture(identity(), progress(), kind == Kind::kEpochComplete, nullptr,
                               saver->pool(o.reuseCaptureBuffers()));
    s.rankRng = std::move(rankRng);
    s.header.saveId = saveId();
    if (state.hasPerRank()) state.insertPerRank(s.userState, perRank, world);
    saver->write(std::move(s), kind == Kind::kEpochBoundary, extras, targets, label(kind), globalStep,
                 announce || kind == Kind::kEpochBoundary);
  }
  if (targets == Targets::kSlotAndExtras) saver->markSaved(globalStep, kind == Kind::kEpochBoundary);
}

bool ResilientTraining::Impl::stopHere() {
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

void ResilientTraining::Impl::agreed() {
  recovery->commit(state);
  seedStep();
  refreshShardCopy();
}

} // namespace ctorch
