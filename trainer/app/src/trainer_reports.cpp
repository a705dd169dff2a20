// What the Trainer (trainer_impl.hpp) reports: the progress bar and lines after a step, the epoch's
// summary line, the test-set evaluation's line, and with each its record in rank 0's metrics file
// and TensorBoard events (report.hpp's Console and RunRecords write them).
#include "trainer_impl.hpp"

#include "ctorch/train/evaluate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <sstream>

namespace ctorch::train::trainer_parts {

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

}  // namespace ctorch::train::trainer_parts
