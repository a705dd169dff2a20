// The learning rate as a pure function of training progress measured in epochs (epoch index plus the
// fraction of the epoch done): linear warmup, then constant, step or cosine decay. Being a function
// of progress, not of a stateful scheduler, it needs nothing restored on resume and means the same
// under another world size (where an epoch has another number of steps).
#pragma once

#include "ctorch/train/options.hpp"

#include <cstdint>

namespace ctorch::train {

struct LrSchedule {
  double peak = 0.01;
  double warmupEpochs = 0.0;
  double warmupStartFactor = 0.1;
  LrDecay decay = LrDecay::kNone;
  std::int64_t stepEpochs = 1;
  double gamma = 0.1;
  double minLr = 0.0;
  std::int64_t epochs = 1;

  static LrSchedule fromOptions(const TrainOptions& options);

  // The learning rate at `progress` epochs (>= 0).
  double at(double progress) const;
};

// Progress in epochs of the step about to be taken: epoch + stepInEpoch / stepsPerEpoch.
double epochProgress(std::int64_t epoch, std::int64_t stepInEpoch, std::int64_t stepsPerEpoch);

}  // namespace ctorch::train
