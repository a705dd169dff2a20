// The shared state of a c10d dynamic rendezvous: one JSON document per run id in the store,
// changed only by compare-and-set against the value read before (the fencing token). JSON, not
// torch's pickle, so that any language can read it; versioned, so a newer layout is refused
// clearly instead of misread. See docs/rendezvous.md for the layout.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::rdzv::c10d {

// Wall-clock milliseconds: deadlines and heartbeats are compared across machines, as in torch
// (whose state holds datetime.utcnow() values); the machines' clocks must agree to well within
// the heartbeat expiry (15 s by default).
using Timestamp = std::chrono::time_point<std::chrono::system_clock, std::chrono::milliseconds>;

// Version 2 added restarts, failure, expected, round_size and store_port; version 3 added
// announced (the scalable join); version 4 a node's standby_port and store_host (store failover).
// Versions 1 to 3 are still read.
inline constexpr int kStateVersion = 4;
inline constexpr const char* kStateFormat = "ctorchrun-rdzv";
// The store value meaning "no state yet". A store's get() blocks until a key exists, so the key is
// created with this sentinel first (torch uses "Y2FuaW1hZGFt" the same way).
inline constexpr const char* kNoStateSentinel = "ctorchrun-rdzv:none";

// The store key of a run's state. Different run ids never share a key, so never mix.
std::string stateKey(std::string_view runId);

// What a node (one agent process) tells the others about itself.
struct NodeInfo {
  std::string id;    // unique per agent incarnation: "<host>_<pid>_<n>" (torch's _NodeDesc)
  std::string host;  // host name, for logs
  std::string addr;  // address the other nodes reach this node at
  int nproc = 1;     // workers on this node (--nproc-per-node); nodes may differ
  std::optional<int> requestedRank;  // --node-rank or SLURM_NODEID: honoured when possible
  std::optional<int> previousRank;   // its node rank in the last round it completed
  // Port of the workers' store this node hosts for the round (a fresh one for every round it
  // joins); the workers of a round use node rank 0's (MASTER_ADDR = its addr).
  std::optional<int> storePort;
  // Store failover (ctorchrun --store-failover): the port of the standby rendezvous store this
  // node's agent keeps ready at `addr`, and whether this node's agent serves the rendezvous store
  // now (the one node whose loss makes the others fail over to the next node's standby).
  std::optional<int> standbyPort;
  bool storeHost = false;

  bool operator==(const NodeInfo& o) const {
    return id == o.id && host == o.host && addr == o.addr && nproc == o.nproc &&
           requestedRank == o.requestedRank && previousRank == o.previousRank &&
           storePort == o.storePort && standbyPort == o.standbyPort && storeHost == o.storeHost;
  }
};

// A worker failure reported by a node for a round: the other nodes restart their workers too,
// and the restart is counted once for the whole job.
struct Failure {
  std::int64_t round = 0;
  std::string node;    // the reporting node's id
  std::string reason;  // "rank 3 exited with code 1"

  bool operator==(const Failure& o) const {
    return round == o.round && node == o.node && reason == o.reason;
  }
};

struct Participant {
  NodeInfo node;
  std::int64_t joinSeq = 0;  // order of joining (across rounds)
  int rank = -1;             // node rank, assigned when the round closes

  bool operator==(const Participant& o) const {
    return node == o.node && joinSeq == o.joinSeq && rank == o.rank;
  }
};

struct State {
  std::string runId;
  std::int64_t round = 0;
  bool complete = false;  // the round is closed: ranks assigned, workers may start
  bool closed = false;    // the whole rendezvous is over: nobody may join any more
  std::optional<Timestamp> lastCallDeadline;  // set once MIN nodes joined an open round
  std::int64_t nextJoinSeq = 0;
  std::vector<Participant> participants;      // in join order
  std::vector<std::string> waitList;          // node ids waiting for the next round (scale up)
  std::vector<std::string> redundancyList;    // spare node ids while the round is full
  std::map<std::string, Timestamp> heartbeats;  // last heartbeat of every node above
  // Counted restarts of the job's worker groups so far (TORCHELASTIC_RESTART_COUNT of a round
  // that starts now); shared so that every node gives its workers the same count.
  std::int64_t restarts = 0;
  std::optional<Failure> failure;             // reported in the current round, if any
  // Participants when the round closed: a complete round with fewer is broken (a node left or
  // died before every node had started), so a node that finds it so must not start its workers.
  int roundSize = 0;
  // An open round that follows a complete one waits for these nodes (the previous round's
  // nodes re-joining and the nodes that waited for it) and closes as soon as they all joined,
  // without a last call. Empty for a first round.
  std::vector<std::string> expected;
  // The scalable join (executor.hpp): nodes announce themselves under numbered keys beside the
  // state and one node admits them in a batch; the announcements up to this number are consumed.
  std::int64_t announced = 0;

  const Participant* participant(std::string_view id) const;
  bool isParticipant(std::string_view id) const { return participant(id) != nullptr; }
  bool inWaitList(std::string_view id) const;
  bool inRedundancyList(std::string_view id) const;
  bool isExpected(std::string_view id) const;
  int participantCount() const { return static_cast<int>(participants.size()); }

  bool operator==(const State& o) const;
  bool operator!=(const State& o) const { return !(*this == o); }
};

// The initial state of a run (round 0, open, nobody).
State freshState(std::string runId);

// JSON text of the state (deterministic: same state, same bytes).
std::string encodeState(const State& state);
// Parses a state; throws RendezvousStateError naming what is wrong (not JSON, missing field,
// unknown format, version newer than kStateVersion).
State decodeState(std::string_view text);
// A store value: nullopt for the sentinel, else decodeState.
std::optional<State> decodeStoreValue(std::string_view value);

// ---- the scalable join: announcements beside the state ------------------------------------------------
// A node that wants to join an open round takes a number from the counter at announceCountKey
// (c10d add) and writes its NodeInfo and the round under announceKey(number); the round's
// designated writer admits every pending announcement with one compare-and-set (see
// admitAnnounced in decisions.hpp). phaseKey counts the state writes that end a wait (a round
// closing, a node leaving or removed, a failure, the close): waiting nodes poll that small
// counter instead of re-reading the whole state.
struct Announcement {
  std::int64_t round = 0;
  NodeInfo node;
  bool operator==(const Announcement& o) const { return round == o.round && node == o.node; }
};
std::string announceCountKey(std::string_view runId);
std::string announceKey(std::string_view runId, std::int64_t number);
std::string phaseKey(std::string_view runId);
// A node's heartbeat (milliseconds since the epoch, decimal) with the scalable join's store.
std::string heartbeatKey(std::string_view runId, std::string_view nodeId);
std::string encodeAnnouncement(const Announcement& a);
// nullopt for anything that is not a valid announcement (never throws: a store value written by
// a confused or hostile client is skipped, not fatal).
std::optional<Announcement> decodeAnnouncement(std::string_view text);

// "host_pid_n" as torch's _NodeDesc repr.
std::string makeNodeId(std::string_view host, long pid, int localId);

} // namespace ctorch::rdzv::c10d
