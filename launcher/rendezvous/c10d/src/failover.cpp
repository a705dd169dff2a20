// Store failover's pure decisions (failover.hpp): the successor, the majority a take-over needs,
// and the minority rules. No store, no clock.
#include "ctorch/rdzv/c10d/failover.hpp"

#include <string>

namespace ctorch::rdzv::c10d {

FailoverPlan planFailover(const RoundResult& round) {
  FailoverPlan plan;
  for (const auto& n : round.nodes) {
    if (n.storeHost)
      plan.lost.push_back(n.id);
    else if (!plan.successor && n.standbyPort)
      plan.successor = n;
  }
  return plan;
}

std::vector<NodeSlot> majorityProbes(const RoundResult& round, std::string_view selfId) {
  std::vector<NodeSlot> out;
  for (const auto& n : round.nodes)
    if (n.id != selfId && !n.storeHost && n.standbyPort) out.push_back(n);
  return out;
}

std::optional<std::string> refuseTakeOver(const RoundResult& round, int reachable) {
  if (reachable * 2 > round.nodeCount) return std::nullopt;
  return "only " + std::to_string(reachable) + " of round " + std::to_string(round.round) + "'s " +
         std::to_string(round.nodeCount) +
         " nodes answer from here (a majority must, or this node may be the one cut off): not taking the store over";
}

std::chrono::milliseconds successorWait(const Settings& settings) {
  return settings.heartbeatExpiry() * 2 + std::chrono::milliseconds(2000);
}

std::optional<std::string> minorityReason(const RoundResult& round, const State& state) {
  if (round.nodeCount < 2) return std::nullopt;
  int left = 0;
  for (const auto& id : round.participantIds) left += state.heartbeats.count(id) ? 1 : 0;
  if (left * 2 > round.nodeCount) return std::nullopt;
  return "only " + std::to_string(left) + " of round " + std::to_string(round.round) + "'s " +
         std::to_string(round.nodeCount) +
         " nodes are left here, not a majority; this node is cut off from the others (they may have taken "
         "the store over with --store-failover)";
}

std::optional<std::string> minorityRoundReason(const RoundResult& previous, const RoundResult& formed) {
  if (formed.nodeCount * 2 > previous.nodeCount) return std::nullopt;
  return "round " + std::to_string(formed.round) + " formed with " + std::to_string(formed.nodeCount) +
         " of the previous round's " + std::to_string(previous.nodeCount) +
         " nodes: not a majority, so the other side may have taken the store over (--store-failover) and "
         "trains on; this side stops";
}

} // namespace ctorch::rdzv::c10d
