#include "ctorch/launcher/group_monitor.hpp"

#include "ctorch/contract/worker_contract.hpp"

#include <algorithm>
#include <csignal>

namespace ctorch::launcher {

namespace {
constexpr int kExitPreempted = contract::kExitPreempted;
} // namespace

GroupMonitor::GroupMonitor(int numWorkers, std::chrono::milliseconds shutdownTimeout, int replacements)
    : numWorkers_(numWorkers), shutdownTimeout_(shutdownTimeout), replacements_(replacements) {}

MonitorActions GroupMonitor::beginStop(Reason reason, int signo) {
  reason_ = reason;
  stopSignal_ = signo;
  MonitorActions a;
  a.signalWorkers = signo;
  a.armGrace = shutdownTimeout_;
  return a;
}

MonitorActions GroupMonitor::onWorkerExit(const WorkerExit& e, bool replaceable, bool joinedReform) {
  ++exited_;
  if (stopping()) {
    // Stopped by us: it ended the way a stop ends a worker (our signal, SIGKILL, 128+signal, or
    // exit 75 after saving its state). Anything else while stopping after a failure is a failure
    // of its own (e.g. exit 1 from a peer's broken connection), as torchrun lists it.
    const ExitStatus& st = e.status;
    bool stopLike = st.signal == stopSignal_ || st.signal == SIGKILL ||
                    (st.signal == 0 && st.execErrno == 0 &&
                     (st.exitCode == 128 + stopSignal_ || st.exitCode == kExitPreempted));
    bool failedOnItsOwn = !st.success() && reason_ == Reason::Failure &&
                          ((!stopSentAt_ || e.time < *stopSentAt_) || !stopLike);
    (failedOnItsOwn ? failures_ : stopped_).push_back(e);
    return {};
  }
  if (e.status.success()) return {};  // the others keep going; the group ends when all are done
  const bool isReplacement = std::find(pendingReplacements_.begin(), pendingReplacements_.end(), e.localRank) !=
                             pendingReplacements_.end();
  // A worker killed outright or crashed (SIGKILL, SIGSEGV, SIGBUS) is a loss of its own, whatever
  // its group was doing: two workers lost at once are two replacements, not a loop that cannot
  // recover (which ends with an error of its own when its collective fails: an exit code, or
  // SIGABRT from an exception nobody caught).
  const int sig = e.status.signal;
  const bool lostOutright = sig == SIGKILL || sig == SIGSEGV || sig == SIGBUS;
  if (reformPending() && !lostOutright) {
    // A worker failed while its group re-formed around a replacement (until every rank built the
    // new group): a survivor that ended without joining the re-form (the README's loop without
    // try / recover()), or any rank whose re-form failed (its group could not be built: a store
    // filled to its cap). Replacing it too would cost another restart and meet the same re-form.
    // The whole group restarts instead, for this failure only: what the program declared decides
    // how the next one is recovered, never what this one suggests.
    fellBack_ = true;
    fellBackJoined_ = joinedReform && !isReplacement;
    failures_.push_back(e);
    return beginStop(Reason::Failure, SIGTERM);
  }
  // Exit 75 is a stop on request (the worker saved its state), never a failure to repair.
  // Exit 74 (a file could not be written) is agreed by every rank: a replacement would meet the
  // same disk.
  if (replaceable && replaced_ < replacements_ && e.status.asExitCode() != kExitPreempted &&
      e.status.asExitCode() != contract::kExitWriteFailed) {
    // In-place recovery: only this worker is started again; the others re-form the group with it.
    ++replaced_;
    ++numWorkers_;  // the replacement's exit is one more to wait for
    replacedExits_.push_back(e);
    if (!isReplacement) pendingReplacements_.push_back(e.localRank);
    MonitorActions a;
    a.replaceWorker = e.localRank;
    return a;
  }
  failures_.push_back(e);
  // torchrun's policy: the first failure stops the whole local group (SIGTERM, grace, SIGKILL).
  return beginStop(Reason::Failure, SIGTERM);
}

MonitorActions GroupMonitor::onSignal(int signo, std::chrono::steady_clock::time_point at) {
  if (firstSignalAt_ && at - *firstSignalAt_ < kDuplicateStopWindow) {
    MonitorActions a;
    a.duplicateSignal = true;
    return a;
  }
  if (!firstSignalAt_) firstSignalAt_ = at;
  if (reason_ == Reason::Signal) {
    // A second signal while stopping: the user means it, do not wait for the grace period.
    MonitorActions a;
    if (!killed_) {
      killed_ = true;
      a.killWorkers = true;
    }
    return a;
  }
  signal_ = signo;
  if (stopping()) {
    // Already stopping (after a failure): forward it anyway, the outcome is now an interruption.
    reason_ = Reason::Signal;
    MonitorActions a;
    a.signalWorkers = signo;
    return a;
  }
  return beginStop(Reason::Signal, signo);
}

MonitorActions GroupMonitor::onGraceExpired() {
  MonitorActions a;
  if (stopping() && !killed_) {
    killed_ = true;
    a.killWorkers = true;
  }
  return a;
}

MonitorActions GroupMonitor::onRendezvousEvent(const RendezvousEvent& event) {
  if (stopping()) return {};
  detail_ = event.reason;
  MonitorActions a;
  switch (event.kind) {
    case RendezvousEventKind::MembershipChanged:
      a = beginStop(Reason::Membership, SIGTERM);
      break;
    case RendezvousEventKind::RemoteFailure:
      // Another node failed while this one's replacement waited for the group to re-form: the
      // group restarts, and the replacement's restart is the same fault's.
      if (reformPending()) fellBack_ = true;
      a = beginStop(Reason::RemoteFailure, SIGTERM);
      break;
    case RendezvousEventKind::Failed:
      a = beginStop(Reason::RendezvousFailed, SIGTERM);
      break;
  }
  if (event.grace && a.armGrace && *event.grace < *a.armGrace) a.armGrace = *event.grace;
  return a;
}

GroupOutcome GroupMonitor::outcome() const {
  GroupOutcome o;
  o.failures = failures_;
  o.stopped = stopped_;
  o.signal = signal_;
  o.reason = detail_;
  o.inPlaceFellBack = fellBack_;
  o.fellBackInReform = fellBackJoined_;
  switch (reason_) {
    case Reason::None:
      // Everything ended on its own: success, unless a worker vanished without an exit status.
      o.kind = exited_ >= numWorkers_ ? GroupOutcome::Kind::Succeeded : GroupOutcome::Kind::Failed;
      if (o.kind == GroupOutcome::Kind::Failed) o.reason = "workers vanished without an exit status";
      break;
    case Reason::Failure:
    case Reason::RemoteFailure:
      o.kind = GroupOutcome::Kind::Failed;
      break;
    case Reason::Signal:
      o.kind = GroupOutcome::Kind::Interrupted;
      break;
    case Reason::Membership:
      o.kind = GroupOutcome::Kind::Rerendezvous;
      break;
    case Reason::RendezvousFailed:
      o.kind = GroupOutcome::Kind::RendezvousFailed;
      break;
  }
  return o;
}

bool preempted(const GroupOutcome& o) {
  auto savedState = [](const WorkerExit& e) { return e.status.asExitCode() == kExitPreempted; };
  return !(o.stopped.empty() && o.failures.empty()) && std::all_of(o.stopped.begin(), o.stopped.end(), savedState) &&
         std::all_of(o.failures.begin(), o.failures.end(), savedState);
}

RestartPolicy::RestartPolicy(int maxRestarts, bool inPlaceRecovery)
    : maxRestarts_(maxRestarts), inPlaceRecovery_(inPlaceRecovery) {}

int RestartPolicy::replacementsAllowed() const {
  return inPlaceRecovery_ && !inPlaceOff_ ? std::max(0, maxRestarts_ - restartCount_ - replacementsUsed_) : 0;
}

std::optional<InPlaceFallback> RestartPolicy::fallBack(GroupOutcome& outcome, const std::vector<WorkerExit>& replaced) {
  if (outcome.kind != GroupOutcome::Kind::Failed || !outcome.inPlaceFellBack || replaced.empty()) return std::nullopt;
  InPlaceFallback f;
  f.replaced = replaced.back();
  --replacementsUsed_;
  f.firstTime = !fellBackBefore_;
  fellBackBefore_ = true;
  f.inReform = outcome.fellBackInReform;
  if (!outcome.failures.empty()) {
    f.survivor = outcome.failures.front();
    outcome.failures.insert(outcome.failures.begin(), f.replaced);  // the root cause
  }
  return f;
}

AttemptDecision RestartPolicy::decide(const GroupOutcome& outcome, const RendezvousInfo& info,
                                      bool rootCauseRetryNever) {
  AttemptDecision d;
  switch (outcome.kind) {
    case GroupOutcome::Kind::Succeeded:
      d.leave = AgentOutcome::Succeeded;
      d.exitCode = contract::kExitSuccess;
      break;
    case GroupOutcome::Kind::Interrupted:
      if (preempted(outcome)) {
        d.note = AttemptDecision::Note::Preempted;
        d.exitCode = kExitPreempted;
      } else {
        d.summary = !outcome.failures.empty();
        d.exitCode = contract::exitCodeForSignal(outcome.signal);
      }
      break;
    case GroupOutcome::Kind::Rerendezvous:
      d.next = AttemptDecision::Next::Rerendezvous;
      d.note = AttemptDecision::Note::Membership;
      break;
    case GroupOutcome::Kind::RendezvousFailed:
      d.note = AttemptDecision::Note::RendezvousFailed;
      d.exitCode = contract::kExitRendezvousFailed;
      break;
    case GroupOutcome::Kind::Failed:
      d = decideFailed(outcome, info, rootCauseRetryNever);
      break;
  }
  return d;
}

AttemptDecision RestartPolicy::decideFailed(const GroupOutcome& outcome, const RendezvousInfo& info,
                                            bool rootCauseRetryNever) {
  using Note = AttemptDecision::Note;
  AttemptDecision d;
  const bool local = !outcome.failures.empty();
  d.why = local ? "rank " + std::to_string(info.globalRank(outcome.failures[0].localRank)) + " " +
                      outcome.failures[0].status.describe()
                : outcome.reason;
  d.reportFailure = local;
  // Every rank agreed to stop on exit 74: the disk is full or failing, and a restart would meet
  // the same disk. A deterministic error (a bad command line, a configuration, an incompatible
  // snapshot) fails the same way every time. No restart is spent on either.
  const bool writeFailed = local && outcome.failures.front().status.asExitCode() == contract::kExitWriteFailed;
  const bool deterministic = local && rootCauseRetryNever;
  const bool budgetLeft = restartsUsed() < maxRestarts_;
  if (writeFailed)
    d.note = Note::WriteFailed;
  else if (deterministic && budgetLeft)
    d.note = Note::RetryNever;
  if (!writeFailed && !deterministic && budgetLeft) {
    ++restartCount_;
    d.next = AttemptDecision::Next::Restart;
    d.note = Note::Restart;
    return d;
  }
  d.summary = local;
  if (!writeFailed && !deterministic && maxRestarts_ > 0)
    d.note = Note::NoRestartsLeft;
  else if (!local)
    d.note = Note::NoRestartsAllowed;
  d.leave = AgentOutcome::Failed;
  if (!local) {
    d.exitCode = contract::kExitFailure;
  } else {
    const int code = outcome.failures.front().status.asExitCode();
    d.exitCode = code == 0 ? contract::kExitFailure : code;
  }
  return d;
}

} // namespace ctorch::launcher
