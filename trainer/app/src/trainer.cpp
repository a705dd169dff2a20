// The training loop of ctorch-train: a Trainer is set up (process group, data, model, DDP, optimizer,
// sampler, ctorch::ResilientTraining: trainer_setup.cpp), then runs its epochs and finishes (this
// file: the run top to bottom, an epoch's steps and their agreement, the epoch's end, a stop).
// Snapshots, stop signals and resume are the library's (ctorch/resilience.hpp), as they are for any
// user's loop. The class and its shared types: trainer_impl.hpp.
//
// Determinism (what makes a resumed run bit-identical to an uninterrupted one on CPU, same world
// size): the data order is the DistributedSampler's (seed + epoch) and its position is in the
// snapshot; augmentation is a pure function of (seed, epoch, sample index); the random generator
// is re-seeded before every step from (seed, rank, global step), so dropout needs no saved RNG
// state (ResilienceOptions::stepSeed); the learning rate is a pure function of (epoch, step); optimizer state, parameters and
// buffers come from the snapshot.
#include "trainer_impl.hpp"

#include "ctorch/process_tuning.hpp"

#include "core/compat.hpp"
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/distributed_env.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/stop_signal.hpp>

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <regex>
#include <thread>

namespace ctorch::train {

int RunResult::exitCode() const {
  return status == RunStatus::kPreempted ? contract::kExitPreempted : contract::kExitSuccess;
}

namespace trainer_parts {

namespace {

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

std::vector<std::filesystem::path> checkpointFiles(const std::filesystem::path& dir) {
  static const std::regex pattern(R"(checkpoint_epoch_(\d+)\.pt)");
  std::vector<std::pair<long long, std::filesystem::path>> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, pattern)) found.emplace_back(std::stoll(m[1].str()), entry.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::filesystem::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

// A checkpoint file and, with --sharding, every rank's shard of it.
void removeCheckpoint(const std::filesystem::path& file) { removeSnapshotFiles(file); }

}  // namespace

std::string Trainer::point() const {
  const ResilientTraining& t = *training_;
  return describeProgress(t.epoch(), t.stepInEpoch(), t.globalStep());
}

RunResult Trainer::run() {
  resume();
  RunResult result;
  if (training_->stopRequested()) return stopped(result, false);
  while (training_->epoch() < o_.epochs) {
    if (runEpoch(result)) return result;
    if (endEpoch(result)) return result;
  }
  return finish(result);
}

// Done: the final evaluation and snapshot, the final weights, the closing line (a resumed finished
// run evaluates and writes them again).
RunResult Trainer::finish(RunResult result) {
  for (bool done = false; !done;) {
    try {
      if (!result.lastEval) result.lastEval = evaluate(training_->epoch());
      training_->finish();
      done = true;
    } catch (const std::exception&) {
      if (!training_->canRecoverInPlace()) throw;
      recoverInPlace();
      result.lastEval.reset();  // a replacement evaluates once more: so does every rank
    }
  }
  // After finish(): the final snapshot is durable and the other ranks are done, so a disk that
  // cannot take model.pt fails rank 0 alone (74), with the snapshot holding the same weights.
  // A sharded model's weights are gathered for it on every rank (collective), rank 0 writes them.
  strategy_->withFullWeights([this] {
    if (ctorch::isMainProcess()) writeFinalWeights();
  });
  result.epochsRun = training_->epoch();
  result.globalStep = training_->globalStep();
  console_.line("done: " + std::to_string(o_.epochs) + " epochs, " + std::to_string(result.globalStep) + " steps, " +
                formatDuration(trainSeconds()) + " of training; final weights " + o_.finalModelPath().string() +
                (result.lastEval->classification ? ", test accuracy " + percent(result.lastEval->accuracy()) : ""));
  return result;
}

void Trainer::writeFinalWeights() {
  try {
    ctorch::saveStateDict(*model_, o_.finalModelPath());
  } catch (const std::system_error& e) {
    throw WriteFailed("cannot write the final weights: " + std::string(e.what()) + "; " +
                      o_.finalModelPath().string() + " keeps what it held before" +
                      (o_.saveEvery > 0 || o_.saveEverySteps > 0 ? ", and " + o_.snapshotPath.string() + " holds the final state" : std::string()));
  }
}

// The steps of the current epoch (from where a resume left it). A step that fails and is recovered
// in place ends the pass: the next one goes on from the agreed point, with a loader that starts there.
bool Trainer::runEpoch(RunResult& result) {
  PassEnd end = PassEnd::kRecovered;
  while (end == PassEnd::kRecovered) end = runEpochPass(result);
  return end == PassEnd::kStopped;
}

PassEnd Trainer::runEpochPass(RunResult& result) {
  ResilientTraining& t = *training_;
  EpochPass pass;
  pass.epoch = t.epoch();
  sampler_->setEpoch(pass.epoch);  // right after a mid-epoch resume: keeps the restored position
  data::LoaderOptions loaderOptions;
  loaderOptions.batchSize = o_.batchSize;
  loaderOptions.epoch = pass.epoch;
  loaderOptions.skipBatches = ceilDiv(sampler_->position(), o_.batchSize);
  loaderOptions.prefetch = o_.prefetch;
  data::BatchLoader loader(data_.trainPipeline, sampler_->indices(), loaderOptions);

  pass.start = Clock::now();
  pass.cpuStart = processCpuSeconds();
  pass.reductionStart = strategy_->reductionStats();
  pass.intervalStart = pass.start;
  pass.firstStep = t.stepInEpoch();
  startEpochTally(pass.firstStep);
  while (!sampler_->exhausted()) {
    const double lr = schedule_->at(epochProgress(pass.epoch, t.stepInEpoch(), stepsPerEpoch_));
    if (torch::optim::Optimizer* optimizer = strategy_->stepping()) setLearningRate(*optimizer, lr);
    if (hooks_.beforeStep) hooks_.beforeStep(t.globalStep());
    profileBefore(t.globalStep() + 1);
    const std::optional<AgreedStep> step = trainAndAgree(loader);
    if (!step) return PassEnd::kRecovered;
    pass.phases += step->outcome.phases;
    pass.intervalSamples += step->outcome.samples * dataRanks_;
    pass.samples += step->outcome.samples * dataRanks_;
    const IntervalLoss loss = countLoss(*step);
    reportStep(pass, *step, loss, lr);
    if (hooks_.afterStep) hooks_.afterStep(t.globalStep());
    profileAfter(t.globalStep(), step->stop);
    if (step->stop) {
      result = stopped(result, false);
      return PassEnd::kStopped;
    }
    if (reachedStepLimit(pass.epoch)) {
      result = stopped(result, true);
      return PassEnd::kStopped;
    }
    holdIfAsked(t.globalStep());
    if (o_.stepDelay.count() > 0) std::this_thread::sleep_for(o_.stepDelay);
  }
  reportEpoch(pass);
  return PassEnd::kEpochDone;
}

// --hold-after-step (a testing aid): every rank waits here, after the step and its snapshot, until
// the test makes --hold-file or stops the run; a resumed run never comes back to this step.
void Trainer::holdIfAsked(std::int64_t doneStep) const {
  if (o_.holdAfterStep <= 0 || doneStep != o_.holdAfterStep) return;
  std::cerr << "ctorch-train: rank " + std::to_string(rank_) + ": holding after global step " + std::to_string(doneStep) +
                   " until " + o_.holdFile.string() + " exists (--hold-after-step)\n"
            << std::flush;
  std::error_code ec;
  while (!std::filesystem::exists(o_.holdFile, ec) && stopSignal() == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// Losses: this rank's own since the last sum; summed over the ranks (in that step's agreement)
// only at the steps that log or save on schedule, so that the others need no meeting of the
// ranks after the step. The totals (tally_) come with a mid-epoch resume.
void Trainer::startEpochTally(std::int64_t firstStep) {
  if (firstStep == 0) {
    tally_ = EpochTally{};
    intervalLocalLoss_ = 0.0;
  } else if (!tallyRestored_) {
    tally_ = EpochTally{};  // a snapshot of an older trainer: the steps before it are unknown
    tally_.lostSteps = firstStep;
    intervalLocalLoss_ = 0.0;
  }
}

// One optimizer step, then the ranks' agreement on it (ResilientTraining::stepDone); its loss is in
// the tally as not summed yet. Nothing when the step failed and the run recovered in place.
std::optional<AgreedStep> Trainer::trainAndAgree(data::BatchLoader& loader) {
  ResilientTraining& t = *training_;
  AgreedStep step;
  // The tally as before this step: what this rank would send if the step fails and is recovered.
  auto undoStep = [this, before = tally_, localBefore = intervalLocalLoss_] {
    summing_ = nullptr;
    tally_ = before;
    intervalLocalLoss_ = localBefore;
  };
  try {
    step.outcome = strategy_->step(StepInputs{loader, *sampler_, *scaler_, *model_, o_, device_, memoryFormat_.format});
    // Whether any rank must stop: agreed in the background (read at the next step) except at the
    // steps that log or save on schedule, where the same small allreduce also sums the losses.
    step.periodic = (t.globalStep() + 1) % o_.logInterval == 0 || sampler_->exhausted();
    const bool saves = o_.saveEverySteps > 0 && (t.globalStep() + 1) % o_.saveEverySteps == 0;
    ++tally_.intervalSteps;
    ++tally_.unsummed;
    intervalLocalLoss_ += step.outcome.loss;
    const auto agreeStart = Clock::now();
    if (step.periodic || saves) {
      step.sums = {intervalLocalLoss_};
      summing_ = &step.sums;
      summingLogs_ = step.periodic;
      step.stop = t.stepDone(step.sums);
      summing_ = nullptr;
    } else {
      step.stop = t.stepDone();
    }
    step.outcome.phases.agreement = secondsSince(agreeStart);
  } catch (const DistributedError& e) {
    undoStep();
    recoverFromFailedStep(e);
    return std::nullopt;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    undoStep();
    recoverFromFailedStep(e);  // a failure that is not a lost peer is rethrown as the step's failure
    return std::nullopt;
  }
  return step;
}

// Folds the step's summed losses (if it has them) into the tally; the interval's loss to report.
IntervalLoss Trainer::countLoss(const AgreedStep& step) {
  IntervalLoss loss;
  loss.steps = tally_.intervalSteps;
  if (!step.sums.empty()) {
    loss.sum = tally_.summed(step.sums[0], dataRanks_, false).intervalLoss;
    tally_ = tally_.summed(step.sums[0], dataRanks_, step.periodic);
    intervalLocalLoss_ = 0.0;
  } else {
    loss.sum = tally_.intervalLoss + intervalLocalLoss_;
  }
  return loss;
}

// --max-steps reached, unless this step ends the run anyway (the last epoch's last step).
bool Trainer::reachedStepLimit(std::int64_t epoch) const {
  return o_.maxSteps > 0 && training_->globalStep() >= o_.maxSteps &&
         !(epoch + 1 == o_.epochs && sampler_->exhausted());
}

// Evaluation, then the epoch-boundary snapshot (and checkpoint file) with its result in it.
bool Trainer::endEpoch(RunResult& result) {
  const std::int64_t completed = training_->epoch() + 1;
  const bool lastEpoch = completed == o_.epochs;
  try {
    return endEpochOnce(result, completed, lastEpoch);
  } catch (const std::exception&) {
    if (!training_->canRecoverInPlace()) throw;
    recoverInPlace();  // rethrows what is not a lost peer
    return false;  // run() goes on from the agreed point: this epoch's end again, or the next epoch
  }
}

bool Trainer::endEpochOnce(RunResult& result, std::int64_t completed, bool lastEpoch) {
  if (lastEpoch || (o_.evalEvery > 0 && completed % o_.evalEvery == 0)) result.lastEval = evaluate(completed);
  SaveExtras extras;
  extras.force = lastEpoch && (o_.saveEvery > 0 || o_.saveEverySteps > 0);
  if (o_.checkpointEvery > 0 && completed % o_.checkpointEvery == 0) {
    if (ctorch::isMainProcess()) std::filesystem::create_directories(o_.outputDir());
    extras.alsoWriteTo.push_back(o_.outputDir() / ("checkpoint_epoch_" + std::to_string(completed) + ".pt"));
    extras.afterWrite = [dir = o_.outputDir(), keep = static_cast<size_t>(o_.keepCheckpoints)] {
      const auto files = checkpointFiles(dir);
      for (size_t i = 0; i + keep < files.size(); ++i) removeCheckpoint(files[i]);
    };
  }
  if (!training_->epochDone(extras)) return false;
  result = stopped(result, false);
  return true;
}

// The run ends early: a stop signal (the library saved this step and every rank agreed) or
// --max-steps (saved here when snapshots are on).
RunResult Trainer::stopped(RunResult result, bool stepLimit) {
  ResilientTraining& t = *training_;
  result.epochsRun = t.epoch();
  result.stepInEpoch = t.stepInEpoch();
  result.globalStep = t.globalStep();
  if (!stepLimit) {
    result.status = RunStatus::kPreempted;
    result.stopSignal = t.stopSignal();
    return result;
  }
  const bool snapshotsOn = o_.saveEvery > 0 || o_.saveEverySteps > 0;
  if (snapshotsOn) t.save();
  t.wait();
  barrier();  // nobody exits before rank 0's snapshot is durable
  result.status = RunStatus::kStepLimit;
  console_.line("reached --max-steps " + std::to_string(o_.maxSteps) + " at " + point() +
                (snapshotsOn ? "; snapshot written: run again with a higher --max-steps to continue" : ""));
  return result;
}

}  // namespace trainer_parts

RunResult runTraining(const TrainOptions& given, const RunHooks& hooks) {
  given.validate();
  TrainOptions o = given;  // --amp-dtype auto is made concrete once the device is known
  // Before the data and the model are loaded: a place the run cannot write fails now, in flag
  // names, not minutes later in a library's words. Rank 0 writes (RANK, before the group exists).
  // A spare (no rank yet) or a bad environment skips it: initProcessGroup says what is wrong.
  int rank = -1;
  try {
    rank = detectDistributedEnv(processEnvironment()).rank;
  } catch (const ConfigError&) {
  }
  if (rank == 0) o.checkOutputs();
  ctorch::tuneAllocator();
  const torch::Device wanted = chooseDevice(o);
  const auto dataStart = trainer_parts::Clock::now();
  TrainData data = loadData(o);
  trainer_parts::Trainer trainer(o, hooks, wanted, std::move(data), trainer_parts::secondsSince(dataStart));
  return trainer.run();
}

}  // namespace ctorch::train
