// The epoch's training-loss totals as ctorch-train's Trainer keeps them across steps, log intervals,
// snapshots and in-place recoveries (trainer_impl.hpp). Internal.
#pragma once

#include <ctorch/errors.hpp>

#include <ATen/core/ivalue.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ctorch::train::trainer_parts {

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

}  // namespace ctorch::train::trainer_parts
