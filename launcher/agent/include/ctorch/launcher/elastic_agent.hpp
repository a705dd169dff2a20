// ElasticAgent: the event loop that carries out the agent's policy. For every attempt it asks the
// rendezvous for a round, starts the local workers through the ProcessContext, and then only
// waits — on the context's fd, the signal fd, a timerfd for the grace period and the rendezvous'
// event fd (epoll, no sleeping or polling) — feeding what happens to a GroupMonitor and doing what
// it says; RestartPolicy (group_monitor.hpp) then decides between restart and exit. It ends with
// 0, the root-cause worker's own exit code, or 128+N after signal N.
#pragma once

#include "ctorch/launcher/failure_summary.hpp"
#include "ctorch/launcher/group_monitor.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/process_context.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/launcher/signals.hpp"
#include "ctorch/launcher/worker_logs.hpp"

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher {

class Replacements;  // --recovery in-place (launcher/agent/src/replacements.hpp)

struct AgentOptions {
  // The environment workers inherit (before the contract variables); default: the agent's own.
  std::optional<std::vector<std::string>> baseEnvironment;
  std::chrono::milliseconds rendezvousTimeout{std::chrono::minutes(10)};
  std::chrono::milliseconds exitBarrierTimeout{std::chrono::minutes(5)};
  // The agent is a child subreaper (ctorchrun is): reap orphans that reach it on SIGCHLD, which
  // must then be among the SignalSource's signals.
  bool reapOrphans = false;
  // Where the failure summary goes (stderr by default).
  std::function<void(const std::string&)> printSummary;
};

class ElasticAgent {
 public:
  struct Attempt {
    int restartCount = 0;
    RendezvousInfo rendezvous;
    std::map<int, pid_t> pids;
    GroupOutcome outcome;
  };

  ElasticAgent(const LaunchConfig& config, RendezvousHandler& rendezvous, ProcessContext& processes,
               WorkerLogs& logs, SignalSource& signals, AgentOptions options = {});
  ~ElasticAgent();
  ElasticAgent(const ElasticAgent&) = delete;
  ElasticAgent& operator=(const ElasticAgent&) = delete;

  // Runs until the job succeeds, fails for good, or a signal stops it; returns the exit code.
  int run();

  const std::vector<Attempt>& attempts() const { return attempts_; }
  const std::optional<FailureReport>& failureReport() const { return report_; }
  // --recovery in-place: what the agent has heard from the job's coordinator in the running group,
  // safe to ask from another thread while run() runs (tests wait on it). -1: not yet whether every
  // rank can recover in place; 1: every rank can; 0: one cannot.
  int heardCapability() const;
  // Whether the coordinator said global rank `rank`'s process takes part in the pending re-form.
  bool heardInReform(int rank) const;

 private:
  std::optional<int> joinRound(RendezvousInfo& info);
  GroupOutcome runGroup(const RendezvousInfo& info);
  void passExitBarrier(GroupOutcome& outcome);
  bool rootCauseRetryNever(const GroupOutcome& outcome) const;
  void inPlaceImpossible(const std::string& why, GroupMonitor& mon);
  void explainFallback(const InPlaceFallback& fallback, const RendezvousInfo& info);
  void explain(const AttemptDecision& decision, const GroupOutcome& outcome, const RendezvousInfo& info);
  std::optional<int> act(const AttemptDecision& decision, const GroupOutcome& outcome, const RendezvousInfo& info);
  std::vector<WorkerLaunch> buildLaunches(const RendezvousInfo& info, int restartCount,
                                          std::vector<WorkerLogs::WorkerFiles>& files);
  GroupOutcome monitor();
  void onWorkerExits(GroupMonitor& monitor);
  void onSignals(GroupMonitor& monitor);
  void apply(const MonitorActions& actions);
  void reapOrphans();
  void watchConsoles();
  FailureReport makeReport(const GroupOutcome& outcome, const RendezvousInfo& info, int restartCount,
                           const std::vector<WorkerLogs::WorkerFiles>& files) const;
  std::optional<int> pendingStopSignal();

  const LaunchConfig& config_;
  RendezvousHandler& rendezvous_;
  ProcessContext& processes_;
  WorkerLogs& logs_;
  SignalSource& signals_;
  AgentOptions options_;
  RestartPolicy policy_;
  int timerFd_ = -1;
  int epollFd_ = -1;
  bool warnedOmp_ = false;
  bool stopNoted_ = false;
  std::optional<GroupMonitor> monitor_;
  std::vector<WorkerLogs::WorkerFiles> files_;  // the running group's: error files, the summary
  // --recovery in-place: replacements, spares, eviction requests (src/replacements.hpp).
  std::unique_ptr<Replacements> replacements_;
  std::vector<Attempt> attempts_;
  std::vector<int> watchedConsoles_;
  std::optional<FailureReport> report_;
};

} // namespace ctorch::launcher
