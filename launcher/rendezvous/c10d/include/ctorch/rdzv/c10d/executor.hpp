// The one place where the c10d rendezvous does I/O: reads the shared state from a store, asks a
// decision function (decisions.hpp) what to do, compare-and-sets the new state, sleeps, repeats.
// The store and the clock are small interfaces, so the same executor runs against the native
// TCPStore client in ctorchrun and against an in-memory map with a virtual clock in tests.
#pragma once

#include "ctorch/rdzv/c10d/decisions.hpp"
#include "ctorch/rdzv/c10d/settings.hpp"
#include "ctorch/rdzv/c10d/state.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::rdzv::c10d {

// The part of c10d's Store the rendezvous needs. Implementations throw on connection errors
// (the executor lets those through: the agent decides what a lost store means).
class CasStore {
 public:
  virtual ~CasStore() = default;
  // c10d compareSet: if the value at `key` equals `expected` (a missing key equals ""), store
  // `desired`. Returns the value stored afterwards (for a missing key and a non-empty `expected`,
  // c10d returns `expected` and stores nothing).
  virtual std::string compareSet(const std::string& key, const std::string& expected,
                                 const std::string& desired) = 0;
  // The value at `key` (blocking until it exists, as c10d's get).
  virtual std::string get(const std::string& key) = 0;

  // The scalable join needs four more c10d operations. A store that has them returns true here;
  // with one that does not, every node joins by compare-and-set on the whole state (torch's way:
  // fine for tens of nodes, hopeless for hundreds).
  virtual bool supportsAnnouncements() const { return false; }
  virtual std::int64_t add(const std::string& key, std::int64_t delta);  // c10d add (creates at 0)
  virtual void set(const std::string& key, const std::string& value);
  virtual bool check(const std::string& key);                           // does the key exist?
  virtual void deleteKey(const std::string& key);
  // Several keys in one request where the store can (defaults: one request per key). getMany
  // waits for missing keys as get does: call it on keys checkAll found.
  virtual bool checkAll(const std::vector<std::string>& keys);
  virtual std::vector<std::string> getMany(const std::vector<std::string>& keys);
};

class Clock {
 public:
  virtual ~Clock() = default;
  virtual Timestamp now() = 0;                               // wall clock, shared in the state
  virtual std::chrono::steady_clock::time_point steadyNow() = 0;  // local deadlines
  virtual void sleepFor(std::chrono::milliseconds d) = 0;
};

// std::chrono::system_clock / steady_clock / this_thread::sleep_for.
Clock& systemClock();

struct ExecutorOptions {
  // How often a waiting node reads the state again (torch: 1 s). A failed compare-and-set
  // retries at once with the value it returned.
  std::chrono::milliseconds pollInterval{100};
  // The scalable join: how long a pending announcement, or a write only the round's designated
  // writer should make (close the round, open its last call), may wait for that writer before
  // the next node in line makes it (the k-th after (k + 1) times this: the designated writer
  // died or hangs; a dead one is soon removed by its expired heartbeat); and how often a waiting node reads
  // the whole state even if the phase counter did not move (a writer that died between its
  // write and the counter's increment).
  std::chrono::milliseconds takeOverAfter{2000};
  std::chrono::milliseconds fullReadEvery{1000};
  // Receives one line per state change this node made or saw ("joined round 3 ..."), if set.
  std::function<void(const std::string&)> log;
};

class Executor {
 public:
  // `self.previousRank` is managed here (set after each completed round).
  Executor(CasStore& store, Settings settings, NodeInfo self, Clock& clock = systemClock(),
           ExecutorOptions options = {});

  // Leaves the previous round if any, joins the next and blocks until it is complete.
  // Throws RendezvousTimeout / RendezvousClosed / RendezvousGracefulExit / RendezvousStateError.
  RoundResult nextRound();
  // One heartbeat if due (call at least every keepAliveInterval / 2) and removal of expired
  // nodes; then how the current round is doing.
  RoundAssessment keepAlive();
  // Read-only look at the current round.
  RoundAssessment assess();
  // Nodes waiting to join while there is room (torch's num_nodes_waiting).
  int numNodesWaiting();
  // Marks the rendezvous closed for everyone (shutdown after success). Throws RendezvousTimeout.
  void close();
  // Takes this node out of the rendezvous for good without closing it (the others re-form
  // without it if enough remain).
  void leave();
  // This node's workers failed in the round it runs: the other nodes restart theirs and the job
  // counts one restart. False when there was nothing to report (the round moved on, or another
  // node reported this round's failure first).
  bool reportFailure(const std::string& reason);
  // Removes other nodes at once (their agents' store connections dropped). False: none left.
  bool removeNodes(const std::vector<std::string>& ids, const std::string& why);
  // The workers' store this node would host if it became node rank 0 (sent when joining).
  void setStorePort(std::optional<int> port) { self_.storePort = port; }
  // Store failover: this node's standby store, and whether it serves the rendezvous store (both
  // sent when joining the next round).
  void setStandbyPort(std::optional<int> port) { self_.standbyPort = port; }
  void setStoreHost(bool host) { self_.storeHost = host; }
  // Store failover. The store behind this executor's CasStore was replaced by an empty one (the
  // rendezvous store's host was lost; this node now serves its standby): writes the state as this
  // node last saw it there, with every heartbeat renewed (the survivors get a full expiry to
  // reconnect) and `lost` removed (PeerLost for the others: they re-form), and the announcement
  // counter where the state expects it. False when this node never saw a state.
  bool seedStore(const std::vector<std::string>& lost, const std::string& why);
  // Store failover, on the other nodes: the store behind the CasStore is now another node's (which
  // seeded it); forget what belonged to the old one (counters, pending announcement) and read.
  void adoptStore();

  const NodeInfo& self() const { return self_; }
  const Settings& settings() const { return settings_; }
  const std::optional<RoundResult>& lastRound() const { return lastRound_; }
  // The state as last read or written (for logs and tests).
  const std::optional<State>& lastState() const { return state_; }

 private:
  using DecideFn = std::function<Decision(const std::optional<State>&, const NodeView&)>;
  struct RunMode {
    bool resetDeadlineOnSpareExit = false;  // a spare that finds room starts the timeout afresh
    bool oneShot = false;                   // RemoveDead returns once its write landed
    bool joining = false;                   // the scalable join's announcements and heartbeats
    // The state this executor read or wrote a moment ago in the same call (the exit before the
    // join, the keep-alive after a read): decide on it instead of reading it again.
    bool stateIsFresh = false;
  };
  // Decides and writes until the decision is Finish (or a one-shot write landed: ReportFailure,
  // Leave, and RemoveDead when `oneShot`).
  Decision run(const DecideFn& decide, std::chrono::milliseconds timeout, RunMode mode);
  Decision run(const DecideFn& decide, std::chrono::milliseconds timeout) { return run(decide, timeout, RunMode()); }
  void read();
  // Sleeps one poll interval, then reads the state again: at once with a store that cannot
  // announce, else only when the phase counter moved or the last full read is fullReadEvery old.
  void waitForChange();
  // The scalable join: admits pending announcements when this node is the one to (the round's
  // designated writer, the holder of the first pending announcement, or anyone once they waited
  // takeOverAfter). True when it wrote or lost a race (the state changed: decide again).
  bool admitIfDue(const NodeView& view);
  // Announces this node for the state's round unless its announcement for it is still pending.
  void announce();
  void bumpPhase();
  // This node's turn to write for the open round in `s`: 0 = its designated writer (the
  // participant that joined first; with none, the holder of the first pending announcement).
  int writerSlot(const State& s) const;
  static constexpr int kNeverWrites = 1 << 20;  // the slot of a node neither in the round nor announced
  std::chrono::milliseconds takeOverDelay(const State& s) const;
  // Heartbeats under per-node keys (a store with the scalable join's operations and
  // keep_alive_max_attempt >= 2): each node SETs heartbeatKey(run, id) once per interval; the
  // round's monitor (its first participant, else the first node with a heartbeat) merges every
  // node's key into the state once per interval and removes the expired; the others only watch
  // the monitor's key and remove the monitor when it, too, expired.
  static std::string monitorOf(const State& s);
  bool isMonitor() const;
  void beatIfDue(bool force);
  std::optional<Timestamp> readBeat(const std::string& id);
  bool beatIsFresh(const std::string& id);
  std::optional<Decision> removeDeadMonitor(const NodeView& view);
  bool monitorIfDue(bool force);
  void pruneAnnouncements();
  // A random pause after a heartbeat lost its compare-and-set, in [1, min(interval / 8, 250 ms)].
  std::chrono::milliseconds heartbeatBackoff();
  void ensureKey();
  void log(const std::string& line) const;

  CasStore& store_;
  Settings settings_;
  NodeInfo self_;
  Clock& clock_;
  ExecutorOptions options_;
  std::string key_;
  bool keyReady_ = false;
  std::string raw_;                 // the store value last seen (the compare-and-set token)
  std::optional<State> state_;
  std::optional<RoundResult> lastRound_;
  // The scalable join (see admitIfDue).
  bool announcing_ = false;
  std::string countKey_, phaseKey_;
  std::int64_t myNumber_ = 0;          // this node's pending announcement, if myRound_ >= 0
  std::int64_t myRound_ = -1;
  std::int64_t phaseSeen_ = -1;
  std::chrono::steady_clock::time_point lastFullRead_{};
  std::chrono::steady_clock::time_point nextCountCheck_{};
  std::optional<std::chrono::steady_clock::time_point> pendingSince_;  // announcements left pending
  std::int64_t pendingAt_ = -1;                                        // ... at this `announced`
  std::optional<std::chrono::steady_clock::time_point> missingSince_;  // a number taken, never written
  std::int64_t missingNumber_ = -1;
  std::optional<std::chrono::steady_clock::time_point> deferredSince_;  // a designated write left to its writer
  std::uint64_t backoffState_ = 0;
  bool heartbeatKeys_ = false;
  std::optional<Timestamp> lastBeatSent_;
  std::chrono::steady_clock::time_point lastMerge_{};
  std::chrono::steady_clock::time_point lastMonitorCheck_{};
  std::int64_t pruneFrom_ = 1;  // the next consumed announcement number to delete
};

} // namespace ctorch::rdzv::c10d
