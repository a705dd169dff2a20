#include "resilience/resume_plan.hpp"

#include <ctorch/errors.hpp>

#include <sstream>

namespace ctorch {

namespace {

std::string ranks(std::int64_t n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

// "epoch 2, step 120 (global step 589)", epochs counted from 1 as the console shows them.
std::string where(const SnapshotPoint& p) {
  std::ostringstream os;
  if (p.epochComplete)
    os << "end of epoch " << p.epochsRun + 1;
  else if (p.stepInEpoch == 0)
    os << "start of epoch " << p.epochsRun + 1;
  else
    os << "epoch " << p.epochsRun + 1 << ", step " << p.stepInEpoch;
  os << " (global step " << p.globalStep << ")";
  return os.str();
}

}  // namespace

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
    plan.message = "resuming from " + n.file.string() + " at " + where(n) + ", exactly where it stopped";
    return plan;
  }
  if (n.atEpochBoundary()) {
    plan.source = ResumeSource::kNewest;
    plan.message = "resuming from " + n.file.string() + " at " + where(n) + ": written by " + ranks(n.worldSize) +
                   " at an epoch boundary, continued by " + ranks(worldSize);
    return plan;
  }
  const std::string why = n.file.string() + " stopped mid-epoch at " + where(n) + " under " + ranks(n.worldSize) +
                          "; a run of " + ranks(worldSize) +
                          " can resume only at an epoch boundary (each rank's share of an epoch depends on the "
                          "world size)";
  // A boundary snapshot newer than the mid-epoch one cannot exist (the slot is written first);
  // anything else in that file is stale and not used.
  if (boundary && boundary->atEpochBoundary() && boundary->globalStep <= n.globalStep) {
    plan.source = ResumeSource::kBoundary;
    std::ostringstream os;
    os << why << ": resuming from " << boundary->file.string() << " at " << where(*boundary) << "; the "
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
