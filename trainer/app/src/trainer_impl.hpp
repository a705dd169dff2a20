// The Trainer (one run of ctorch-train) as its files share it: the class and the small types of a
// pass over an epoch. Each file holds one of its concerns: the run and its loop (trainer.cpp), the
// set-up and resume (trainer_setup.cpp), what it reports (trainer_reports.cpp), an in-place
// recovery (trainer_recovery.cpp) and --profile-steps (trainer_profiling.cpp). Internal.
#pragma once

#include "ctorch/train/trainer.hpp"

#include "ctorch/train/report.hpp"
#include "ctorch/train/schedule.hpp"
#include "ctorch/train/setup.hpp"
#include "ctorch/train/strategy.hpp"
#include "epoch_tally.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/data/loader.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/resilience.hpp>
#include <ctorch/sampler.hpp>

#include <torch/csrc/autograd/profiler_legacy.h>

#include <time.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::train::trainer_parts {

using Clock = std::chrono::steady_clock;
using Model = models::Model;

inline double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// CPU time of this process, all threads (what a step costs, independent of other processes' load).
inline double processCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

inline std::string percent(double fraction) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f%%", 100.0 * fraction);
  return buffer;
}

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
          double dataSeconds);

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

}  // namespace ctorch::train::trainer_parts
