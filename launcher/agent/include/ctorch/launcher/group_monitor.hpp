// The agent's policy for one running worker group, as a pure state machine: events in (a worker
// exited, a signal arrived, the grace period ended, the rendezvous reported something), actions
// out (signal the workers, kill them, arm the grace timer), and at the end the outcome that
// decides between success, restart, re-rendezvous and exit. No processes, clocks or I/O here.
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
  // --recovery in-place: while the group was re-forming around a replacement, a worker that had
  // not joined the re-form failed (or another node failed): the program does not recover in
  // place, and the group restarts as under --recovery restart.
  bool inPlaceFellBack = false;
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
  // part in the re-form (ResilientTraining::recover() marks its rank alive). One that had not, a
  // survivor that ended instead of recovering, makes the group fall back to a full restart
  // (GroupOutcome::inPlaceFellBack) rather than being replaced too.
  MonitorActions onWorkerExit(const WorkerExit& exit, bool replaceable = true, bool joinedReform = true);
  // A replacement was started and the group has not re-formed with it yet.
  bool reformPending() const { return !pendingReplacements_.empty(); }
  // The agent saw every rank arrive at the re-formed group.
  void noteReformed() { pendingReplacements_.clear(); }
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

} // namespace ctorch::launcher
