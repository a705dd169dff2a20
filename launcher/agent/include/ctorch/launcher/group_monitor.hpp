// The agent's policy, as pure decisions. GroupMonitor: one running worker group as a state
// machine: events in (a worker exited, a signal arrived, the grace period ended, the rendezvous
// reported something), actions out (signal the workers, kill them, arm the grace timer, replace
// one), and at the end the group's outcome. RestartPolicy: the run's restart budget, and what an
// outcome leads to (restart, re-rendezvous, or which exit code). No processes, clocks or I/O here.
#pragma once

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/process_context.hpp"
#include "ctorch/launcher/rendezvous.hpp"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher {

struct MonitorActions {
  std::optional<int> signalWorkers;                    // send this signal to every worker group
  bool killWorkers = false;                            // SIGKILL every worker tree now
  std::optional<std::chrono::milliseconds> armGrace;   // start the grace timer
  bool duplicateSignal = false;  // a copy of the stop already under way: nothing to do
  std::optional<int> replaceWorker;  // --recovery in-place: start a new worker for this local rank
};

// Copies of one stop arrive together (see contract::kDuplicateStopWindowMs): a stop signal within
// this window of the first is the same request; only a later one kills at once.
inline constexpr std::chrono::milliseconds kDuplicateStopWindow{contract::kDuplicateStopWindowMs};

struct GroupOutcome {
  enum class Kind {
    Succeeded,        // every worker exited 0
    Failed,           // a worker failed (here or, reported by the rendezvous, on another node)
    Interrupted,      // the agent received a signal
    Rerendezvous,     // membership changed: restart without counting a failure
    RendezvousFailed, // the rendezvous gave up
  };
  Kind kind = Kind::Succeeded;
  std::vector<WorkerExit> failures;  // failed on their own, in observed order: [0] is the root cause
  std::vector<WorkerExit> stopped;   // ended by the agent's stop (its signal, SIGKILL, exit 75)
  int signal = 0;                    // Interrupted
  std::string reason;                // RemoteFailure / membership / rendezvous text
  // --recovery in-place: while the group was re-forming around a replacement, a worker failed (a
  // survivor that had not joined the re-form, or one whose re-form failed), or another node
  // failed: the group restarts for this failure, as under --recovery restart.
  bool inPlaceFellBack = false;
  bool fellBackInReform = false;  // the survivor that failed had joined the re-form (its re-form failed)
};

class GroupMonitor {
 public:
  // `replacements`: how many failed workers may be replaced alone while the others go on
  // (--recovery in-place: what is left of --max-restarts); 0: torchrun's policy, the first failure
  // stops the group.
  GroupMonitor(int numWorkers, std::chrono::milliseconds shutdownTimeout, int replacements = 0);

  // `replaceable`: whether a failed worker could be replaced in place now (the agent finds the
  // workers' store unreachable: its host was lost, the group must re-form from scratch).
  // `joinedReform`: asked only while reformPending(): whether the exiting worker had said it takes
  // part in the re-form (ResilientTraining::recover() says so). Any worker that fails while the
  // re-form is pending, except one lost outright (SIGKILL, SIGSEGV, SIGBUS: a fault of its own),
  // makes the group fall back to a full restart for this failure (GroupOutcome::inPlaceFellBack)
  // rather than being replaced too; `joinedReform` only says why (a survivor that ended instead
  // of recovering, or a re-form that failed).
  MonitorActions onWorkerExit(const WorkerExit& exit, bool replaceable = true, bool joinedReform = true);
  // A replacement was started and the group has not re-formed with it yet.
  bool reformPending() const { return !pendingReplacements_.empty(); }
  // The coordinator re-formed the group with every replacement: every rank built it.
  void noteReformed() { pendingReplacements_.clear(); }
  // A rank cannot recover in place: no failed worker is replaced alone from now on.
  void disableReplacements() { replacements_ = replaced_; }
  // Whether a failed worker's exit would be answered by a replacement (budget left).
  bool wouldReplace() const { return replaced_ < replacements_ && reason_ == Reason::None; }
  // The agent sent the stop signal at `time`: a failed worker whose exit time (taken by its
  // supervisor) precedes it failed on its own and is listed as a failure, not as stopped.
  void noteStopSent(std::chrono::system_clock::time_point time) { stopSentAt_ = time; }
  // `at` is when the agent read the signal (steady clock), for kDuplicateStopWindow.
  MonitorActions onSignal(int signo, std::chrono::steady_clock::time_point at);
  MonitorActions onGraceExpired();
  MonitorActions onRendezvousEvent(const RendezvousEvent& event);

  // Called once the process context reports that every worker process is gone.
  GroupOutcome outcome() const;

  bool stopping() const { return reason_ != Reason::None; }
  int exitedCount() const { return exited_; }
  int replacementsUsed() const { return replaced_; }
  // Every worker (replacements included) has exited.
  bool allExited() const { return exited_ >= numWorkers_; }
  // The failed workers that were replaced in place (not failures of the group).
  const std::vector<WorkerExit>& replaced() const { return replacedExits_; }

 private:
  enum class Reason { None, Failure, Signal, Membership, RemoteFailure, RendezvousFailed };
  MonitorActions beginStop(Reason reason, int signo);

  int numWorkers_;
  std::chrono::milliseconds shutdownTimeout_;
  int replacements_ = 0;
  int replaced_ = 0;
  std::vector<WorkerExit> replacedExits_;
  std::vector<int> pendingReplacements_;  // local ranks replaced since the group last re-formed
  bool fellBack_ = false;
  bool fellBackJoined_ = false;
  Reason reason_ = Reason::None;
  int signal_ = 0;
  int stopSignal_ = 0;  // what the workers were sent when the stop began
  std::optional<std::chrono::steady_clock::time_point> firstSignalAt_;
  int exited_ = 0;
  bool killed_ = false;
  std::string detail_;
  std::optional<std::chrono::system_clock::time_point> stopSentAt_;
  std::vector<WorkerExit> failures_;
  std::vector<WorkerExit> stopped_;
};

// Preemption (Slurm's --signal, scancel -s USR1): every worker that ended saved its state and
// exited kExitPreempted. A worker that got the signal first (Slurm signals the whole step) and
// exited 75 before the agent read its own copy counts as a failure in the outcome: it was
// preempted all the same.
bool preempted(const GroupOutcome& outcome);

// What the agent does once a group has ended.
struct AttemptDecision {
  enum class Next { Restart, Rerendezvous, Exit };
  // Which explanation the agent logs (the texts live in the agent).
  enum class Note {
    None,
    Preempted,          // every worker exited 75: exit 75 so that the job can be requeued
    Membership,         // membership changed: a new round, no restart counted
    RendezvousFailed,   // the rendezvous gave up: exit 3
    Restart,            // the group failed, a restart is left: restartCount() of maxRestarts()
    WriteFailed,        // exit 74 (a file could not be written): not restarted
    RetryNever,         // the error file says a restart cannot help (and restarts were left)
    NoRestartsLeft,     // --max-restarts used up
    NoRestartsAllowed,  // another node's failure with --max-restarts 0
  };
  Next next = Next::Exit;
  Note note = Note::None;
  int exitCode = 0;                                // Exit: ctorchrun's exit code
  AgentOutcome leave = AgentOutcome::Interrupted;  // Exit: what the rendezvous is told
  bool summary = false;        // print the failure summary (this node's failures) and keep the logs
  bool reportFailure = false;  // tell the other nodes this node's workers failed, with `why`
  std::string why;             // Failed: the root cause ("rank 1 exited with 3") or the remote reason
};

// --recovery in-place fell back to a group restart (GroupOutcome::inPlaceFellBack): what happened.
struct InPlaceFallback {
  bool firstTime = false;  // the run's first fallback (the agent explains it in full once)
  bool inReform = false;   // the survivor had joined the re-form, which failed (else: it never joined)
  WorkerExit replaced;     // the worker whose replacement the group was re-forming around
  std::optional<WorkerExit> survivor;  // the local worker that ended instead of joining (none: another node)
};

// The run's restart budget: group restarts and in-place replacements together against
// --max-restarts, and the decision after each attempt. Lives as long as the agent's run.
class RestartPolicy {
 public:
  RestartPolicy(int maxRestarts, bool inPlaceRecovery);

  // The attempt's TORCHELASTIC_RESTART_COUNT; a backend that shares it across nodes (c10d)
  // decides it, so that every node's workers see the same.
  int restartCount() const { return restartCount_; }
  void adoptRestartCount(std::optional<int> shared) {
    if (shared) restartCount_ = *shared;
  }
  int maxRestarts() const { return maxRestarts_; }
  // --recovery in-place, over the whole run.
  int replacementsUsed() const { return replacementsUsed_; }
  int restartsUsed() const { return restartCount_ + replacementsUsed_; }
  void noteReplacement() { ++replacementsUsed_; }
  // A rank said it cannot recover in place: every later failure of the run restarts the group.
  void turnInPlaceOff() { inPlaceOff_ = true; }
  // For the next group's GroupMonitor: how many failed workers may be replaced alone (0 without
  // --recovery in-place, or once a rank declared it cannot recover in place).
  int replacementsAllowed() const;

  // A Failed outcome with inPlaceFellBack and a replacement this attempt (`replaced`, the
  // monitor's): the replacement's restart becomes the group's (one fault, one restart) and the
  // replaced worker becomes the root cause. Nothing otherwise. The next failure is recovered in
  // place again: whether a program can is what its ranks declared (turnInPlaceOff), never what a
  // failure during a re-form suggests (an outsider filling the store can make a re-form fail).
  std::optional<InPlaceFallback> fallBack(GroupOutcome& outcome, const std::vector<WorkerExit>& replaced);

  // `rootCauseRetryNever`: the root-cause worker's error file says a restart cannot help.
  // Counts the restart it decides.
  AttemptDecision decide(const GroupOutcome& outcome, const RendezvousInfo& info, bool rootCauseRetryNever);

 private:
  AttemptDecision decideFailed(const GroupOutcome& outcome, const RendezvousInfo& info, bool rootCauseRetryNever);

  int maxRestarts_;
  bool inPlaceRecovery_;
  int restartCount_ = 0;
  int replacementsUsed_ = 0;
  // A rank declared that it cannot recover in place: every later failure of this run restarts the
  // group, as --recovery restart.
  bool inPlaceOff_ = false;
  bool fellBackBefore_ = false;  // a re-form fell back to a group restart earlier in this run
};

} // namespace ctorch::launcher
