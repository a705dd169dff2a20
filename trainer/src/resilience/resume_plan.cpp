#include "resilience/resume_plan.hpp"

#include <ctorch/errors.hpp>
#include <ctorch/resilience.hpp>

#include <sstream>

namespace ctorch {

namespace {

std::string ranks(std::int64_t n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

// "1 epoch + 120 steps (global step 589)": a snapshot whose epoch's data ran out counts that epoch.
std::string where(const SnapshotPoint& p) {
  return p.epochComplete ? describeProgress(p.epochsRun + 1, 0, p.globalStep)
                         : describeProgress(p.epochsRun, p.stepInEpoch, p.globalStep);
}

std::string plural(std::int64_t n, const char* what) {
  return std::to_string(n) + " " + what + (n == 1 ? "" : "s");
}

}  // namespace

std::string progressText(std::int64_t epochsDone, std::int64_t stepsInEpoch) {
  if (epochsDone > 0 && stepsInEpoch > 0) return plural(epochsDone, "epoch") + " + " + plural(stepsInEpoch, "step");
  if (epochsDone > 0) return plural(epochsDone, "epoch");
  return plural(stepsInEpoch, "step");
}

std::string describeProgress(std::int64_t epochsDone, std::int64_t stepsInEpoch, std::int64_t globalStep) {
  return progressText(epochsDone, stepsInEpoch) + " (global step " + std::to_string(globalStep) + ")";
}

bool needsEpochBoundary(const std::optional<SnapshotPoint>& newest, std::int64_t worldSize) {
  return newest && newest->worldSize != worldSize && !newest->atEpochBoundary();
}

ResumePlan planResume(const std::optional<SnapshotPoint>& newest, const std::optional<SnapshotPoint>& boundary,
                      std::int64_t worldSize, const std::filesystem::path& boundarySlot) {
  ResumePlan plan;
  if (!newest) {
    plan.message = "no snapshot found: starting from scratch";
    return plan;
  }
  const SnapshotPoint& n = *newest;
  if (n.worldSize == worldSize) {
    plan.source = ResumeSource::kNewest;
    plan.exact = true;
    plan.message = "resuming from " + n.file.string() + " after " + where(n) + ", exactly where it stopped";
    return plan;
  }
  if (n.atEpochBoundary()) {
    plan.source = ResumeSource::kNewest;
    plan.message = "resuming from " + n.file.string() + " after " + where(n) + ": written by " + ranks(n.worldSize) +
                   " at an epoch boundary, continued by " + ranks(worldSize);
    return plan;
  }
  const std::string why = n.file.string() + " stopped mid-epoch after " + where(n) + " under " + ranks(n.worldSize) +
                          "; a run of " + ranks(worldSize) +
                          " can resume only at an epoch boundary (each rank's share of an epoch depends on the "
                          "world size)";
  // A boundary snapshot newer than the mid-epoch one cannot exist (the slot is written first);
  // anything else in that file is stale and not used.
  if (boundary && boundary->atEpochBoundary() && boundary->globalStep <= n.globalStep) {
    plan.source = ResumeSource::kBoundary;
    std::ostringstream os;
    os << why << ": resuming from " << boundary->file.string() << " after " << where(*boundary) << "; the "
       << (n.globalStep - boundary->globalStep) << " steps after it are redone with " << ranks(worldSize);
    plan.message = os.str();
    return plan;
  }
  if (n.epochsRun == 0) {
    plan.message = why + "; the only epoch boundary before it is the start of training: starting from scratch "
                         "(same seed, same initial weights)";
    return plan;
  }
  throw ResumeRefused(why + ", and there is no usable epoch-boundary snapshot (" +
                    (boundary ? boundary->file.string() + " is not an epoch boundary before it"
                              : boundarySlot.string() + " does not exist") +
                    "). Resume with " + ranks(n.worldSize) + ", or start over from scratch.");
}

}  // namespace ctorch
