// The training run of ctorch-train as a library call, so tests drive it in-process as well as through
// the program: init process group -> data, model, optimizer -> resume from the newest valid snapshot
// -> epochs of steps with periodic evaluation and snapshots -> final weights.
#pragma once

#include "ctorch/train/evaluate.hpp"
#include "ctorch/train/options.hpp"

#include <cstdint>
#include <functional>
#include <iostream>
#include <optional>
#include <ostream>

namespace ctorch::train {

struct RunHooks {
  std::ostream* out = &std::cout;  // rank 0's console; other ranks print nothing
  bool terminal = false;           // `out` is a terminal (a progress bar in --progress auto)
  // Called on every rank before each optimizer step with the number of steps done so far, and after
  // it once every rank agreed on it (tests: request a stop in the middle of a step).
  std::function<void(std::int64_t globalStep)> beforeStep;
  std::function<void(std::int64_t globalStep)> afterStep;
};

enum class RunStatus {
  kCompleted,  // every epoch done, final weights written
  kPreempted,  // a stop signal: snapshot written, exit contract::kExitPreempted
  kStepLimit,  // --max-steps reached: snapshot written, exit 0
};

struct RunResult {
  RunStatus status = RunStatus::kCompleted;
  int stopSignal = 0;               // the signal that stopped the run (kPreempted)
  std::int64_t epochsRun = 0;       // completed epochs
  std::int64_t stepInEpoch = 0;
  std::int64_t globalStep = 0;
  std::optional<EvalTotals> lastEval;
  int exitCode() const;
};

// Runs training as configured. Calls ctorch::initProcessGroup() and destroys the group before it
// returns. Throws UsageError (bad combination found only now, e.g. --device cuda without a GPU),
// ctorch::ConfigError, SnapshotIncompatible, data/model option errors, and anything that fails.
RunResult runTraining(const TrainOptions& options, const RunHooks& hooks = {});

}  // namespace ctorch::train
