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

inline constexpr int kStateVersion = 1;
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

  bool operator==(const NodeInfo& o) const {
    return id == o.id && host == o.host && addr == o.addr && nproc == o.nproc &&
           requestedRank == o.requestedRank && previousRank == o.previousRank;
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

  const Participant* participant(std::string_view id) const;
  bool isParticipant(std::string_view id) const { return participant(id) != nullptr; }
  bool inWaitList(std::string_view id) const;
  bool inRedundancyList(std::string_view id) const;
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

// "host_pid_n" as torch's _NodeDesc repr.
std::string makeNodeId(std::string_view host, long pid, int localId);

} // namespace ctorch::rdzv::c10d
