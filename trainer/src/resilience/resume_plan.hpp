// Where a run resumes, decided from what the snapshots say (no files touched here): the newest
// snapshot continues exactly when the world size is unchanged; under another world size only an
// epoch-boundary state can be used (the sampler's index lists depend on the world size), which is
// the newest snapshot if it sits on a boundary, else the separate epoch-boundary slot.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace ctorch {

// What the decision needs to know about one snapshot.
struct SnapshotPoint {
  std::filesystem::path file;
  std::int64_t worldSize = 1;
  std::int64_t epochsRun = 0;     // completed epochs
  std::int64_t stepInEpoch = 0;   // steps done in epoch `epochsRun`
  std::int64_t globalStep = 0;
  bool epochComplete = false;     // every index of epoch `epochsRun` consumed: only its end-of-epoch work is left

  bool atEpochBoundary() const { return stepInEpoch == 0 || epochComplete; }
};

enum class ResumeSource {
  kNone,      // start from scratch
  kNewest,    // the newest snapshot (exactly, or at its epoch boundary)
  kBoundary,  // the epoch-boundary slot
};

struct ResumePlan {
  ResumeSource source = ResumeSource::kNone;
  bool exact = false;             // continues the newest snapshot step for step (same world size)
  std::string message;            // one line saying what was done and why
};

// How a point of training is named in messages, in the numbers ResilientTraining's epoch() and
// stepInEpoch() give: "1 epoch + 7 steps", "2 epochs", "7 steps" (0 steps: the start).
std::string progressText(std::int64_t epochsDone, std::int64_t stepsInEpoch);

// Whether planResume will need the epoch-boundary snapshot (load it only then).
bool needsEpochBoundary(const std::optional<SnapshotPoint>& newest, std::int64_t worldSize);

// The decision. Throws ctorch::ResumeRefused when no correct resume exists (a mid-epoch snapshot under
// another world size with no epoch-boundary snapshot after the first epoch): the message says how
// to proceed (the old world size, or starting over).
// `boundarySlot` is only named in messages.
ResumePlan planResume(const std::optional<SnapshotPoint>& newest, const std::optional<SnapshotPoint>& boundary,
                      std::int64_t worldSize, const std::filesystem::path& boundarySlot);

}  // namespace ctorch
