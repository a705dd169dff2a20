// Store failover (--store-failover, docs/store-failover.md) as pure decisions: who takes a lost
// rendezvous store over, whether it may (a majority), and when a node is on the minority side and
// must stop. No store, no probe, no clock: the agent's handler does the I/O
// (launcher/agent/src/c10d_failover.cpp); the simulation test drives these on a virtual clock.
#pragma once

#include "ctorch/rdzv/c10d/decisions.hpp"
#include "ctorch/rdzv/c10d/settings.hpp"
#include "ctorch/rdzv/c10d/state.hpp"

#include <chrono>
#include <optional>
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

// Whether `reachable` nodes (the successor included) are a majority of `round`: only then may the
// successor take the store over (a node that is merely cut off must not). Nullopt: it may; else
// why not, for the log.
std::optional<std::string> refuseTakeOver(const RoundResult& round, int reachable);

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
