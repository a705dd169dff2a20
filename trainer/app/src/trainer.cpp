// The training loop of ctorch-train: a Trainer is set up (process group, data, model, DDP, optimizer,
// sampler, ctorch::ResilientTraining), then runs its epochs and finishes. Snapshots, stop signals and
// resume are the library's (ctorch/resilience.hpp), as they are for any user's loop.
//
// Determinism (what makes a resumed run bit-identical to an uninterrupted one on CPU, same world
// size): the data order is the DistributedSampler's (seed + epoch) and its position is in the
// snapshot; augmentation is a pure function of (seed, epoch, sample index); the random generator
// is re-seeded before every step from (seed, rank, global step), so dropout needs no saved RNG
// state (ResilienceOptions::stepSeed); the learning rate is a pure function of (epoch, step); optimizer state, parameters and
// buffers come from the snapshot.
#include "ctorch/train/trainer.hpp"

#include "ctorch/train/memory_check.hpp"
#include "ctorch/process_tuning.hpp"
#include "ctorch/train/report.hpp"
#include "ctorch/train/schedule.hpp"
#include "ctorch/train/setup.hpp"
#include "ctorch/train/strategy.hpp"
#include "ctorch/train/strategy_table.hpp"

#include "core/compat.hpp"
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/data/loader.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/memory_format.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/resilience.hpp>
#include <ctorch/amp.hpp>
#include <ctorch/sampler.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/stop_signal.hpp>

#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <regex>
#include <iomanip>
#include <sstream>
#include <thread>

namespace ctorch::train {

int RunResult::exitCode() const {
  return status == RunStatus::kPreempted ? contract::kExitPreempted : contract::kExitSuccess;
}

namespace {

using Clock = std::chrono::steady_clock;
using Model = models::Model;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// CPU time of this process, all threads (what a step costs, independent of other processes' load).
double processCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

std::string withThousands(std::int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

std::string percent(double fraction) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f%%", 100.0 * fraction);
  return buffer;
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}


// A step that failed in LibTorch or Gloo (a peer died, stopped or went away; a collective timed
// out) becomes one line saying where, with the hang guard's bound. The library's own errors
// (DistributedError from DDP, the agreement or the shared-memory allreduce) keep their type; a line
// that already names the rank (the agreement's) is not prefixed again.
[[noreturn]] void stepFailed(const std::exception& e, int rank, std::int64_t globalStep, std::chrono::seconds timeout) {
  std::string text = errorMessage(e);
  if (const auto cut = text.find('\n'); cut != std::string::npos) text.resize(cut);
  if (text.rfind("rank ", 0) != 0)
    text = "rank " + std::to_string(rank) + ": step " + std::to_string(globalStep + 1) + " failed: " + text;
  // The hang guard's bound belongs to lost or silent peers only, not to a disk or a shape error.
  const auto* ours = dynamic_cast<const DistributedError*>(&e);
  if (!isLostPeer(e)) throw Error(text);
  const std::string message =
      text + " (collectives give up on a silent peer after --timeout " + std::to_string(timeout.count()) + " s)";
  if (ours ? dynamic_cast<const DistributedTimeout*>(&e) != nullptr
           : text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos)
    throw DistributedTimeout(message);
  throw DistributedError(message);
}

// A snapshot of another configuration, or no correct way to resume: the library's message names
// the files and the differences; this adds the flags that go on.
[[noreturn]] void refuseSnapshot(const SnapshotIncompatible& e, const TrainOptions& o) {
  // The library's advice names its options; the flags say the same here.
  const SnapshotIncompatible plain(e.file(), e.differences());
  throw ConfigError(std::string(plain.what()) + "; to go on, pass --resume never (start over, replacing " +
                    o.snapshotPath.string() + ")" +
                    (o.allowConfigChange ? "" : ", --allow-config-change (continue from its weights with this run's settings)") +
                    " or another --snapshot-path (keep that run)");
}

[[noreturn]] void refuseResume(const ResumeRefused& e) {
  throw ConfigError(std::string(e.what()) + " (ctorch-train: --resume never starts over)");
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

// ---- one optimizer step --------------------------------------------------------------------------------

// ---- the run -------------------------------------------------------------------------------------------

// The epoch's training-loss totals as every rank knows them (summed over the ranks in a step's
// agreement), tracked in the snapshot: a run resumed mid-epoch writes the same "train" and "epoch"
// records as one never interrupted (issue 28.5). The losses are summed at the steps that log and at
// the steps that save on schedule; a stop that saves between two sums keeps each rank's own sum
// of the steps since the last one (interval_local_loss, per rank), so a snapshot holds every step's
// loss before it.
struct EpochTally {
  double epochLoss = 0.0;           // sum of the summed steps' losses (mean over the ranks)
  std::int64_t epochLossSteps = 0;  // the steps that covers
  double intervalLoss = 0.0;        // the current log interval's part of it
  std::int64_t intervalSteps = 0;   // steps of the current interval (summed or not)
  std::int64_t unsummed = 0;        // steps since the last sum
  std::int64_t lostSteps = 0;       // steps whose losses a resume lost (a stop between two sums)

  // The tally once the ranks summed the losses of the `unsummed` steps to `sum`; `logs`: this step
  // ends the log interval (its record is written, the next interval starts).
  EpochTally summed(double sum, int world, bool logs) const {
    EpochTally t = *this;
    const double mean = sum / static_cast<double>(world);
    t.epochLoss += mean;
    t.epochLossSteps += t.unsummed;
    t.intervalLoss += mean;
    t.unsummed = 0;
    if (logs) {
      t.intervalLoss = 0.0;
      t.intervalSteps = 0;
    }
    return t;
  }
  c10::IValue toIValue() const {
    return c10::IValue(std::vector<double>{epochLoss, static_cast<double>(epochLossSteps), intervalLoss,
                                           static_cast<double>(intervalSteps), static_cast<double>(unsummed),
                                           static_cast<double>(lostSteps)});
  }
  // The unsummed steps' losses are gone (a resumed process never had them; after an in-place
  // recovery no rank keeps them): counted as lost, and out of the interval.
  void dropUnsummed() {
    lostSteps += unsummed;
    intervalSteps -= unsummed;
    unsummed = 0;
  }
  static EpochTally resumedFrom(const c10::IValue& v) {
    // A list of floats (as written), read back as a generic list by some LibTorch versions.
    std::vector<double> l;
    if (v.isDoubleList()) {
      for (double x : v.toDoubleList()) l.push_back(x);
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef())
        if (x.isDouble() || x.isInt()) l.push_back(x.isDouble() ? x.toDouble() : static_cast<double>(x.toInt()));
    }
    const bool counts = l.size() == 6 && std::all_of(l.begin(), l.end(), [](double x) { return std::isfinite(x); }) &&
                        l[1] >= 0 && l[3] >= l[4] && l[4] >= 0 && l[5] >= 0 && l[1] < 1e15 && l[3] < 1e15 && l[5] < 1e15;
    if (!counts)
      throw SnapshotIncompatible("(epoch_tally)", {"USER_STATE['epoch_tally'] is not 6 finite numbers with counts >= 0"});
    EpochTally t;
    t.epochLoss = l[0];
    t.epochLossSteps = static_cast<std::int64_t>(l[1]);
    t.intervalLoss = l[2];
    t.intervalSteps = static_cast<std::int64_t>(l[3]);
    t.unsummed = static_cast<std::int64_t>(l[4]);
    t.lostSteps = static_cast<std::int64_t>(l[5]);
    return t;  // the unsummed steps stay when each rank gets its own losses of them back (interval_local_loss)
  }
};

// What one pass over an epoch's steps measures: from the epoch's start, or from where a resume or
// an in-place recovery put it (a recovery starts a new pass from the agreed point).
struct EpochPass {
  std::int64_t epoch = 0;
  std::int64_t firstStep = 0;  // the step in the epoch the pass started at
  Clock::time_point start, intervalStart;
  double cpuStart = 0;
  std::int64_t intervalSamples = 0, samples = 0;  // over every rank
  StepPhases phases;
  std::optional<GradientReductionStats> reductionStart;  // the shared-memory hook's, if in use
};

enum class PassEnd { kEpochDone, kStopped, kRecovered };

// One step as trained and agreed on by the ranks.
struct AgreedStep {
  StepOutcome outcome;
  std::vector<double> sums;  // the interval's losses summed over the ranks, at the steps that log or save
  bool periodic = false;     // logs: every --log-interval steps and the epoch's last
  bool stop = false;         // every rank stops after this step
};

// The current log interval's loss as reported: over every rank at the steps that log; between
// them (the progress bar) this rank's own losses since the last sum.
struct IntervalLoss {
  double sum = 0.0;
  std::int64_t steps = 0;
  double mean() const { return sum / static_cast<double>(std::max<std::int64_t>(steps, 1)); }
};

// One training run: set-up in the constructor, then run() (loop and finish). Resilience (stop
// signals, snapshots, resume) is the library's ctorch::ResilientTraining; this class adds the
// trainer's own data, metrics, evaluation, console and final weights.
class Trainer {
 public:
  // `data` is loaded before the process group exists (it does not depend on the rank): a spare
  // worker (ctorchrun --spare-workers) has it in memory when it takes a rank over.
  Trainer(const TrainOptions& o, const RunHooks& hooks, const torch::Device& wanted, TrainData data,
          double dataSeconds)
      : o_(o),
        hooks_(hooks),
        runStart_(Clock::now()),
        pg_(processGroupOptions(o, wanted)),
        rank_(getRank()),
        worldSize_(getWorldSize()),
        device_(bindDevice(wanted)),
        console_(ctorch::isMainProcess() ? hooks.out : nullptr, o.progress, hooks.terminal) {
    const ctorch::ThreadChoice threads = ctorch::configureThreads(o.threads, getLocalWorldSize());
    console_.line("ctorch-train: " + getDistributedEnv().describe() + ", device " + device_.str() + ", backend " +
                  getBackendName() + ", " + std::to_string(threads.threads) + " thread" +
                  (threads.threads == 1 ? "" : "s") + " per rank (" +
                  (threads.reason == "requested" ? std::string("--threads") : threads.reason) + ")" +
                  (threads.blasThreads > 0 ? ", OpenBLAS " + std::to_string(threads.blasThreads) + " (" +
                                                 threads.blasReason + ")"
                                           : std::string()));
    if (!threads.busyHost.empty() && ctorch::isMainProcess())
      std::cerr << ("ctorch-train: warning: " + threads.busyHost + "\n") << std::flush;
    console_.line("config: " + o.describe());
    data_ = std::move(data);
    dataSeconds_ = dataSeconds;
    buildDataAndModel();
    buildTraining();
    buildResilience();
  }

  RunResult run();

 private:
  void buildDataAndModel();
  void buildTraining();
  void buildResilience();
  void resume();
  bool runEpoch(RunResult& result);  // true: the run stops (signal or step limit)
  PassEnd runEpochPass(RunResult& result);
  void startEpochTally(std::int64_t firstStep);
  std::optional<AgreedStep> trainAndAgree(data::BatchLoader& loader);
  IntervalLoss countLoss(const AgreedStep& step);
  void reportStep(EpochPass& pass, const AgreedStep& step, const IntervalLoss& loss, double lr);
  bool reachedStepLimit(std::int64_t epoch) const;
  void reportEpoch(const EpochPass& pass);
  bool endEpoch(RunResult& result);  // true: stopped at the epoch boundary
  bool endEpochOnce(RunResult& result, std::int64_t completed, bool lastEpoch);
  void recoverFromFailedStep(const std::exception& e);
  void recoverInPlace();
  EvalTotals evaluate(std::int64_t completed);
  RunResult stopped(RunResult result, bool stepLimit);
  RunResult finish(RunResult result);
  void writeFinalWeights();
  void holdIfAsked(std::int64_t doneStep) const;
  double trainSeconds() const { return trainSecondsBefore_ + secondsSince(runStart_); }
  std::string point() const;

  const TrainOptions& o_;
  const RunHooks& hooks_;
  const Clock::time_point runStart_;
  ProcessGroupScope pg_;
  const int rank_;
  const int worldSize_;
  const torch::Device device_;
  Console console_;
  TrainData data_;
  double dataSeconds_ = 0;
  std::shared_ptr<Model> model_;
  std::int64_t activationBytes_ = 0;
  MemoryFormatDecision memoryFormat_;  // --memory-format as resolved for this model and device
  // DDP (whole optimizer or ZeRO-1), FSDP or the parameter server (strategy.hpp), chosen once.
  std::unique_ptr<Strategy> strategy_;
  // The ranks that read data and compute gradients: all of them, or the parameter server's workers.
  int dataRanks_ = 1;
  std::unique_ptr<amp::GradScaler> scaler_;
  std::unique_ptr<DistributedSampler> sampler_;
  std::unique_ptr<LrSchedule> schedule_;
  std::int64_t stepsPerEpoch_ = 0;
  std::unique_ptr<ResilientTraining> training_;
  std::optional<RunRecords> records_;  // rank 0's metrics file and TensorBoard events
  double trainSecondsBefore_ = 0;  // training time of earlier processes of this run
  EpochTally tally_;
  bool tallyRestored_ = false;          // a snapshot (or a peer, in place) gave tally_
  bool localLossRestored_ = false;      // ... and this rank's intervalLocalLoss_ (a snapshot, same world size)
  double intervalLocalLoss_ = 0.0;      // this rank's losses of the tally's unsummed steps
  const std::vector<double>* summing_ = nullptr;  // the sums of the step being agreed, for a capture in it
  bool summingLogs_ = false;
  // --profile-steps: LibTorch's profiler while the chosen steps run; the trace is written when it ends.
  std::unique_ptr<torch::autograd::profiler::RecordProfile> profiler_;
  void profileBefore(std::int64_t nextStep);
  void profileAfter(std::int64_t doneStep, bool ending);
  double bestAccuracy_ = -1.0;
};

void Trainer::buildDataAndModel() {
  console_.line("data: " + o_.dataset + ", " + withThousands(data_.train->size()) + " training / " +
                withThousands(data_.test->size()) + " test samples of " + shapeText(data_.train->sampleShape()) +
                (data_.augmented ? ", crop+flip augmentation" : "") + " (loaded in " +
                formatDuration(dataSeconds_) + ")");
  const models::ModelOptions modelOptions = modelOptionsFor(o_, *data_.train);
  if (device_.is_cpu()) activationBytes_ = measureActivationBytes(modelOptions, data_.train->sampleShape());
  torch::manual_seed(static_cast<std::uint64_t>(o_.seed));  // initial weights (DDP broadcasts rank 0's anyway)
  model_ = models::createModel(modelOptions);
  model_->to(device_);
  // Before the strategy wraps it: DDP lays its gradient buckets out after the parameters' strides.
  memoryFormat_ = chooseMemoryFormat(o_, device_.is_cuda(), hasFourDimensionalTensors(*model_));
  toMemoryFormat(*model_, memoryFormat_.format);
}

void Trainer::buildTraining() {
  strategy_ = makeStrategy(o_, model_);
  dataRanks_ = strategy_->dataRanks();
  // Loss scaling for float16 only: bfloat16 has float32's exponent range.
  scaler_ = std::make_unique<amp::GradScaler>(
      device_, amp::GradScalerOptions().enabled(o_.amp && amp::parseDtype(o_.ampDtype) == torch::kHalf));
  DistributedSamplerOptions samplerOptions;
  samplerOptions.datasetSize = data_.train->size();
  // With a parameter server the workers split the data; a server keeps worker 0's count of it.
  samplerOptions.worldSize = dataRanks_;
  samplerOptions.rank = strategy_->samplerRank();
  samplerOptions.seed = o_.seed;
  sampler_ = std::make_unique<DistributedSampler>(samplerOptions);
  BatchMemoryInputs batch;
  batch.batchSize = o_.batchSize;
  batch.shardSize = sampler_->size();
  batch.datasetSize = data_.train->size();
  batch.worldSize = dataRanks_;
  batch.localRanks = getLocalWorldSize();
  batch.inputBytes = sampleBytes(data_.train->sampleShape());
  batch.activationBytes = activationBytes_;
  batch.prefetch = o_.prefetch;
  batch.availableBytes = availableMemory(batch.availableSource);
  if (const std::string problem = checkBatchSize(batch); !problem.empty()) throw UsageError(problem);
  stepsPerEpoch_ = ceilDiv(ceilDiv(sampler_->size(), o_.batchSize), o_.gradAccumSteps);
  schedule_ = std::make_unique<LrSchedule>(LrSchedule::fromOptions(o_));
  const std::string noun = chosenStrategy(o_).dataRankNoun;
  console_.line("model: " + o_.model + ", " + withThousands(models::parameterCount(*model_)) +
                " parameters, " + memoryFormatName(memoryFormat_.format) + " (" + memoryFormat_.reason +
                "); global batch " + std::to_string(o_.batchSize * o_.gradAccumSteps * dataRanks_) + " (" +
                std::to_string(o_.batchSize) + " per " + noun +
                (o_.gradAccumSteps > 1 ? " x " + std::to_string(o_.gradAccumSteps) + " micro-steps" : "") + " x " +
                std::to_string(dataRanks_) + " " + noun + (dataRanks_ == 1 ? "), " : "s), ") +
                std::to_string(stepsPerEpoch_) + " steps per epoch" + strategy_->averaging(worldSize_));
}

// What a snapshot holds beyond the model, optimizer and sampler: the scheduler's position (a pure
// function of progress, recorded for readers), loss scaling, the trainer's own totals.
void Trainer::buildResilience() {
  ResilienceOptions r;
  r.snapshotPath(o_.snapshotPath)
      .saveEverySteps(o_.saveEverySteps)
      .saveEveryEpochs(o_.saveEvery)
      .keepPrevious(o_.keepSnapshots)
      .shardCopies(o_.shardCopies)
      .logEverySave(o_.logSaves)
      .resume(o_.resume.kind != ResumeChoice::Kind::kNever)
      .runName(o_.model)
      .config(o_.bindingConfig())
      .allowConfigChange(o_.allowConfigChange)
      .stepsPerEpoch(stepsPerEpoch_)
      .stepSeed(static_cast<std::uint64_t>(o_.seed))
      .log([this](const std::string& line) { console_.line(line); })
      .programName("ctorch-train");
  if (o_.resume.kind == ResumeChoice::Kind::kPath) r.resumeFrom(o_.resume.path);
  training_ = std::make_unique<ResilientTraining>(r);
  ResilientTraining& t = *training_;
  strategy_->track(t);
  t.track(*sampler_);
  if (const std::string off = inPlaceRecoveryOffWith(o_); !off.empty() && inPlaceRecoveryEnabled())
    console_.line("in-place recovery is off with " + off +
                  ": a lost rank's shards come back from the snapshot files with a group restart");
  t.trackScheduler(
      [this] {
        ItemDict d = newItemDict();
        const double at = epochProgress(training_->epoch(), training_->stepInEpoch(), stepsPerEpoch_);
        d.insert("kind", std::string(toString(o_.lrDecay)));
        d.insert("epoch_progress", at);
        d.insert("lr", schedule_->at(at));
        return d;
      },
      [](const ItemDict&) {});  // recomputed from the progress
  t.track(
      "train_seconds", [this] { return c10::IValue(trainSeconds()); },
      [this](const c10::IValue& v) { trainSecondsBefore_ = v.toDouble(); },
      [](const c10::IValue& v) {
        if (!v.isDouble() || !std::isfinite(v.toDouble()) || v.toDouble() < 0)
          throw ConfigError("expected a number of seconds, found " + (v.isDouble() ? std::to_string(v.toDouble()) : "a " + v.tagKind()));
      });
  t.track("best_accuracy", bestAccuracy_);
  // Captured inside stepDone(): a step that sums the losses is saved with its sum folded in.
  t.track("epoch_tally",
          [this] {
            const EpochTally now = summing_ ? tally_.summed((*summing_)[0], dataRanks_, summingLogs_) : tally_;
            return now.toIValue();
          },
          [this](const c10::IValue& v) {
            tally_ = EpochTally::resumedFrom(v);
            tallyRestored_ = true;
            localLossRestored_ = false;
            intervalLocalLoss_ = 0.0;
          },
          [](const c10::IValue& v) { (void)EpochTally::resumedFrom(v); });
  // Each rank's losses of the steps not summed yet (a stop between two sums): a resume under the
  // same world size goes on adding to them, so its sums are those of a run never stopped.
  t.trackPerRank("interval_local_loss", [this] { return summing_ ? 0.0 : intervalLocalLoss_; },
                 [this](std::optional<double> v) {
                   localLossRestored_ = v.has_value();
                   intervalLocalLoss_ = v.value_or(0.0);
                 });
  t.track(
      "steps_per_epoch", [this] { return c10::IValue(stepsPerEpoch_); }, [](const c10::IValue&) {},
      [](const c10::IValue& v) {
        if (!v.isInt()) throw ConfigError("expected an int, found a " + v.tagKind());
      });
  t.trackItems([this](ItemDict& d) { scaler_->saveTo(d); }, [this](const ItemDict& d) { scaler_->loadFrom(d); });
}

void Trainer::resume() {
  ResumePoint at;
  try {
    at = training_->resume();
  } catch (const SnapshotIncompatible& e) {
    refuseSnapshot(e, o_);
  } catch (const ResumeRefused& e) {
    refuseResume(e);
  }
  // Without every rank's own losses of the steps not summed yet (a snapshot of an older trainer, or
  // under another world size) those steps' losses are lost: counted, and out of the interval.
  if (tallyRestored_ && !localLossRestored_) tally_.dropUnsummed();
  if (ctorch::isMainProcess() && (o_.metricsPath() || !o_.tensorboardDir.empty())) {
    records_.emplace(o_.metricsPath(),
                     o_.tensorboardDir.empty() ? std::nullopt : std::optional<std::filesystem::path>(o_.tensorboardDir),
                     training_->globalStep());
    if (const auto events = records_->tensorboardFile())
      console_.line("tensorboard: " + events->string() + " (view: tensorboard --logdir " + o_.tensorboardDir.string() +
                    ")");
    if (at.resumed) {  // marked in metrics.png
      ResumeRecord r;
      r.step = at.globalStep;
      r.epoch = epochProgress(at.epoch, at.stepInEpoch, stepsPerEpoch_);
      r.exact = at.exact;
      r.time = trainSeconds();
      records_->write(r);
    }
  }
}

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

// The progress bar after every step, a progress line and a metrics record at the steps that log.
void Trainer::reportStep(EpochPass& pass, const AgreedStep& step, const IntervalLoss& loss, double lr) {
  if (!step.periodic && !console_.barMode()) return;
  const ResilientTraining& t = *training_;
  StepReport r;
  r.epoch = pass.epoch;
  r.epochs = o_.epochs;
  r.stepInEpoch = t.stepInEpoch();
  r.stepsPerEpoch = stepsPerEpoch_;
  r.globalStep = t.globalStep();
  r.lr = lr;
  const double elapsed = secondsSince(pass.intervalStart);
  r.loss = loss.mean();
  r.samplesPerSecond = elapsed > 0 ? static_cast<double>(pass.intervalSamples) / elapsed : 0.0;
  const double perStep = secondsSince(pass.start) / static_cast<double>(t.stepInEpoch() - pass.firstStep);
  r.epochEtaSeconds = perStep * static_cast<double>(stepsPerEpoch_ - t.stepInEpoch());
  r.totalEtaSeconds = r.epochEtaSeconds + perStep * static_cast<double>(stepsPerEpoch_ * (o_.epochs - pass.epoch - 1));
  console_.progress(r, step.periodic);
  if (!step.periodic) return;
  if (records_) {
    TrainRecord m;
    m.step = t.globalStep();
    m.epoch = epochProgress(pass.epoch, t.stepInEpoch(), stepsPerEpoch_);
    m.loss = r.loss;
    m.lr = lr;
    m.samplesPerSecond = r.samplesPerSecond;
    m.time = trainSeconds();
    m.lossKind = lossKindName(model_->output());
    records_->write(m);
  }
  pass.intervalSamples = 0;
  pass.intervalStart = Clock::now();
}

// --max-steps reached, unless this step ends the run anyway (the last epoch's last step).
bool Trainer::reachedStepLimit(std::int64_t epoch) const {
  return o_.maxSteps > 0 && training_->globalStep() >= o_.maxSteps &&
         !(epoch + 1 == o_.epochs && sampler_->exhausted());
}

// The epoch's summary line and metrics record (of this pass: a recovery in place starts counting again).
void Trainer::reportEpoch(const EpochPass& pass) {
  const ResilientTraining& t = *training_;
  const std::int64_t epoch = pass.epoch, firstStep = pass.firstStep;
  const StepPhases& phases = pass.phases;
  const double epochSeconds = secondsSince(pass.start);
  const std::int64_t stepsRun = t.stepInEpoch() - firstStep;
  const double epochRate = static_cast<double>(pass.samples) / std::max(epochSeconds, 1e-9);
  const double meanLoss =
      tally_.epochLossSteps > 0 ? tally_.epochLoss / static_cast<double>(tally_.epochLossSteps) : 0.0;
  const auto share = [epochSeconds](double seconds) {
    return std::to_string(std::llround(100.0 * seconds / std::max(epochSeconds, 1e-9))) + "%";
  };
  // The shared-memory reduction's time per step (on its helper thread when overlapped).
  double reduceSeconds = 0, reduceWaitSeconds = 0;
  std::string reductionText;
  if (const auto now = worldSize_ > 1 ? strategy_->reductionStats() : std::nullopt;
      now && pass.reductionStart && stepsRun > 0) {
    reduceSeconds = std::chrono::duration<double>(now->total - pass.reductionStart->total).count();
    reduceWaitSeconds = std::chrono::duration<double>(now->waiting - pass.reductionStart->waiting).count();
    const auto ms = [stepsRun](double seconds) {
      std::ostringstream os;
      os << std::fixed << std::setprecision(2) << 1000.0 * seconds / static_cast<double>(stepsRun);
      return os.str();
    };
    reductionText = "; gradient reduction " + ms(reduceSeconds) + " ms a step, " + ms(reduceWaitSeconds) +
                    " of it waiting for the other ranks";
  }
  console_.line("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(o_.epochs) + " done: " +
                std::to_string(stepsRun) + " steps" +
                (firstStep > 0 ? " (resumed at step " + std::to_string(firstStep) + ")" : std::string()) + " in " +
                formatDuration(epochSeconds) + ", " +
                std::to_string(std::llround(epochRate)) + " samples/s, train loss " + std::to_string(meanLoss) +
                " (rank 0's time: data " + share(phases.data) + ", forward+backward " +
                share(phases.forwardBackward) + ", optimizer " + share(phases.optimizer) + ", agreement " +
                share(phases.agreement) + ")" + reductionText);
  if (!records_) return;
  EpochRecord r;
  r.step = t.globalStep();
  r.epoch = epoch + 1;
  r.steps = t.stepInEpoch();
  r.stepsRun = stepsRun;
  r.resumedAt = firstStep;
  r.lossSteps = tally_.epochLossSteps;
  r.seconds = epochSeconds;
  r.cpuSeconds = processCpuSeconds() - pass.cpuStart;
  r.samplesPerSecond = epochRate;
  r.loss = meanLoss;
  r.time = trainSeconds();
  r.dataSeconds = phases.data;
  r.forwardBackwardSeconds = phases.forwardBackward;
  r.optimizerSeconds = phases.optimizer;
  r.agreementSeconds = phases.agreement;
  r.reduceSeconds = reduceSeconds;
  r.reduceWaitSeconds = reduceWaitSeconds;
  records_->write(r);
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

void Trainer::profileBefore(std::int64_t nextStep) {
  if (profiler_ || o_.profileFirst == 0 || nextStep < o_.profileFirst || nextStep > o_.profileLast) return;
  const auto path = o_.profilePath(rank_);
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  profiler_ = std::make_unique<torch::autograd::profiler::RecordProfile>(path.string());
  console_.line("profiling global steps " + std::to_string(nextStep) + " to " + std::to_string(o_.profileLast) +
                " (LibTorch's profiler; rank " + std::to_string(rank_) + " writes " + path.string() + ")");
}

void Trainer::profileAfter(std::int64_t doneStep, bool ending) {
  if (!profiler_ || (doneStep < o_.profileLast && !ending)) return;
  profiler_.reset();  // writes the trace
  console_.line("profiler trace written: " + o_.profilePath(rank_).string() + " (through global step " +
                std::to_string(doneStep) + "; open it in chrome://tracing or ui.perfetto.dev)");
}

// Called from the handler of a failed step: recovers in place where the run can, else the step's
// failure in one line (stepFailed).
void Trainer::recoverFromFailedStep(const std::exception& e) {
  if (!training_->canRecoverInPlace()) stepFailed(e, rank_, training_->globalStep(), o_.timeout);
  recoverInPlace();
}

// Called from a handler of a failed collective: re-forms the group with the launcher's replacement
// and restores the agreed point (ResilientTraining::recover), or fails the step as without it.
void Trainer::recoverInPlace() {
  try {
    const ResumePoint p = training_->recover();
    // The rank that sent the state kept its own tally: every rank drops the losses not summed yet
    // (the others never had them), so the tally stays the same on every rank.
    tally_.dropUnsummed();
    intervalLocalLoss_ = 0.0;
    console_.line("in-place recovery: " + p.message + " (group generation " + std::to_string(groupGeneration()) + ")");
  } catch (const DistributedError& e) {
    stepFailed(e, rank_, training_->globalStep(), o_.timeout);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    stepFailed(e, rank_, training_->globalStep(), o_.timeout);
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

EvalTotals Trainer::evaluate(std::int64_t completed) {
  const auto evalStart = Clock::now();
  const EvalForward forward = strategy_->prepareEvaluation();
  const EvalTotals totals =
      evaluateDistributed(*model_, *data_.testPipeline, o_.evalBatchSize, device_, pg_.group(), forward);
  std::string line = "epoch " + std::to_string(completed) + "/" + std::to_string(o_.epochs) +
                     " test: loss " + std::to_string(totals.loss());
  if (totals.classification) {
    line += ", accuracy " + percent(totals.accuracy()) + " (" + std::to_string(totals.correct) + "/" +
            std::to_string(totals.count) + ")";
    bestAccuracy_ = std::max(bestAccuracy_, totals.accuracy());
  }
  console_.line(line + " in " + formatDuration(secondsSince(evalStart)));
  if (records_) {
    EvalRecord r;
    r.step = training_->globalStep();
    r.epoch = static_cast<double>(completed);
    r.loss = totals.loss();
    if (totals.classification) r.accuracy = totals.accuracy();
    r.correct = totals.correct;
    r.count = totals.count;
    r.time = trainSeconds();
    records_->write(r);
  }
  return totals;
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

}  // namespace

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
  const auto dataStart = Clock::now();
  TrainData data = loadData(o);
  Trainer trainer(o, hooks, wanted, std::move(data), secondsSince(dataStart));
  return trainer.run();
}

}  // namespace ctorch::train
