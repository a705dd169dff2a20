// Store failover in the agent (--store-failover, docs/store-failover.md): the I/O around the pure
// decisions of ctorch/rdzv/c10d/failover.hpp: promoting the standby, probing, moving over, stopping.
#include "c10d_rendezvous_impl.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/state.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "log.hpp"

#include <poll.h>

#include <algorithm>
#include <set>
#include <thread>

namespace ctorch::launcher {

using std::chrono::milliseconds;

bool C10dRendezvous::Impl::failOver(const std::string& why) {
  if (!o_.storeFailover || !round_ || !executor_ || !executor_->lastState()) return false;
  // Given up from this round already (refused, or no state at the successor): the node stops;
  // trying again every tick would only hold its event loop for another mark wait each time.
  if (gaveUpRound_ == round_->round) return false;
  auto& l = log("rendezvous");
  const auto started = Clock::now();
  const rdzv::c10d::FailoverPlan plan = rdzv::c10d::planFailover(*round_);
  if (!plan.successor) {
    l.error("store failover: {}; no node of round {} has a standby store", why, round_->round);
    return false;
  }
  const auto& next = *plan.successor;
  l.warn("store failover: {}; moving to the standby store of node '{}' at {}", why, next.id,
         next.addr + ":" + std::to_string(*next.standbyPort));
  // From here on this node never uses the old store again: it moves to the successor's standby or
  // stops (it said "I lost it"; going back to the old store would let two stores be live).
  markLoss(plan);
  const bool moved = next.id == nodeId_ ? takeStoreOver(plan, started) : moveToSuccessor(next, started);
  if (!moved) gaveUpRound_ = round_->round;
  return moved;
}

void C10dRendezvous::Impl::markLoss(const rdzv::c10d::FailoverPlan& plan) {
  if (!standby_) return;
  try {
    store::TcpStoreClientOptions co;
    co.timeout = std::min(o_.operationTimeout, milliseconds(1000));
    co.operationTimeout = co.timeout;
    co.retryConnect = false;
    store::TcpStoreClient own("127.0.0.1", standby_->port(), co);
    const std::string value =
        rdzv::c10d::lossMarkValue(o_.settings.runId, *round_, nodeId_, plan, o_.failoverKey);
    own.set(rdzv::c10d::lossMarkKey(o_.settings.runId, round_->round), store::Bytes(value.begin(), value.end()));
  } catch (const std::exception& e) {
    // Unmarked, this node is not counted: the successor may then refuse, which is the safe side.
    log("rendezvous").warn("store failover: could not mark the loss in this node's standby store: {}", e.what());
  }
}

bool C10dRendezvous::Impl::lossConfirmed(const rdzv::c10d::NodeSlot& n, const rdzv::c10d::FailoverPlan& plan) const {
  try {
    store::TcpStoreClientOptions co;
    co.timeout = std::min(o_.operationTimeout, milliseconds(1000));
    co.operationTimeout = co.timeout;
    co.retryConnect = false;
    store::TcpStoreClient probe(n.addr, static_cast<std::uint16_t>(*n.standbyPort), co);
    const std::string key = rdzv::c10d::lossMarkKey(o_.settings.runId, round_->round);
    if (!probe.check({key})) return false;
    const store::Bytes v = probe.get(key);
    if (v.size() > rdzv::c10d::kMaxLossMarkSize) return false;
    return rdzv::c10d::confirmsLoss(std::string(v.begin(), v.end()), o_.settings.runId, *round_, n, plan,
                                    o_.failoverKey);
  } catch (const std::exception&) {
    return false;
  }
}

bool C10dRendezvous::Impl::takeStoreOver(const rdzv::c10d::FailoverPlan& plan, Clock::time_point started) {
  auto& l = log("rendezvous");
  if (!standby_) return false;
  // Count the nodes that lost the store too (their marks), not the ports that answer: a node that
  // still reaches the store never marks. They notice within about a heartbeat expiry of this one.
  std::set<std::string> confirmed{nodeId_};
  const auto deadline = Clock::now() + rdzv::c10d::lossMarkWait(o_.settings);
  std::optional<std::string> refused;
  for (;;) {
    for (const auto& n : rdzv::c10d::majorityProbes(*round_, nodeId_))
      if (!confirmed.count(n.id) && lossConfirmed(n, plan)) confirmed.insert(n.id);
    refused = rdzv::c10d::refuseTakeOver(*round_, confirmed);
    if (!refused || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(milliseconds(100));
  }
  if (refused) {
    l.error("store failover: {}", *refused);
    return false;
  }
  standbyServes_ = true;
  hostServer_ = std::move(standby_);
  link_->retarget(plan.successor->addr, hostServer_->port());
  link_->setPatient(true);
  try {
    executor_->seedStore(plan.lost, "its agent served the rendezvous store, which was lost");
  } catch (const std::exception& e) {
    l.error("store failover: could not re-create the rendezvous state in the standby store: {}", e.what());
    return false;
  }
  executor_->setStoreHost(true);
  executor_->setStandbyPort(std::nullopt);
  startMovedBeacon();
  l.warn("store failover: this node serves the rendezvous store now (port {}), re-created from its own "
         "copy of round {} in {}", hostServer_->port(), round_->round, measuredSeconds(since(started)));
  return true;
}

bool C10dRendezvous::Impl::moveToSuccessor(const rdzv::c10d::NodeSlot& next, Clock::time_point started) {
  // Wait for the successor to seed its standby: it notices the loss within about the same time.
  auto& l = log("rendezvous");
  const std::string target = next.addr + ":" + std::to_string(*next.standbyPort);
  link_->retarget(next.addr, *next.standbyPort);
  link_->setPatient(false);
  const std::string stateKey = rdzv::c10d::stateKey(o_.settings.runId);
  const milliseconds wait = rdzv::c10d::successorWait(o_.settings);
  const auto deadline = started + wait;
  std::string lastError = "the state was not there yet";
  for (;;) {
    try {
      if (link_->check(stateKey)) break;
    } catch (const store::StoreError& e) {
      lastError = e.what();
      link_->retarget(next.addr, *next.standbyPort);  // a failed request must not count as silence
    }
    if (Clock::now() >= deadline) {
      l.error("store failover: the standby store of node '{}' at {} held no rendezvous state within {} ({})",
              next.id, target, measuredSeconds(wait), lastError);
      return false;
    }
    std::this_thread::sleep_for(milliseconds(50));
  }
  try {
    executor_->adoptStore();
  } catch (const std::exception& e) {
    l.error("store failover: reading the re-created rendezvous state at {}: {}", target, e.what());
    return false;
  }
  l.warn("store failover: now using the rendezvous store of node '{}' at {} ({} after the loss was noticed)",
         next.id, target, measuredSeconds(since(started)));
  return true;
}

void C10dRendezvous::Impl::startMovedBeacon() {
  if (!round_ || !hostServer_) return;
  rdzv::c10d::MovedRecord r;
  r.round = round_->round;
  r.node = nodeId_;
  r.addr = announcedAddr_;
  r.port = hostServer_->port();
  MovedBeacon::Options bo;
  bo.host = o_.endpointHost;
  bo.port = o_.endpointPort;
  bo.key = rdzv::c10d::movedKey(o_.settings.runId);
  bo.value = rdzv::c10d::movedValue(o_.settings.runId, r, o_.failoverKey);
  bo.interval = rdzv::c10d::movedBeaconInterval(o_.settings);
  beacon_.reset();
  beacon_ = std::make_unique<MovedBeacon>(bo);
}

void C10dRendezvous::Impl::checkStaleEndpoint(const RendezvousRequest& request) {
  auto& l = log("rendezvous");
  const std::string key = rdzv::c10d::movedKey(o_.settings.runId);
  const auto deadline = Clock::now() + rdzv::c10d::staleEndpointGuard(o_.settings);
  bool ignored = false;
  for (;;) {
    try {
      if (link_->check(key)) {
        const std::string v = link_->get(key);
        if (auto record = rdzv::c10d::parseMoved(v, o_.settings.runId, o_.failoverKey)) {
          followMoved(*record);
          return;
        }
        if (!ignored)
          l.warn("the store at {} holds a record saying the rendezvous store of run '{}' moved, which {}: ignored",
                 link_->where(), o_.settings.runId,
                 o_.failoverKey.empty() ? "is malformed" : "is not signed with this job's CTORCH_JOB_SECRET");
        ignored = true;
      }
    } catch (const store::StoreError& e) {
      l.debug("reading the moved-store record at {}: {}", link_->where(), e.what());
    } catch (const rdzv::c10d::RendezvousStateError& e) {
      l.debug("reading the moved-store record at {}: {}", link_->where(), e.what());  // deleted meanwhile
    }
    if (Clock::now() >= deadline) return;
    if (request.stopNow()) throw RendezvousInterrupted("interrupted while waiting to join the rendezvous");
    if (request.cancelFd >= 0) {
      pollfd p{request.cancelFd, POLLIN, 0};
      if (::poll(&p, 1, 100) > 0 && request.stopNow())
        throw RendezvousInterrupted("interrupted while waiting to join the rendezvous");
    } else {
      std::this_thread::sleep_for(milliseconds(100));
    }
  }
}

void C10dRendezvous::Impl::followMoved(const rdzv::c10d::MovedRecord& record) {
  const std::string target = record.addr + ":" + std::to_string(record.port);
  const std::string what = "the rendezvous store of run '" + o_.settings.runId + "' moved to " + target +
                           " (node '" + record.node + "' took it over from round " + std::to_string(record.round) +
                           " in a store failover; this node's endpoint " + link_->where() + " is the old one)";
  // Act only on what can be verified: the store named must answer and hold this run's state.
  std::string problem;
  try {
    store::TcpStoreClientOptions co;
    co.timeout = std::min(o_.operationTimeout, milliseconds(1000));
    co.operationTimeout = co.timeout;
    co.retryConnect = false;
    store::TcpStoreClient probe(record.addr, static_cast<std::uint16_t>(record.port), co);
    if (!probe.check({rdzv::c10d::stateKey(o_.settings.runId)})) problem = "it holds no rendezvous state of this run";
  } catch (const std::exception& e) {
    problem = std::string("it does not answer (") + e.what() + ")";
  }
  if (!problem.empty())
    throw RendezvousError(what + ", but " + problem + ": not forming a second group under the same run id; start "
                          "this node with the live store's address as --rdzv-endpoint");
  // Nodes that came and went at the old endpoint are nothing to the live job.
  redirecting_ = true;
  {
    std::lock_guard<std::mutex> lock(dropMutex_);
    dropped_.clear();
  }
  const bool signpost = hostServer_ != nullptr;
  if (signpost) redirect_ = std::move(hostServer_);
  link_->retarget(record.addr, record.port);
  if (o_.localAddr.empty() && !signpost) announcedAddr_ = link_->localAddress();  // the route to the live store
  log("rendezvous").warn("{}: joining it there{}", what,
                         signpost ? "; the store this node serves at the old endpoint stays open and sends later "
                                    "nodes there too"
                                  : "");
}

std::optional<RendezvousEvent> C10dRendezvous::Impl::minority(const rdzv::c10d::RoundAssessment& a) {
  using rdzv::c10d::RoundStatus;
  if (a.status != RoundStatus::PeerLost && a.status != RoundStatus::Removed) return std::nullopt;
  auto why = minorityReason();
  if (!why) return std::nullopt;
  return RendezvousEvent{RendezvousEventKind::Failed, a.reason + ": " + *why + "; stopping its workers",
                         kLostPeerGrace};
}

std::optional<std::string> C10dRendezvous::Impl::minorityReason() const {
  if (!o_.storeFailover || !round_ || !executor_ || !executor_->lastState()) return std::nullopt;
  return rdzv::c10d::minorityReason(*round_, *executor_->lastState());
}

RendezvousEvent C10dRendezvous::Impl::cutOff(const StoreUnreachable& e) {
  std::string server;
  if (round_)
    for (const auto& n : round_->nodes)
      if (n.storeHost) server = "node '" + n.id + "' (" + n.addr + ")";
  if (server.empty()) server = "the node that serves it";
  std::string text = e.what();
  if (e.refused)
    text += "; " + server + " served the rendezvous store: that ctorchrun ended or was killed, and every node "
            "loses the store with it";
  else
    text += ": " + server + ", which serves the rendezvous store, was lost, or this node is cut off from the "
            "others (they have removed it by now)";
  if (!o_.storeFailover)
    text += ". Without --store-failover no other store takes its place: with 3 or more nodes, --store-failover "
            "keeps the nodes that still reach each other training; run the same command again to resume "
            "from the last snapshot";
  return RendezvousEvent{RendezvousEventKind::Failed, text + "; stopping its workers", kLostPeerGrace};
}

} // namespace ctorch::launcher
