#include "ctorch/train/schedule.hpp"

#include <algorithm>
#include <cmath>

namespace ctorch::train {

LrSchedule LrSchedule::fromOptions(const TrainOptions& o) {
  LrSchedule s;
  s.peak = o.lr;
  s.warmupEpochs = o.warmupEpochs;
  s.warmupStartFactor = o.warmupStartFactor;
  s.decay = o.lrDecay;
  s.stepEpochs = o.lrStepEpochs;
  s.gamma = o.lrGamma;
  s.minLr = o.minLr;
  s.epochs = o.epochs;
  return s;
}

double LrSchedule::at(double progress) const {
  progress = std::max(0.0, progress);
  if (progress < warmupEpochs) {
    const double f = warmupStartFactor + (1.0 - warmupStartFactor) * (progress / warmupEpochs);
    return peak * f;
  }
  switch (decay) {
    case LrDecay::kNone:
      return peak;
    case LrDecay::kStep:
      // torch's StepLR convention: the factor changes at every multiple of the period, counted from 0.
      return peak * std::pow(gamma, std::floor(progress / static_cast<double>(stepEpochs)));
    case LrDecay::kCosine: {
      const double span = static_cast<double>(epochs) - warmupEpochs;
      const double t = span > 0 ? std::min(1.0, (progress - warmupEpochs) / span) : 1.0;
      return minLr + (peak - minLr) * 0.5 * (1.0 + std::cos(M_PI * t));
    }
  }
  return peak;
}

double epochProgress(std::int64_t epoch, std::int64_t stepInEpoch, std::int64_t stepsPerEpoch) {
  const double fraction =
      stepsPerEpoch > 0 ? static_cast<double>(stepInEpoch) / static_cast<double>(stepsPerEpoch) : 0.0;
  return static_cast<double>(epoch) + fraction;
}

}  // namespace ctorch::train
