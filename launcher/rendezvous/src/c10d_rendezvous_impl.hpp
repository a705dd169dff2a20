// The c10d rendezvous handler's state (C10dRendezvous::Impl), shared by the files that each hold
// one of its concerns: the handler (c10d_rendezvous.cpp), store failover (c10d_failover.cpp) and
// the end of a job (c10d_exit.cpp). The store link and the clock have their own files.
#pragma once

#include "agent_clock.hpp"
#include "ctorch/launcher/c10d_rendezvous.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"
#include "ctorch/rdzv/c10d/failover.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "moved_beacon.hpp"
#include "store_link.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher {

class C10dRendezvous::Impl {
 public:
  using milliseconds = std::chrono::milliseconds;
  using Clock = std::chrono::steady_clock;

  explicit Impl(C10dRendezvousOptions options);
  ~Impl();

  int eventFd() const { return epollFd_; }
  bool hostsStore() const { return hostServer_ != nullptr; }

  RendezvousInfo next(const RendezvousRequest& request);
  std::optional<RendezvousEvent> takeEvent();
  void reportFailure(const std::string& reason);
  std::optional<RendezvousEvent> exitBarrier(milliseconds timeout);
  void shutdown(AgentOutcome outcome);

 private:
  // ---- the handler (c10d_rendezvous.cpp)
  void setUp(const RendezvousRequest& request);
  // The rendezvous store's options (also its standby's): agents' alive keys are ephemeral.
  store::TcpStoreServerOptions hostOptions();
  void makeExecutor(const RendezvousRequest& request);
  // Where a store this node serves listens: where it is announced (`announced`) when the endpoint
  // is on the loopback (every node is on this machine: nobody else needs to reach it); else every
  // interface ("").
  std::string loopbackBind(const std::string& announced) const;
  // The round the executor forms, with failover while it does; throws the launcher's errors.
  rdzv::c10d::RoundResult formRound(const RendezvousRequest& request);
  std::string aliveKey(const std::string& node) const;
  // Server thread: an agent's connection closed while its alive key was set.
  void onAliveKeyLost(const std::string& key);
  void removeDropped();
  std::optional<RendezvousEvent> eventFor(const rdzv::c10d::RoundAssessment& a);
  [[noreturn]] void translate();
  void armTimer(bool on);
  static void drain(int fd);

  // ---- store failover (c10d_failover.cpp)
  // --store-failover: the store did not answer for the heartbeat expiry. The survivors of the
  // last round move to the standby store of its first node (by node rank) that did not serve the
  // lost store; that node re-creates the rendezvous state there from its own copy, without the
  // lost store host's nodes, if a majority of the round (itself included) confirm by their loss
  // marks that they lost the store too: a node that is merely cut off must not take the store
  // over, nor one whose peers still reach the store. True when this node now uses the new
  // store; false (logged) when it cannot (then it is cut off, as without failover).
  bool failOver(const std::string& why);
  // The successor's part of failOver: promote the standby and seed it.
  bool takeStoreOver(const rdzv::c10d::FailoverPlan& plan, Clock::time_point started);
  // Another survivor's part: wait for the successor's standby to hold the state, then adopt it.
  bool moveToSuccessor(const rdzv::c10d::NodeSlot& successor, Clock::time_point started);
  // Writes this node's loss mark (rdzv::c10d::lossMarkValue) into its own standby store; the
  // successor counts it towards the majority. Only called once the store is lost.
  void markLoss(const rdzv::c10d::FailoverPlan& plan);
  // Whether node `n`'s standby holds a mark that confirms it lost the store too (rdzv::c10d::confirmsLoss).
  bool lossConfirmed(const rdzv::c10d::NodeSlot& n, const rdzv::c10d::FailoverPlan& plan) const;
  // Issue 58.12, before this node joins its first round (--store-failover): reads, for the stale
  // endpoint guard (rdzv::c10d::staleEndpointGuard), whether the store at its endpoint says the
  // run's store moved (rdzv::c10d::parseMoved); if so, joins the live store there (followMoved).
  void checkStaleEndpoint(const RendezvousRequest& request);
  // Joins the store a moved record names when it holds this run's rendezvous state; else refuses
  // in one line (RendezvousError): never a second round under the same run id. A store this node
  // serves at the old endpoint stays open, as a signpost for later nodes (redirect_).
  void followMoved(const rdzv::c10d::MovedRecord& record);
  // The successor, once it serves the store: writes the moved record at the original endpoint.
  void startMovedBeacon();
  // --store-failover: a node whose round lost a majority of its nodes stops (the majority side
  // may have failed over to another store and trains on without it).
  std::optional<RendezvousEvent> minority(const rdzv::c10d::RoundAssessment& a);
  // Set when, with --store-failover, no more than half of the last round's nodes are still in the
  // rendezvous as this node sees it (rdzv::c10d::minorityReason).
  std::optional<std::string> minorityReason() const;
  // The rendezvous store stopped answering and no failover took its place. Says which node served
  // it, what the silence can mean, and (without --store-failover) what would have survived it.
  RendezvousEvent cutOff(const StoreUnreachable& e);

  // ---- the end of a job (c10d_exit.cpp)
  // Only after success or a failure of the whole job: the other agents still need the store to
  // pass the exit barrier and close, and agents of other jobs (other --rdzv-id on the same
  // endpoint) may still use it. Wait (bounded by close_timeout) until every other agent's
  // connection is gone: each holds one ephemeral key, this agent the last one.
  void waitForPeersToLeave();

  C10dRendezvousOptions o_;
  std::string nodeId_;
  int timerFd_ = -1, dropFd_ = -1, epollFd_ = -1;
  AgentClock clock_;
  std::unique_ptr<store::TcpStoreServer> hostServer_;
  std::unique_ptr<store::TcpStoreServer> standby_;  // --store-failover, until promoted
  // The store this node served at a stale endpoint before it followed a moved record: it only
  // shows later nodes the way (its agents' dropped connections mean nothing to this job).
  std::unique_ptr<store::TcpStoreServer> redirect_;
  std::atomic<bool> redirecting_{false};
  std::unique_ptr<MovedBeacon> beacon_;  // this node took the store over: tell the old endpoint
  std::atomic<bool> standbyServes_{false};
  std::unique_ptr<StoreLink> link_;
  std::string announcedAddr_;  // how the other nodes reach this one (set up with link_)
  std::unique_ptr<rdzv::c10d::Executor> executor_;
  std::unique_ptr<store::TcpStoreServer> workerStore_;
  std::optional<rdzv::c10d::RoundResult> round_;
  std::optional<std::int64_t> gaveUpRound_;  // a failover from this round failed: no second try
  bool eventSent_ = false;
  std::mutex dropMutex_;
  std::vector<std::string> dropped_;
};

// Keys under this prefix are ephemeral in the native store (deleted when the connection that
// wrote them closes): every agent keeps "<prefix><run id>/<node id>" there, so the store host
// learns at once when an agent's connection drops.
inline constexpr const char* kAliveKeyPrefix = "ctorchrun.alive/";

} // namespace ctorch::launcher
