// Store failover's pure decisions (failover.hpp): the successor, the majority a take-over needs,
// and the minority rules. No store, no clock.
#include "ctorch/rdzv/c10d/failover.hpp"

#include "ctorch/contract/control_auth.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

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

std::string movedKey(std::string_view runId) {
  return "ctorchrun/failover/" + std::string(runId) + "/moved";
}

namespace {

constexpr std::string_view kMovedMagic = "ctorchrun-moved-store 1";

std::string movedBody(std::string_view runId, const MovedRecord& r) {
  return std::string(kMovedMagic) + "\n" + std::string(runId) + "\n" + std::to_string(r.round) + "\n" + r.node +
         "\n" + r.addr + "\n" + std::to_string(r.port);
}

// A decimal in [lo, hi], nothing else (no sign, no spaces, at most 18 digits).
std::optional<std::int64_t> strictNumber(std::string_view s, std::int64_t lo, std::int64_t hi) {
  if (s.empty() || s.size() > 18) return std::nullopt;
  std::int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v < lo || v > hi) return std::nullopt;
  return v;
}

} // namespace

std::string movedValue(std::string_view runId, const MovedRecord& record, std::string_view key) {
  const std::string body = movedBody(runId, record);
  return body + "\n" + markMac(key, body);
}

std::optional<MovedRecord> parseMoved(std::string_view value, std::string_view runId, std::string_view key) {
  if (value.size() > kMaxMovedSize) return std::nullopt;
  std::vector<std::string_view> f;
  for (std::size_t from = 0;;) {
    const auto nl = value.find('\n', from);
    f.push_back(value.substr(from, nl == std::string_view::npos ? std::string_view::npos : nl - from));
    if (nl == std::string_view::npos) break;
    from = nl + 1;
  }
  if (f.size() != 7 || f[0] != kMovedMagic || f[1] != runId) return std::nullopt;
  for (const auto& x : f)
    if (x.empty()) return std::nullopt;
  const auto round = strictNumber(f[2], 0, std::numeric_limits<std::int64_t>::max() / 16);
  const auto port = strictNumber(f[5], 1, 65535);
  if (!round || !port) return std::nullopt;
  MovedRecord r;
  r.round = *round;
  r.node = std::string(f[3]);
  r.addr = std::string(f[4]);
  r.port = static_cast<int>(*port);
  const std::string_view mac = f[6];
  if (key.empty()) {
    if (mac != "-" && !(mac.size() == 64 && contract::auth::fromHex(mac))) return std::nullopt;
  } else if (!sameInConstantTime(mac, markMac(key, movedBody(runId, r)))) {
    return std::nullopt;
  }
  return r;
}

std::chrono::milliseconds movedBeaconInterval(const Settings& settings) {
  return std::clamp(settings.keepAliveInterval / 2, std::chrono::milliseconds(100), std::chrono::milliseconds(1000));
}

std::chrono::milliseconds staleEndpointGuard(const Settings& settings) {
  return movedBeaconInterval(settings) + std::chrono::milliseconds(2000);
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
