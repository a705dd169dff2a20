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
  if (decay == LrDecay::kOneCycle) {
    // torch's OneCycleLR (anneal_strategy='cos', two phases) with div_factor = 1 / warmupStartFactor
    // and its final rate minLr, as a function of progress: up over `up` epochs, down over the rest.
    const double total = static_cast<double>(epochs);
    const double up = warmupEpochs > 0 ? warmupEpochs : 0.3 * total;
    const double start = peak * warmupStartFactor;
    auto anneal = [](double from, double to, double t) { return to + (from - to) * 0.5 * (1.0 + std::cos(M_PI * t)); };
    if (progress < up) return anneal(start, peak, progress / up);
    const double t = total > up ? std::min(1.0, (progress - up) / (total - up)) : 1.0;
    return anneal(peak, minLr, t);
  }
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
    case LrDecay::kLinear: {
      const double span = static_cast<double>(epochs) - warmupEpochs;
      const double t = span > 0 ? std::min(1.0, (progress - warmupEpochs) / span) : 1.0;
      return peak + (minLr - peak) * t;
    }
    case LrDecay::kOneCycle:
      break;  // above
  }
  return peak;
}

double epochProgress(std::int64_t epoch, std::int64_t stepInEpoch, std::int64_t stepsPerEpoch) {
  const double fraction =
      stepsPerEpoch > 0 ? static_cast<double>(stepInEpoch) / static_cast<double>(stepsPerEpoch) : 0.0;
  return static_cast<double>(epoch) + fraction;
}

}  // namespace ctorch::train
