// The job's coordinator for in-place recovery, as pure decisions: which process holds each rank,
// who waits in a re-form, when the group is re-formed at the next generation, which silent process
// its agent must kill, whether every rank can recover in place. Its only inputs are messages from
// peers that proved the job's key (control_plane.hpp does the proving), so nothing here can be
// steered by what a stranger writes into the c10d store. Peers are connection ids; time is given.
// No sockets, no threads, no clocks read here: tests drive it message by message.
#pragma once

#include "ctorch/contract/control_protocol.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace ctorch::control {

using contract::control::Message;
using contract::control::Type;
using PeerId = std::uint64_t;
using Clock = std::chrono::steady_clock;

struct Outgoing {
  PeerId peer = 0;
  Message message;
  bool close = false;  // close the peer's connection after this message
};

class Coordinator {
 public:
  // `log` receives one line per notable event (a re-form, an eviction, a refusal).
  explicit Coordinator(std::function<void(const std::string&)> log = {});

  // `peer` proved the key and said who it is (Type::kHello). A worker is welcomed once its agent
  // registered its process (incarnation); every other peer at once, or refused.
  void hello(PeerId peer, const Message& hello, Clock::time_point now, std::vector<Outgoing>& out);
  // A message from a welcomed peer.
  void message(PeerId peer, const Message& m, Clock::time_point now, std::vector<Outgoing>& out);
  // The peer's connection closed.
  void closed(PeerId peer, std::vector<Outgoing>& out);

  std::int64_t generation() const { return generation_; }
  int worldSize() const { return world_; }
  // Processes ordered killed so far (for tests).
  int killsOrdered() const { return kills_; }
  // -1: not every rank said whether it can recover in place; 1: every rank can; 0: one cannot.
  int capability() const { return capability_; }

  // A peer may not have more unwelcomed workers waiting than this (4 per rank, plus some).
  std::size_t maxPending() const { return 4 * static_cast<std::size_t>(world_) + 64; }

 private:
  enum class Role { kAgent, kWorker, kSpare };
  enum class Phase {
    kUnknown,   // no process registered yet
    kRunning,   // computing in the formed generation
    kStarting,  // a replacement (or a spare given the rank) that has not joined yet
    kWaiting,   // a survivor waiting for the group to re-form
    kJoining,   // a replacement waiting for the group to re-form
    kGone,      // its process's connection closed (it died); a replacement will be registered
  };
  struct Peer {
    Role role = Role::kWorker;
    bool welcomed = false;
    int rank = -1;  // a worker's
    std::uint64_t incarnation = 0;
    int node = -1;  // an agent's or a spare's
    std::string spareId;
    long pid = 0;
  };
  struct Node {
    PeerId peer = 0;
    int firstRank = 0;
    int count = 0;
  };
  struct Rank {
    std::uint64_t incarnation = 0;
    Clock::time_point registeredAt{};
    PeerId peer = 0;
    Phase phase = Phase::kUnknown;
    bool holdsState = false;
    std::uint64_t killed = 0;  // the incarnation last ordered killed
    int declared = -1;         // -1: not yet, 0: cannot recover in place, 1: can
    bool built = false;        // built the group of the generation last formed
  };

  void helloAgent(PeerId peer, Peer& p, const Message& hello, std::vector<Outgoing>& out);
  void helloWorker(PeerId peer, Peer& p, const Message& hello, std::vector<Outgoing>& out);
  void helloSpare(PeerId peer, Peer& p, const Message& hello, std::vector<Outgoing>& out);
  // The spare `peer` takes rank `assign.rank` over (kAssign sent to it).
  void handOver(PeerId peer, Peer& p, const Message& assign, std::vector<Outgoing>& out);
  void fromAgent(Peer& p, const Message& m, Clock::time_point now, std::vector<Outgoing>& out);
  void fromWorker(PeerId peer, Peer& p, const Message& m, Clock::time_point now, std::vector<Outgoing>& out);
  void registerProcess(int rank, std::uint64_t incarnation, bool replacement, Clock::time_point now);
  void welcomePending(int rank, std::vector<Outgoing>& out);
  void declare(int rank, const Message& m, std::vector<Outgoing>& out);
  void evictSilent(PeerId requester, std::chrono::milliseconds grace, Clock::time_point now, std::vector<Outgoing>& out);
  void tryForm(std::vector<Outgoing>& out);
  // Rank `rank` built the group of `generation`: once every rank did, its agents hear kReformed.
  void built(int rank, std::int64_t generation, std::vector<Outgoing>& out);
  void toAgentOf(int rank, Message m, std::vector<Outgoing>& out) const;
  void toAgents(const Message& m, std::vector<Outgoing>& out) const;
  void refuse(PeerId peer, const std::string& why, std::vector<Outgoing>& out);
  void welcome(PeerId peer, std::vector<Outgoing>& out) const;
  Message capabilityMessage() const;
  // Logs `line` once per `kind` (a refused value costs a counter, not a line each time).
  void logOnce(const std::string& kind, const std::string& line);
  void logLine(const std::string& line) const {
    if (log_) log_(line);
  }
  bool inReform(const Rank& r) const { return r.phase == Phase::kWaiting || r.phase == Phase::kJoining; }

  std::function<void(const std::string&)> log_;
  std::map<PeerId, Peer> peers_;
  std::map<int, Node> nodes_;
  std::vector<Rank> ranks_;
  int world_ = 0;
  std::int64_t generation_ = 0;
  bool awaitingBuild_ = false;  // generation_ was formed and not every rank has built it yet
  int capability_ = -1;  // -1: not every rank said; 1: every rank can; 0: one cannot
  int incapableRank_ = -1;
  std::string incapableWhy_;
  int kills_ = 0;
  std::map<std::string, std::uint64_t> logged_;  // kinds of refusals logged, and how often each came
  // Ranks given to spares that had not connected yet (node, spare id, incarnation -> kAssign):
  // delivered when that spare says hello. At most maxPending().
  std::map<std::tuple<int, std::string, std::uint64_t>, Message> pendingAssignments_;
};

} // namespace ctorch::control
