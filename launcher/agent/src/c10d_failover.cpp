// Store failover in the agent (--store-failover, docs/store-failover.md): the I/O around the pure
// decisions of ctorch/rdzv/c10d/failover.hpp: promoting the standby, probing, moving over, stopping.
#include "c10d_rendezvous_impl.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/rdzv/c10d/state.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "log.hpp"

#include <algorithm>
#include <thread>

namespace ctorch::launcher {

using std::chrono::milliseconds;

bool C10dRendezvous::Impl::failOver(const std::string& why) {
  if (!o_.storeFailover || !round_ || !executor_ || !executor_->lastState()) return false;
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
  if (next.id == nodeId_) return takeStoreOver(plan, started);
  return moveToSuccessor(next, started);
}

bool C10dRendezvous::Impl::takeStoreOver(const rdzv::c10d::FailoverPlan& plan, Clock::time_point started) {
  auto& l = log("rendezvous");
  if (!standby_) return false;
  int reachable = 1;
  for (const auto& n : rdzv::c10d::majorityProbes(*round_, nodeId_))
    if (answers(n.addr, *n.standbyPort)) ++reachable;
  if (auto refused = rdzv::c10d::refuseTakeOver(*round_, reachable)) {
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

bool C10dRendezvous::Impl::answers(const std::string& host, int port) const {
  try {
    store::TcpStoreClientOptions co;
    co.timeout = std::min(o_.operationTimeout, milliseconds(1000));
    co.operationTimeout = co.timeout;
    co.retryConnect = false;
    store::TcpStoreClient probe(host, static_cast<std::uint16_t>(port), co);
    probe.check({"ctorchrun.probe"});
    return true;
  } catch (const std::exception&) {
    return false;
  }
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
