// The Trainer's set-up (trainer_impl.hpp): the process group, data, model and strategy (with the
// pieces of setup.cpp), the sampler and the learning-rate schedule, what ctorch::ResilientTraining
// tracks in a snapshot, and the resume with rank 0's metrics and TensorBoard records opened.
#include "trainer_impl.hpp"

#include "ctorch/train/memory_check.hpp"
#include "ctorch/process_tuning.hpp"
#include "ctorch/train/strategy_table.hpp"

#include <ctorch/memory_format.hpp>
#include <ctorch/snapshot.hpp>

#include <cmath>
#include <filesystem>
#include <iostream>

namespace ctorch::train::trainer_parts {

namespace {

std::string withThousands(std::int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
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

}  // namespace

Trainer::Trainer(const TrainOptions& o, const RunHooks& hooks, const torch::Device& wanted, TrainData data,
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

}  // namespace ctorch::train::trainer_parts
