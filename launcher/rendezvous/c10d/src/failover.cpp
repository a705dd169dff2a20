// Store failover's pure decisions (failover.hpp): the successor, the majority a take-over needs,
// and the minority rules. No store, no clock.
#include "ctorch/rdzv/c10d/failover.hpp"

#include "ctorch/contract/control_auth.hpp"

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

std::string lossMarkKey(std::string_view runId, std::int64_t round) {
  return "ctorchrun/failover/" + std::string(runId) + "/lost/" + std::to_string(round);
}

std::string deriveFailoverKey(std::string_view secret, std::string_view runId) {
  namespace auth = contract::auth;
  const auth::Digest d = auth::hmacSha256(secret, "ctorch store-failover key for run " + std::string(runId));
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

namespace {

constexpr std::string_view kMarkMagic = "ctorchrun-lost-store 1";

std::string lostHosts(const FailoverPlan& plan) {
  std::string out;
  for (const auto& id : plan.lost) out += (out.empty() ? "" : ",") + id;
  return out;
}

// What the HMAC covers: every field, each on its own line (ids never hold a newline; a field
// that did would make the mark unparsable, never another mark).
std::string markBody(std::string_view runId, std::int64_t round, std::string_view node, std::string_view lost) {
  return std::string(kMarkMagic) + "\n" + std::string(runId) + "\n" + std::to_string(round) + "\n" +
         std::string(node) + "\n" + std::string(lost);
}

std::string markMac(std::string_view key, const std::string& body) {
  if (key.empty()) return "-";
  return contract::auth::toHex(contract::auth::hmacSha256(key, body));
}

bool sameInConstantTime(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

} // namespace

std::string lossMarkValue(std::string_view runId, const RoundResult& round, std::string_view node,
                          const FailoverPlan& plan, std::string_view key) {
  const std::string body = markBody(runId, round.round, node, lostHosts(plan));
  return body + "\n" + markMac(key, body);
}

bool confirmsLoss(std::string_view value, std::string_view runId, const RoundResult& round,
                  const NodeSlot& probed, const FailoverPlan& plan, std::string_view key) {
  if (value.size() > kMaxLossMarkSize || plan.lost.empty()) return false;
  const std::string body = markBody(runId, round.round, probed.id, lostHosts(plan));
  // The body must be exactly the expected one (magic, run id, round, the probed node, the lost
  // host), then one line: the HMAC.
  if (value.size() <= body.size() + 1 || value.substr(0, body.size()) != body || value[body.size()] != '\n')
    return false;
  const std::string_view mac = value.substr(body.size() + 1);
  if (key.empty()) return mac == "-" || (mac.size() == 64 && contract::auth::fromHex(mac));
  return sameInConstantTime(mac, markMac(key, body));
}

std::optional<std::string> refuseTakeOver(const RoundResult& round, const std::set<std::string>& confirmed) {
  int count = 0;
  for (const auto& id : round.participantIds) count += confirmed.count(id) ? 1 : 0;
  if (count * 2 > round.nodeCount) return std::nullopt;
  return "only " + std::to_string(count) + " of round " + std::to_string(round.round) + "'s " +
         std::to_string(round.nodeCount) +
         " nodes confirm that they lost the rendezvous store too (a majority must: the others still reach it, "
         "or this node is the one cut off): not taking the store over";
}

std::chrono::milliseconds lossMarkWait(const Settings& settings) {
  return settings.heartbeatExpiry() + std::chrono::milliseconds(1000);
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
