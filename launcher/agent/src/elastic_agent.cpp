#include "ctorch/launcher/elastic_agent.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/worker_env.hpp"
#include "log.hpp"
#include "replacements.hpp"

#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <system_error>

namespace ctorch::launcher {

namespace {

constexpr std::uint64_t kProcessesTag = 1;
constexpr std::uint64_t kSignalsTag = 2;
constexpr std::uint64_t kTimerTag = 3;
constexpr std::uint64_t kRendezvousTag = 4;
constexpr std::uint64_t kConsoleTag = 5;
constexpr std::uint64_t kControlTag = 6;

} // namespace

ElasticAgent::ElasticAgent(const LaunchConfig& config, RendezvousHandler& rendezvous,
                           ProcessContext& processes, WorkerLogs& logs, SignalSource& signals,
                           AgentOptions options)
    : config_(config),
      rendezvous_(rendezvous),
      processes_(processes),
      logs_(logs),
      signals_(signals),
      options_(std::move(options)),
      policy_(config.maxRestarts, config.inPlaceRecovery),
      replacements_(std::make_unique<Replacements>(config, processes, logs)) {
  if (!options_.baseEnvironment) options_.baseEnvironment = currentEnvironment();
  if (!options_.printSummary) options_.printSummary = writeConsoleErr;  // never blocks on an unread console
  timerFd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (timerFd_ < 0) throwErrno("timerfd_create");
  epollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epollFd_ < 0) throwErrno("epoll_create1");
  auto add = [&](int fd, std::uint64_t tag) {
    if (fd < 0) return;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = tag;
    if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) throwErrno("epoll_ctl");
  };
  add(processes_.fd(), kProcessesTag);
  add(signals_.fd(), kSignalsTag);
  add(timerFd_, kTimerTag);
  add(rendezvous_.eventFd(), kRendezvousTag);
  add(replacements_->fd(), kControlTag);
}

ElasticAgent::~ElasticAgent() {
  ::close(epollFd_);
  ::close(timerFd_);
}

int ElasticAgent::heardCapability() const { return replacements_->heardCapability(); }

bool ElasticAgent::heardInReform(int rank) const { return replacements_->heardInReform(rank); }

std::vector<WorkerLaunch> ElasticAgent::buildLaunches(const RendezvousInfo& info, int restartCount,
                                                      std::vector<WorkerLogs::WorkerFiles>& files) {
  files = logs_.beginAttempt(info, restartCount);
  const auto& base = *options_.baseEnvironment;
  bool omp = shouldDefaultOmpThreads(base, info.localNproc());
  if (omp && !warnedOmp_) {
    log("agent").warn(
        "setting OMP_NUM_THREADS=1 for each worker to avoid overloading the machine "
        "({} workers on this node); set it yourself to tune",
        info.localNproc());
    warnedOmp_ = true;
  }
  std::vector<WorkerLaunch> launches;
  for (int lr = 0; lr < info.localNproc(); ++lr) {
    const auto& f = files[static_cast<std::size_t>(lr)];
    WorkerLaunch w;
    w.localRank = lr;
    w.globalRank = info.globalRank(lr);
    w.executable = config_.executable;
    w.argv = config_.workerArgv;
    w.env = workerEnvironment(
        base, contractVariables(config_, info, lr, restartCount, f.errorFile.string()), omp);
    w.out = f.out;
    w.err = f.err;
    launches.push_back(std::move(w));
  }
  return launches;
}

void ElasticAgent::apply(const MonitorActions& a) {
  if (a.signalWorkers) {
    replacements_->killSpares();  // they hold no state: nothing to stop gracefully
    log("agent").debug("sending {} to every worker", signalName(*a.signalWorkers));
    if (monitor_ && !stopNoted_) {
      monitor_->noteStopSent(std::chrono::system_clock::now());
      stopNoted_ = true;
    }
    processes_.signalAll(*a.signalWorkers);
  }
  if (a.killWorkers) {
    // Said by the caller: the grace ran out (kTimerTag), or a second stop signal came (onSignals).
    processes_.killAll();
  }
  if (a.replaceWorker) {
    replacements_->replace(*a.replaceWorker, policy_);
    attempts_.back().pids = processes_.pids();
  }
  if (a.armGrace) {
    itimerspec spec{};
    auto ms = std::max<long long>(a.armGrace->count(), 1);
    spec.it_value.tv_sec = ms / 1000;
    spec.it_value.tv_nsec = (ms % 1000) * 1000000;
    if (::timerfd_settime(timerFd_, 0, &spec, nullptr) != 0) throwErrno("timerfd_settime");
  }
}

void ElasticAgent::reapOrphans() {
  // Descendants whose supervisor was killed come to us (we are a subreaper). Supervisors are
  // reaped by the process context; if we get one first, the context copes (ECHILD).
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(-1, &status, WNOHANG);
    if (r > 0) {
      log("agent").debug("reaped orphan process {}", r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    return;
  }
}

std::optional<int> ElasticAgent::pendingStopSignal() {
  while (auto s = signals_.take()) {
    if (*s == SIGCHLD) {
      if (options_.reapOrphans) reapOrphans();
      continue;
    }
    return s;
  }
  return std::nullopt;
}

void ElasticAgent::watchConsoles() {
  // Only while a console has output waiting: a writable terminal would wake us all the time.
  std::vector<int> wanted = logs_.blockedConsoles();
  for (int fd : watchedConsoles_)
    if (std::find(wanted.begin(), wanted.end(), fd) == wanted.end()) ::epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
  for (int fd : wanted) {
    if (std::find(watchedConsoles_.begin(), watchedConsoles_.end(), fd) != watchedConsoles_.end()) continue;
    epoll_event ev{};
    ev.events = EPOLLOUT;
    ev.data.u64 = kConsoleTag;
    if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0 && errno != EEXIST) throwErrno("epoll_ctl console");
  }
  watchedConsoles_ = std::move(wanted);
}

void ElasticAgent::onWorkerExits(GroupMonitor& mon) {
  auto& l = log("agent");
  const RendezvousInfo& info = attempts_.back().rendezvous;
  for (const auto& e : processes_.process()) {
    if (e.localRank < 0) {
      // A spare that held no rank: not a worker of the group.
      replacements_->spareEnded(e);
      continue;
    }
    if (e.status.success())
      l.info("worker rank {} (local {}, pid {}) finished", info.globalRank(e.localRank), e.localRank, e.pid);
    else if (mon.stopping())
      l.info("worker rank {} (local {}, pid {}) stopped: {}", info.globalRank(e.localRank), e.localRank, e.pid,
             e.status.describe());
    else
      l.error("worker rank {} (local {}, pid {}) failed: {}", info.globalRank(e.localRank), e.localRank, e.pid,
              e.status.describe());
    // In place only while the coordinator answers (lost with node rank 0's host, the group
    // restarts instead) and once every rank said it can recover in place.
    const bool replaceable =
        !mon.wouldReplace() || e.status.success() || replacements_->canReplace(info.globalRank(e.localRank));
    const bool joined = e.status.success() || !mon.reformPending() ||
                        replacements_->joinedReform(info.globalRank(e.localRank));
    apply(mon.onWorkerExit(e, replaceable, joined));
  }
  if (mon.stopping() || mon.allExited()) replacements_->killSpares();
}

void ElasticAgent::onSignals(GroupMonitor& mon) {
  while (auto s = signals_.take()) {
    if (*s == SIGCHLD) {
      if (options_.reapOrphans) reapOrphans();
      continue;
    }
    MonitorActions a = mon.onSignal(*s, std::chrono::steady_clock::now());
    if (a.duplicateSignal) {
      log("agent").info("received {} again within {} ms: a copy of the same stop, not forwarded", signalName(*s),
                        kDuplicateStopWindow.count());
      continue;
    }
    if (a.killWorkers)
      log("agent").warn("received {} again while stopping: killing the workers now", signalName(*s));
    else
      log("agent").warn("received {}: forwarding it to the workers", signalName(*s));
    apply(a);
  }
}

GroupOutcome ElasticAgent::monitor() {
  GroupMonitor& mon = *monitor_;
  epoll_event events[16];
  for (;;) {
    if (processes_.finished()) break;
    watchConsoles();
    int n = ::epoll_wait(epollFd_, events, 16, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno("epoll_wait");
    }
    for (int i = 0; i < n; ++i) {
      switch (events[i].data.u64) {
        case kProcessesTag:
          onWorkerExits(mon);
          break;
        case kSignalsTag:
          onSignals(mon);
          break;
        case kTimerTag: {
          std::uint64_t expirations = 0;
          if (::read(timerFd_, &expirations, sizeof expirations) > 0) {
            MonitorActions a = mon.onGraceExpired();
            if (a.killWorkers) log("agent").warn("grace period over: killing the remaining workers (SIGKILL)");
            apply(a);
          }
          break;
        }
        case kConsoleTag:
          logs_.flushConsoles();
          break;
        case kControlTag:
          replacements_->onReady(mon);
          if (auto why = replacements_->takeInPlaceImpossible()) inPlaceImpossible(*why, mon);
          break;
        case kRendezvousTag:
          while (auto ev = rendezvous_.takeEvent()) {
            log("agent").warn("rendezvous: {}", ev->reason);
            apply(mon.onRendezvousEvent(*ev));
          }
          break;
        default:
          break;
      }
    }
  }
  itimerspec off{};
  ::timerfd_settime(timerFd_, 0, &off, nullptr);
  replacements_->endGroup();
  for (int fd : watchedConsoles_) ::epoll_ctl(epollFd_, EPOLL_CTL_DEL, fd, nullptr);
  watchedConsoles_.clear();
  return mon.outcome();
}

FailureReport ElasticAgent::makeReport(const GroupOutcome& outcome, const RendezvousInfo& info,
                                       int restartCount,
                                       const std::vector<WorkerLogs::WorkerFiles>& files) const {
  FailureReport r;
  r.program = config_.program;
  r.python = config_.usesPython;
  r.runId = info.runId;
  r.attempt = restartCount;
  r.maxRestarts = config_.maxRestarts;
  r.numWorkers = info.worldSize;
  r.stoppedByAgent = static_cast<int>(outcome.stopped.size());
  const std::string& host = info.nodeHosts.empty() || info.nodeHosts[static_cast<std::size_t>(info.nodeRank)].empty()
                                ? config_.hostname
                                : info.nodeHosts[static_cast<std::size_t>(info.nodeRank)];
  for (const auto& e : outcome.failures) {
    FailureRecord f;
    f.globalRank = info.globalRank(e.localRank);
    f.localRank = e.localRank;
    f.host = host;
    f.pid = e.pid;
    f.status = e.status;
    f.time = e.time;
    if (static_cast<std::size_t>(e.localRank) < files.size()) {
      f.errorFile = files[static_cast<std::size_t>(e.localRank)].errorFile;
      f.error = readErrorFile(f.errorFile);
    }
    r.failures.push_back(std::move(f));
  }
  return r;
}

// Waits for the next round; the exit code instead when the agent must leave (a stop signal, a
// rendezvous that was interrupted or closed).
std::optional<int> ElasticAgent::joinRound(RendezvousInfo& info) {
  auto& l = log("agent");
  if (auto s = pendingStopSignal()) {
    l.warn("received {} between attempts: not restarting", signalName(*s));
    rendezvous_.shutdown(AgentOutcome::Interrupted);
    return contract::exitCodeForSignal(*s);
  }
  RendezvousRequest req;
  req.localNproc = config_.nprocPerNode;
  req.timeout = options_.rendezvousTimeout;
  req.cancelFd = signals_.fd();
  std::optional<int> stopSignal;
  req.stopRequested = [&] {
    if (!stopSignal) stopSignal = pendingStopSignal();
    return stopSignal.has_value();
  };
  try {
    info = rendezvous_.next(req);
  } catch (const RendezvousInterrupted&) {
    if (!stopSignal) stopSignal = pendingStopSignal();
    if (stopSignal) l.warn("received {} while waiting for the rendezvous: stopping", signalName(*stopSignal));
    rendezvous_.shutdown(AgentOutcome::Interrupted);
    return stopSignal ? contract::exitCodeForSignal(*stopSignal) : contract::kExitRendezvousFailed;
  } catch (const RendezvousGracefulExit& e) {
    l.info("{}: exiting", e.what());
    rendezvous_.shutdown(AgentOutcome::Interrupted);
    return contract::kExitSuccess;
  } catch (...) {
    rendezvous_.shutdown(AgentOutcome::Interrupted);
    throw;
  }
  l.info("rendezvous round {} complete: node {} of {}, world size {}, store {}:{}", info.round, info.nodeRank,
         info.numNodes, info.worldSize, info.storeHost, info.storePort);
  return std::nullopt;
}

// One attempt: starts the local workers of the round and waits until they are all gone.
GroupOutcome ElasticAgent::runGroup(const RendezvousInfo& info) {
  const int restartCount = policy_.restartCount();
  std::vector<WorkerLogs::WorkerFiles> files;
  auto launches = buildLaunches(info, restartCount, files);
  Attempt attempt;
  attempt.restartCount = restartCount;
  attempt.rendezvous = info;
  attempts_.push_back(attempt);
  monitor_.emplace(static_cast<int>(launches.size()), config_.shutdownTimeout, policy_.replacementsAllowed());
  stopNoted_ = false;
  files_ = files;
  const bool inPlace = policy_.replacementsAllowed() > 0;
  replacements_->prepare(launches, inPlace);
  processes_.start(launches);
  replacements_->beginGroup(info, restartCount, launches, files, inPlace);
  attempts_.back().pids = processes_.pids();
  log("agent").info("started {} worker(s) of {} (attempt {}, restart {} of {})", launches.size(), config_.program,
                    restartCount + 1, restartCount, config_.maxRestarts);

  GroupOutcome outcome = monitor();
  attempts_.back().pids = processes_.pids();
  attempts_.back().outcome = outcome;
  logs_.endAttempt();
  return outcome;
}

// After this node's workers succeeded: the other nodes' workers may have failed meanwhile, and
// then the whole group runs again.
void ElasticAgent::passExitBarrier(GroupOutcome& outcome) {
  auto& l = log("agent");
  l.info("all {} worker(s) finished successfully", files_.size());
  auto event = rendezvous_.exitBarrier(options_.exitBarrierTimeout);
  if (!event || event->kind != RendezvousEventKind::RemoteFailure) return;
  l.warn("rendezvous: {}", event->reason);
  outcome.kind = GroupOutcome::Kind::Failed;
  outcome.reason = event->reason;
}

// A deterministic error: the root cause's error file says a restart cannot help.
bool ElasticAgent::rootCauseRetryNever(const GroupOutcome& outcome) const {
  if (outcome.kind != GroupOutcome::Kind::Failed || outcome.failures.empty()) return false;
  const auto localRank = static_cast<std::size_t>(outcome.failures[0].localRank);
  if (localRank >= files_.size()) return false;
  const auto recorded = readErrorFile(files_[localRank].errorFile);
  return recorded && recorded->retryNever;
}

// A failure during a re-form restarts the group for that failure only: what the program declared
// decides how the next failure is recovered, never what this one suggests (issue 58.3).
void ElasticAgent::explainFallback(const InPlaceFallback& fallback, const RendezvousInfo& info) {
  auto& l = log("agent");
  const int replaced = info.globalRank(fallback.replaced.localRank);
  constexpr const char* kNext = "the next failure is again recovered in place";
  if (!fallback.survivor) {
    l.warn("another node's worker failed while the group re-formed in place around rank {}'s replacement: "
           "restarting the whole group for this failure; {}",
           replaced, kNext);
    return;
  }
  const std::string survivor = "rank " + std::to_string(info.globalRank(fallback.survivor->localRank)) + " " +
                               fallback.survivor->status.describe();
  if (fallback.inReform)
    l.warn("{} while the group re-formed in place around rank {}'s replacement (its re-form failed): restarting "
           "the whole group for this failure; {}",
           survivor, replaced, kNext);
  else if (fallback.firstTime)
    l.warn("{} while the group re-formed in place around rank {}'s replacement, without joining it: a loop must "
           "catch the failed step and call ctorch::ResilientTraining::recover() to recover in place (README: "
           "--recovery in-place). Restarting the whole group for this failure, as --recovery restart does; {}",
           survivor, replaced, kNext);
  else
    l.warn("{} while the group re-formed in place around rank {}'s replacement, without joining it: restarting "
           "the whole group for this failure",
           survivor, replaced);
}

// A rank said it cannot recover in place (sharded state, in-place recovery turned off in its
// loop): from now on the run restarts the group after a failure, at once, as --recovery restart.
void ElasticAgent::inPlaceImpossible(const std::string& why, GroupMonitor& mon) {
  log("agent").warn("{}: this job recovers from failures by restarting the group, as --recovery restart does",
                    why);
  policy_.turnInPlaceOff();
  mon.disableReplacements();
  replacements_->killSpares();
}

void ElasticAgent::explain(const AttemptDecision& d, const GroupOutcome& outcome, const RendezvousInfo& info) {
  auto& l = log("agent");
  switch (d.note) {
    case AttemptDecision::Note::None:
      break;
    case AttemptDecision::Note::Preempted:
      l.warn("every worker exited {} (preempted after saving its state): exiting {} so that the job can be requeued",
             contract::kExitPreempted, contract::kExitPreempted);
      break;
    case AttemptDecision::Note::Membership:
      l.warn("membership changed ({}): restarting the workers without counting a failure", outcome.reason);
      break;
    case AttemptDecision::Note::RendezvousFailed:
      l.error("rendezvous failed: {}", outcome.reason);
      break;
    case AttemptDecision::Note::Restart:
      l.warn("worker group failed ({}); restarting, restart {} of {}", d.why, policy_.restartCount(),
             config_.maxRestarts);
      break;
    case AttemptDecision::Note::WriteFailed:
      // Every rank agreed to stop: the disk is full or failing. A restart would redo the steps
      // since the last snapshot and meet the same disk.
      l.error("rank {} could not write a file the run needs (exit {}: disk full or failing); not restarting: "
              "free space and run the same command again, it resumes from the last snapshot written",
              info.globalRank(outcome.failures[0].localRank), contract::kExitWriteFailed);
      break;
    case AttemptDecision::Note::RetryNever:
      l.error("rank {} failed with an error a restart cannot fix (its error file says so: a command line, a "
              "configuration or a snapshot that does not fit); not restarting",
              info.globalRank(outcome.failures[0].localRank));
      break;
    case AttemptDecision::Note::NoRestartsLeft:
      l.error("worker group failed ({}); no restarts left ({} used)", d.why, config_.maxRestarts);
      break;
    case AttemptDecision::Note::NoRestartsAllowed:
      l.error("worker group failed ({}); no restarts allowed (--max-restarts 0)", d.why);
      break;
  }
}

// Does what the decision says; the exit code when the agent leaves.
std::optional<int> ElasticAgent::act(const AttemptDecision& d, const GroupOutcome& outcome,
                                     const RendezvousInfo& info) {
  if (outcome.kind == GroupOutcome::Kind::Interrupted)
    log("agent").warn("stopped by {}: {} worker(s) ended", signalName(outcome.signal),
                      outcome.stopped.size() + outcome.failures.size());
  // "No restarts left" follows the summary it refers to; every other note comes first.
  const bool afterSummary =
      d.note == AttemptDecision::Note::NoRestartsLeft || d.note == AttemptDecision::Note::NoRestartsAllowed;
  if (!afterSummary) explain(d, outcome, info);
  if (d.next != AttemptDecision::Next::Exit) {
    if (d.reportFailure) rendezvous_.reportFailure(d.why);
    return std::nullopt;
  }
  if (d.summary) {
    report_ = makeReport(outcome, info, policy_.restartCount(), files_);
    options_.printSummary(formatFailureSummary(*report_));
    logs_.keep();
  }
  if (afterSummary) explain(d, outcome, info);
  if (d.reportFailure) rendezvous_.reportFailure(d.why);
  rendezvous_.shutdown(d.leave);
  return d.exitCode;
}

// The agent's run, top to bottom: a round, a group, the policy's decision, again.
int ElasticAgent::run() {
  for (;;) {
    RendezvousInfo info;
    if (auto leave = joinRound(info)) return *leave;
    // A backend that shares the count across nodes (c10d) decides it: every node's workers must
    // see the same TORCHELASTIC_RESTART_COUNT.
    policy_.adoptRestartCount(info.restartCount);
    GroupOutcome outcome = runGroup(info);
    if (outcome.kind == GroupOutcome::Kind::Succeeded) passExitBarrier(outcome);
    if (auto fallback = policy_.fallBack(outcome, monitor_->replaced())) explainFallback(*fallback, info);
    attempts_.back().outcome = outcome;
    const AttemptDecision decision = policy_.decide(outcome, info, rootCauseRetryNever(outcome));
    if (auto code = act(decision, outcome, info)) return *code;
  }
}

} // namespace ctorch::launcher
