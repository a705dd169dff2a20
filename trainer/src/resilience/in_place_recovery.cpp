// In-place recovery's state for ResilientTraining: the committed point a failed step goes back to,
// and which rank's state the re-formed group continues from (docs/in-place-recovery.md).
#include "resilience/in_place_recovery.hpp"

#include <torch/utils.h>

namespace ctorch::detail {

std::int64_t InPlaceRecovery::parameterVersions(const TrackedState& state) {
  std::int64_t sum = 0;
  // A sharded model's optimizer steps its shards (the module's parameters are gathered views).
  for (const auto& p : state.steppedParameters()) sum += static_cast<std::int64_t>(p._version());
  return sum;
}

void InPlaceRecovery::commit(const TrackedState& state) {
  phase_ = Phase::kLoop;
  if (!enabled_) return;
  if (state.sampler()) committedSampler_ = state.sampler()->state();
  committedVersions_ = parameterVersions(state);
  if (!state.model()) return;
  torch::NoGradGuard noGrad;
  const auto buffers = state.model()->buffers();
  if (committedBuffers_.size() != buffers.size()) {
    committedBuffers_.clear();
    for (const auto& b : buffers) committedBuffers_.push_back(b.detach().clone());
  } else {
    for (std::size_t i = 0; i < buffers.size(); ++i) committedBuffers_[i].copy_(buffers[i]);
  }
}

bool InPlaceRecovery::settleAfterFailure(const TrackedState& state) {
  if (phase_ != Phase::kLoop) return false;  // an agreement failed: the counters already include the step/epoch
  if (parameterVersions(state) != committedVersions_) return true;
  // Abandoned before its update: the position and the buffers go back to the agreement.
  if (state.sampler()) state.sampler()->loadState(committedSampler_);
  if (state.model()) {
    torch::NoGradGuard noGrad;
    const auto buffers = state.model()->buffers();
    if (buffers.size() == committedBuffers_.size())
      for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(committedBuffers_[i]);
  }
  return false;
}

std::optional<InPlaceRecovery::Exchange> InPlaceRecovery::exchangeState(
    RankAgreement& ranks, std::int64_t heldStep, bool epochCounted,
    const std::function<std::vector<char>()>& encodeMine) const {
  // One MAX over (global step, epoch counted, lowest rank): the newest state, and among its holders
  // the lowest rank.
  const int world = ranks.world();
  const std::int64_t counted = heldStep >= 0 && epochCounted ? 1 : 0;
  const std::int64_t mine = heldStep < 0 ? -1 : (heldStep * 2 + counted) * world + (world - 1 - ranks.rank());
  const std::int64_t code = ranks.maxOf(mine, "in-place recovery (agreeing on the newest state)");
  if (code < 0) return std::nullopt;
  Exchange exchange;
  exchange.donor = world - 1 - static_cast<int>(code % world);
  const bool donor = ranks.rank() == exchange.donor;
  const std::vector<char> bytes = ranks.broadcast(donor ? encodeMine() : std::vector<char>{}, exchange.donor,
                                                  "receiving the training state from rank " +
                                                      std::to_string(exchange.donor));
  if (!donor)
    exchange.received =
        decodeSnapshot(bytes, "rank " + std::to_string(exchange.donor) + "'s training state");
  return exchange;
}

} // namespace ctorch::detail
