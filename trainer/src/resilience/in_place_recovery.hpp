// In-place recovery for ResilientTraining: the last point every rank agreed on (what a failed step
// goes back to), and the exchange that hands the newest training state to a replacement over the group.
#pragma once

#include "resilience/rank_agreement.hpp"
#include "resilience/tracked_state.hpp"

#include "ctorch/sampler.hpp"

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace ctorch::detail {

class InPlaceRecovery {
 public:
  explicit InPlaceRecovery(bool enabled) : enabled_(enabled) {}
  bool enabled() const { return enabled_; }

  // Where the loop stands: between agreements, or inside a step's or an epoch's (whose counters
  // already include that step or epoch).
  enum class Phase { kLoop, kStepAgreement, kEpochAgreement };
  void enter(Phase phase) { phase_ = phase; }
  // A point every rank agreed on: what a failure goes back to when the step in progress did not
  // reach the optimizer (the sampler's position, the parameters' versions, the module's buffers).
  void commit(const TrackedState& state);
  // After a failure: true when the step in progress counts (its update ran: the gradient allreduce
  // completed here, so the update is the one every rank makes); else the sampler and the buffers
  // went back to the last agreement.
  bool settleAfterFailure(const TrackedState& state);
  // Before settleAfterFailure: true when the state is exactly the last agreed point (no agreement
  // under way, no update since).
  bool atCommit(const TrackedState& state) const {
    return phase_ == Phase::kLoop && parameterVersions(state) == committedVersions_;
  }
  // Inside a step's or an epoch's agreement (the counters include that step or epoch).
  bool inAgreement() const { return phase_ != Phase::kLoop; }

  // The collectives a replacement and the survivors run together once the group re-formed: agree on
  // the newest state any rank holds (`heldStep`: this rank's global step, -1 for none; `epochCounted`:
  // its epoch's end was counted, which comes after the same step before it), and the lowest rank that
  // holds it sends it to all (`encodeMine` is called on that rank alone). Nothing when no rank holds
  // any state (every rank is new).
  struct Exchange {
    int donor = 0;
    std::optional<Snapshot> received;  // on the ranks other than the donor
  };
  std::optional<Exchange> exchangeState(RankAgreement& ranks, std::int64_t heldStep, bool epochCounted,
                                        const std::function<std::vector<char>()>& encodeMine) const;

 private:
  // The sum of the parameters' version counters: an optimizer step (in-place updates) changes it.
  static std::int64_t parameterVersions(const TrackedState& state);

  bool enabled_;
  Phase phase_ = Phase::kLoop;
  SamplerState committedSampler_;
  std::int64_t committedVersions_ = 0;
  // The module's buffers as agreed (BatchNorm statistics move in a forward that may be abandoned).
  std::vector<at::Tensor> committedBuffers_;
};

} // namespace ctorch::detail
