// Store failover (--store-failover, docs/store-failover.md) as pure decisions: who takes a lost
// rendezvous store over, whether it may (a majority), and when a node is on the minority side and
// must stop. No store, no probe, no clock: the agent's handler does the I/O
// (launcher/rendezvous/src/c10d_failover.cpp); the simulation test drives these on a virtual clock.
#pragma once

#include "ctorch/rdzv/c10d/decisions.hpp"
#include "ctorch/rdzv/c10d/settings.hpp"
#include "ctorch/rdzv/c10d/state.hpp"

#include <chrono>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::rdzv::c10d {

// What every survivor of the store host's loss computes, alike, from the last round it ran.
struct FailoverPlan {
  std::vector<std::string> lost;      // the nodes whose agent served the lost store
  std::optional<NodeSlot> successor;  // the first node by node rank that did not, with a standby
};
FailoverPlan planFailover(const RoundResult& round);

// The nodes the successor must reach to count a majority: the round's other nodes that did not
// serve the lost store and keep a standby (it probes their standbys).
std::vector<NodeSlot> majorityProbes(const RoundResult& round, std::string_view selfId);

// The loss mark (issue 47): a node that has lost the rendezvous store writes it, and only then,
// into its OWN standby store before it fails over; the successor counts a node towards the
// majority only when that node's standby holds a mark that confirms the loss. A node that still
// reaches the store never marks, so a port that merely answers is not a vote. The key is per run
// id and round: a mark left by an earlier failover (an older round) never counts in a later one.
std::string lossMarkKey(std::string_view runId, std::int64_t round);
// Values longer than this are refused without being parsed (anyone who reaches a standby port can
// write one).
inline constexpr std::size_t kMaxLossMarkSize = 512;
// The key that authenticates marks, from the job secret (CTORCH_JOB_SECRET, the same on every
// node): a different key per run id, and not the workers' control key.
std::string deriveFailoverKey(std::string_view secret, std::string_view runId);
// The mark `node` writes when it lost the store of `plan.lost` in `round`: its fields, and an
// HMAC-SHA256 under `key` over the run id, round, node and lost host ("-" with no key).
std::string lossMarkValue(std::string_view runId, const RoundResult& round, std::string_view node,
                          const FailoverPlan& plan, std::string_view key);
// Whether `value`, read from `probed`'s standby, confirms that `probed` lost the store of
// `plan.lost` in `round`: parsed strictly (size, field count, each field exactly as expected);
// with a key, the HMAC must verify (a mark without one, or forged, does not count); without a
// key the HMAC field is not checked (anyone who reaches the port can forge a mark: see
// docs/store-failover.md).
bool confirmsLoss(std::string_view value, std::string_view runId, const RoundResult& round,
                  const NodeSlot& probed, const FailoverPlan& plan, std::string_view key);

// Issue 58.12: a stale endpoint. After a failover the store lives at the successor's standby, and
// the job's original --rdzv-endpoint holds nothing, or - ctorchrun restarted on the old store host
// with the original command - a fresh store, where nodes started with that endpoint would form a
// second round 0 under the same run id. So the node that serves the live store writes this record
// into whatever answers at the original endpoint (every movedBeaconInterval), and a node reads it
// there before it joins its first round: it joins the live store, or refuses in one line. The key
// is per run id; the value names the live store and the round it was taken over in, with an
// HMAC-SHA256 under the failover key ("-" without a job secret), one field per line.
struct MovedRecord {
  std::int64_t round = 0;  // the round the store was taken over from
  std::string node;        // the node that serves it
  std::string addr;        // where it serves it
  int port = 0;
};
std::string movedKey(std::string_view runId);
inline constexpr std::size_t kMaxMovedSize = 512;
std::string movedValue(std::string_view runId, const MovedRecord& record, std::string_view key);
// The record `value` holds for `runId`: parsed strictly (size, field count, magic, run id, a
// round, a port in 1..65535, no empty field); with a key, the HMAC must verify. Nullopt: not a
// record to act on (garbage, another run's, unsigned or forged under a secret).
std::optional<MovedRecord> parseMoved(std::string_view value, std::string_view runId, std::string_view key);
// How often the live store's node writes the record at the original endpoint: half a heartbeat.
std::chrono::milliseconds movedBeaconInterval(const Settings& settings);
// How long a node waits, from its first contact with the store at its endpoint, before it joins
// its first round, reading the record meanwhile: one beacon interval, plus the beacon's connect
// bound (1 s: a node that served the endpoint before may be down) and 1 s for the request. Every
// node of a round waits it before joining, so the store at a stale endpoint is at least this old
// when anyone joins there: the beacon has written the record by then (if it reaches the endpoint).
std::chrono::milliseconds staleEndpointGuard(const Settings& settings);

// Whether the nodes in `confirmed` (the successor included: it lost the store itself) are a
// majority of `round`: only then may the successor take the store over (a node that is merely
// cut off must not, nor may one whose peers still reach the store). Ids not in the round do not
// count. Nullopt: it may; else why not, for the log.
std::optional<std::string> refuseTakeOver(const RoundResult& round, const std::set<std::string>& confirmed);

// How long the successor waits for the others' marks after its own: they notice the loss within
// about a heartbeat expiry of it, plus one store request and a tick.
std::chrono::milliseconds lossMarkWait(const Settings& settings);

// How long a survivor waits for the successor to re-create the state in its standby: the successor
// notices the loss up to a heartbeat expiry later, then probes the others.
std::chrono::milliseconds successorWait(const Settings& settings);

// Set when no more than half of `round`'s nodes are still in the rendezvous as `state` shows it
// (in any of its lists: a node re-joining left the round for the wait list or the next round; a
// lost node is removed from all of them): this node is cut off from the others, which may have
// taken the store over. Nullopt for a round of one node.
std::optional<std::string> minorityReason(const RoundResult& round, const State& state);

// Set when a round formed with no more than half of the previous round's nodes: the other side
// of a partition may have failed over and trains on, and two groups must never write the same
// snapshots, so only a majority of the last round may go on.
std::optional<std::string> minorityRoundReason(const RoundResult& previous, const RoundResult& formed);

} // namespace ctorch::rdzv::c10d
