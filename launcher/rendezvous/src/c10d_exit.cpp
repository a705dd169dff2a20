// The end of a c10d job in the agent: the exit barrier (wait, bounded, for the other nodes to
// finish), leaving or closing the rendezvous, and the store host waiting for the others to leave.
#include "c10d_rendezvous_impl.hpp"

#include "log.hpp"

#include <thread>

namespace ctorch::launcher {

std::optional<RendezvousEvent> C10dRendezvous::Impl::exitBarrier(milliseconds timeout) {
  armTimer(false);
  if (!executor_ || !round_ || round_->nodeCount <= 1) return std::nullopt;
  const std::string key = "ctorchrun.exit/" + o_.settings.runId + "/" + std::to_string(round_->round);
  auto& l = log("rendezvous");
  link_->setPatient(true);
  try {
    link_->add(key, 1);
    auto deadline = Clock::now() + timeout;
    for (;;) {
      if (link_->add(key, 0) >= round_->nodeCount) return std::nullopt;
      removeDropped();
      auto a = executor_->keepAlive();
      if (a.status == rdzv::c10d::RoundStatus::PeerFailed)
        return RendezvousEvent{RendezvousEventKind::RemoteFailure, a.reason, std::nullopt};
      if (a.status == rdzv::c10d::RoundStatus::PeerLost || a.status == rdzv::c10d::RoundStatus::Removed ||
          a.status == rdzv::c10d::RoundStatus::Superseded || a.status == rdzv::c10d::RoundStatus::Closed) {
        l.warn("exit barrier: {}; not waiting for the other nodes", a.reason);
        return std::nullopt;
      }
      if (Clock::now() >= deadline) {
        l.warn("exit barrier: only {} of {} nodes finished within {}; exiting anyway",
               link_->add(key, 0), round_->nodeCount, measuredSeconds(timeout));
        return std::nullopt;
      }
      std::this_thread::sleep_for(o_.tick);
    }
  } catch (const std::exception& e) {
    l.warn("exit barrier: {}", e.what());
  }
  return std::nullopt;
}

void C10dRendezvous::Impl::shutdown(AgentOutcome outcome) {
  armTimer(false);
  auto& l = log("rendezvous");
  if (link_ && executor_) {
    link_->setPatient(outcome != AgentOutcome::Interrupted);
    try {
      if (outcome == AgentOutcome::Interrupted) {
        executor_->leave();  // the others re-form without this node if enough remain
      } else {
        executor_->close();  // the job is over (done or failed): nobody may join any more
      }
    } catch (const std::exception& e) {
      l.debug("leaving the rendezvous: {}", e.what());
    }
    if (!hostServer_) {
      try {
        link_->setPatient(false);
        link_->dropAliveKey();
      } catch (const std::exception&) {
      }
    }
    if (hostServer_ && outcome != AgentOutcome::Interrupted) waitForPeersToLeave();
  }
  if (link_) link_->disconnect();
  workerStore_.reset();
  hostServer_.reset();
}

void C10dRendezvous::Impl::waitForPeersToLeave() {
  auto deadline = Clock::now() + o_.settings.closeTimeout;
  while (hostServer_->ephemeralKeyCount() > 1) {
    if (Clock::now() >= deadline) {
      log("rendezvous").warn("{} other agent(s) still connected to the rendezvous store hosted here "
                             "after {}; shutting it down (they lose the store)",
                             hostServer_->ephemeralKeyCount() - 1, measuredSeconds(o_.settings.closeTimeout));
      return;
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
}

} // namespace ctorch::launcher
