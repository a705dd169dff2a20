// The agent's restart policy and event loop against a fake process context, a fake rendezvous and
// fake signals: restarts, exhaustion, exit codes, the grace period, signals, rendezvous events.
// Also the worker environment it builds. No processes are started here.
#include "ctorch_catch.hpp"

#include "ctorch/launcher/cli.hpp"
#include "ctorch/launcher/elastic_agent.hpp"
#include "ctorch/launcher/logging.hpp"
#include "ctorch/launcher/worker_env.hpp"
#include "ctorch/contract/control_client.hpp"
#include "ctorch/control/control_plane.hpp"
#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "launcher_test_util.hpp"
#include "multiproc.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <functional>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <set>
#include <thread>

using namespace ctorch::launcher;
using namespace std::chrono_literals;

namespace {

struct FakeWorker {
  std::optional<ExitStatus> exitAtStart;  // exits by itself right away
  bool ignoreTerm = false;                // survives SIGTERM, dies on SIGKILL
};

class FakeProcessContext : public ProcessContext {
 public:
  using Script = std::function<std::vector<FakeWorker>(int attempt, int nworkers)>;
  explicit FakeProcessContext(Script script) : script_(std::move(script)) {
    fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  }
  ~FakeProcessContext() override { ::close(fd_); }

  void start(const std::vector<WorkerLaunch>& workers) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    REQUIRE(finished());
    launches.push_back(workers);
    auto behaviour = script_(attempt_++, static_cast<int>(workers.size()));
    live_.clear();
    for (std::size_t i = 0; i < workers.size(); ++i) {
      const auto& b = behaviour.at(i);
      if (b.exitAtStart) {
        queue(static_cast<int>(i), *b.exitAtStart);
      } else {
        live_[static_cast<int>(i)] = b;
      }
    }
    if (onStart) onStart(attempt_ - 1, workers);
  }
  // Called at the end of start() (on the agent's thread): what a test does beside the workers.
  std::function<void(int attempt, const std::vector<WorkerLaunch>&)> onStart;
  int fd() const override { return fd_; }
  std::vector<WorkerExit> process() override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    std::uint64_t v;
    [[maybe_unused]] auto n = ::read(fd_, &v, sizeof v);
    std::vector<WorkerExit> out(pending_.begin(), pending_.end());
    pending_.clear();
    return out;
  }
  void signalAll(int signo) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    signals.push_back(signo);
    stops.push_back("signal " + std::to_string(signo));
    if (onSignalAll) onSignalAll(signo);
    for (auto it = live_.begin(); it != live_.end();) {
      if (signo == SIGTERM && it->second.ignoreTerm) {
        ++it;
        continue;
      }
      queue(it->first, exitOnSignal ? ExitStatus::exited(*exitOnSignal) : ExitStatus::killed(signo));
      it = live_.erase(it);
    }
  }
  void killAll() override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    ++kills;
    stops.push_back("kill");
    for (auto& [rank, b] : live_) queue(rank, ExitStatus::killed(SIGKILL));
    live_.clear();
  }
  bool finished() const override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    return live_.empty() && pending_.empty();
  }
  // A live worker of local rank r has pid 100 + r (spares: negative ranks, 100 + r as well).
  std::map<int, pid_t> pids() const override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    std::map<int, pid_t> out;
    for (const auto& [rank, b] : live_) out[rank] = 100 + rank;
    return out;
  }
  void kill(pid_t pid) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    killed.push_back(pid);
    exitWorker(static_cast<int>(pid) - 100, ExitStatus::killed(SIGKILL));
  }
  void killRank(int localRank) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (live_.count(localRank)) exitWorker(localRank, ExitStatus::killed(SIGKILL));
  }
  std::vector<pid_t> killed;  // kill(pid) calls
  // --recovery in-place: the replacement runs; `onAdd` decides what happens next (by default the
  // replacement and every running worker finish with exit 0: the group completed after the repair).
  void add(const WorkerLaunch& w) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    added.push_back(w);
    if (onAdd) return onAdd(w);
    live_[w.localRank] = FakeWorker{};
    for (auto& [rank, b] : live_) queue(rank, ExitStatus::exited(0));
    live_.clear();
  }

  std::vector<std::vector<WorkerLaunch>> launches;
  std::vector<int> signals;
  int kills = 0;
  std::vector<std::string> stops;  // signalAll ("signal N") and killAll ("kill") calls, in order
  std::optional<int> exitOnSignal;  // workers handle signals and exit with this code
  std::function<void(int)> onSignalAll;  // called when the agent signals the workers
  std::vector<WorkerLaunch> added;        // replacements started by add()
  std::function<void(const WorkerLaunch&)> onAdd;
  // --spare-workers: a spare (negative local rank) takes a failed worker's rank over.
  void relabel(int fromLocalRank, int toLocalRank) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    relabels.emplace_back(fromLocalRank, toLocalRank);
    if (live_.count(fromLocalRank)) {
      live_[toLocalRank] = live_[fromLocalRank];
      live_.erase(fromLocalRank);
    }
    if (onRelabel) onRelabel(fromLocalRank, toLocalRank);
  }
  std::vector<std::pair<int, int>> relabels;
  std::function<void(int, int)> onRelabel;
  // From any thread.
  void exitWorker(int rank, ExitStatus s) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    live_.erase(rank);
    queue(rank, s);
  }
  // Like add()'s default: every running worker finishes (exit 0).
  void finishAll() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    for (auto& [rank, b] : live_) queue(rank, ExitStatus::exited(0));
    live_.clear();
  }

 private:
  void queue(int rank, ExitStatus s) {
    WorkerExit e;
    e.localRank = rank;
    e.pid = 100 + rank;
    e.status = s;
    e.time = std::chrono::system_clock::now();
    pending_.push_back(e);
    std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(fd_, &one, sizeof one);
  }
  Script script_;
  int fd_;
  int attempt_ = 0;
  std::map<int, FakeWorker> live_;
  std::deque<WorkerExit> pending_;
  mutable std::recursive_mutex mutex_;
};

class FakeRendezvous : public RendezvousHandler {
 public:
  FakeRendezvous() { fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }
  // The workers' store the rounds name (--recovery in-place reads it): nothing answers at the
  // default; a test that needs one serves it (serveWorkerStore).
  int storePort = 1234;
  std::unique_ptr<ctorch::store::TcpStoreServer> workerStore;
  std::shared_ptr<ctorch::control::ControlPlane> control;  // on the workers' store port
  // The workers' store with the job's control plane (keyed `controlKey`), as node rank 0 serves it.
  void serveWorkerStore(const std::string& controlKey = "", std::size_t maxConnections = 0) {
    ctorch::store::TcpStoreServerOptions o;
    o.requestTimeout = std::chrono::milliseconds(0);  // no handshake is late for the machine being slow
    o.maxConnections = maxConnections;
    if (!controlKey.empty()) {
      control = std::make_shared<ctorch::control::ControlPlane>(controlKey);
      o.side = control;
    }
    workerStore = std::make_unique<ctorch::store::TcpStoreServer>(o);
    storePort = workerStore->port();
  }
  ~FakeRendezvous() override { ::close(fd_); }
  std::string backend() const override { return "fake"; }
  RendezvousInfo next(const RendezvousRequest& r) override {
    RendezvousInfo i;
    i.runId = "fake-run";
    i.round = rounds++;
    i.numNodes = 1;
    i.nprocPerNode = {r.localNproc};
    i.computeRanks();
    i.storeHost = "127.0.0.1";
    i.storePort = storePort;
    i.nodeHosts = {"fakehost"};
    if (static_cast<std::size_t>(i.round) < sharedRestartCounts.size())
      i.restartCount = sharedRestartCounts[static_cast<std::size_t>(i.round)];
    if (static_cast<std::size_t>(i.round) < eventsAfterRound.size() && eventsAfterRound[static_cast<std::size_t>(i.round)]) {
      pending_.push_back(*eventsAfterRound[static_cast<std::size_t>(i.round)]);
      std::uint64_t one = 1;
      [[maybe_unused]] auto n = ::write(fd_, &one, sizeof one);
    }
    return i;
  }
  int eventFd() const override { return fd_; }
  std::optional<RendezvousEvent> takeEvent() override {
    std::uint64_t v;
    [[maybe_unused]] auto n = ::read(fd_, &v, sizeof v);
    if (pending_.empty()) return std::nullopt;
    auto e = pending_.front();
    pending_.pop_front();
    return e;
  }
  void reportFailure(const std::string& why) override { failuresReported.push_back(why); }
  std::optional<RendezvousEvent> exitBarrier(std::chrono::milliseconds) override {
    ++barriers;
    if (barrierResults.empty()) return std::nullopt;
    auto r = barrierResults.front();
    barrierResults.pop_front();
    return r;
  }
  void shutdown(AgentOutcome outcome) override { shutdowns.push_back(outcome); }

  int rounds = 0;
  int barriers = 0;
  std::deque<std::optional<RendezvousEvent>> barrierResults;
  std::vector<int> sharedRestartCounts;  // by round: RendezvousInfo::restartCount
  std::vector<AgentOutcome> shutdowns;
  std::vector<std::string> failuresReported;
  std::vector<std::optional<RendezvousEvent>> eventsAfterRound;

 private:
  int fd_;
  std::deque<RendezvousEvent> pending_;
};

class FakeSignals : public SignalSource {
 public:
  FakeSignals() { REQUIRE(::pipe2(p_, O_NONBLOCK | O_CLOEXEC) == 0); }
  ~FakeSignals() override {
    ::close(p_[0]);
    ::close(p_[1]);
  }
  int fd() const override { return p_[0]; }
  std::optional<int> take() override {
    int s;
    if (::read(p_[0], &s, sizeof s) == static_cast<ssize_t>(sizeof s)) return s;
    return std::nullopt;
  }
  void raise(int s) { REQUIRE(::write(p_[1], &s, sizeof s) == static_cast<ssize_t>(sizeof s)); }

 private:
  int p_[2];
};

struct Fixture {
  ctorch::test::TempDir logDir;
  LaunchConfig config;
  std::unique_ptr<WorkerLogs> logs;
  FakeRendezvous rendezvous;
  FakeSignals signals;
  std::vector<std::string> summaries;

  explicit Fixture(std::vector<std::string> extraArgs) {
    setLogLevel("off");
    std::vector<std::string> args = {"--log-dir", logDir.path().string()};
    args.insert(args.end(), extraArgs.begin(), extraArgs.end());
    args.push_back("/bin/true");
    auto cl = parseCommandLine(args);
    REQUIRE_FALSE(cl.exitNow);
    MachineProbe p;
    p.hostname = [] { return std::string("fakehost"); };
    config = makeLaunchConfig(cl.options, processEnvironment(), p);
    logs = std::make_unique<WorkerLogs>(config, -1, -1);
  }

  int run(FakeProcessContext& pc, ElasticAgent** keep = nullptr) {
    AgentOptions o;
    o.baseEnvironment = std::vector<std::string>{"PATH=/usr/bin", "HOME=/home/x"};
    o.printSummary = [this](const std::string& s) { summaries.push_back(s); };
    agent = std::make_unique<ElasticAgent>(config, rendezvous, pc, *logs, signals, o);
    if (keep) *keep = agent.get();
    return agent->run();
  }
  std::unique_ptr<ElasticAgent> agent;
};

std::string envValue(const WorkerLaunch& w, const std::string& key) {
  for (const auto& e : w.env)
    if (e.rfind(key + "=", 0) == 0) return e.substr(key.size() + 1);
  return "<unset>";
}

std::vector<FakeWorker> allSucceed(int n) { return std::vector<FakeWorker>(static_cast<std::size_t>(n), FakeWorker{ExitStatus::exited(0)}); }

} // namespace

TEST_CASE("agent: every worker succeeds: exit 0 / one attempt / exit barrier passed") {
  Fixture f({"--nproc-per-node", "3"});
  FakeProcessContext pc([](int, int n) { return allSucceed(n); });
  CHECK(f.run(pc) == 0);
  CHECK(pc.launches.size() == 1);
  CHECK(pc.signals.empty());
  CHECK(f.rendezvous.barriers == 1);
  CHECK(f.summaries.empty());
}

TEST_CASE("agent: a failure restarts the whole group with TORCHELASTIC_RESTART_COUNT+1") {
  Fixture f({"--nproc-per-node", "2", "--max-restarts", "3"});
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{ExitStatus::exited(5)}, {}};
    return allSucceed(n);
  });
  CHECK(f.run(pc) == 0);
  REQUIRE(pc.launches.size() == 2);
  CHECK(pc.signals == std::vector<int>{SIGTERM});  // the healthy worker was stopped once
  CHECK(envValue(pc.launches[0][1], "TORCHELASTIC_RESTART_COUNT") == "0");
  CHECK(envValue(pc.launches[1][1], "TORCHELASTIC_RESTART_COUNT") == "1");
  CHECK(envValue(pc.launches[1][1], "TORCHELASTIC_MAX_RESTARTS") == "3");
  CHECK(f.rendezvous.rounds == 2);
  CHECK(f.rendezvous.failuresReported.size() == 1);
  // A restart uses a fresh attempt directory for the error files.
  CHECK(envValue(pc.launches[1][0], "TORCHELASTIC_ERROR_FILE").find("attempt_1") != std::string::npos);
}

TEST_CASE("agent: restarts exhausted: the root cause's own exit code and a summary") {
  Fixture f({"--nproc-per-node", "2", "--max-restarts", "2"});
  FakeProcessContext pc([](int, int) { return std::vector<FakeWorker>{{}, {ExitStatus::exited(7)}}; });
  CHECK(f.run(pc) == 7);
  CHECK(pc.launches.size() == 3);
  REQUIRE(f.summaries.size() == 1);
  CHECK(f.summaries[0].find("attempt 3 of 3") != std::string::npos);
  REQUIRE(f.agent->failureReport());
  CHECK(f.agent->failureReport()->failures.at(0).globalRank == 1);
}

TEST_CASE("agent: a worker killed by a signal gives 128+N") {
  Fixture f({"--nproc-per-node", "1"});
  FakeProcessContext pc([](int, int) { return std::vector<FakeWorker>{{ExitStatus::killed(SIGSEGV)}}; });
  CHECK(f.run(pc) == 139);
}

TEST_CASE("agent: a worker that ignores SIGTERM is killed when the grace period ends") {
  Fixture f({"--nproc-per-node", "2", "--shutdown-timeout", "0.05"});
  FakeProcessContext pc([](int, int) {
    FakeWorker stubborn;
    stubborn.ignoreTerm = true;
    return std::vector<FakeWorker>{{ExitStatus::exited(3)}, stubborn};
  });
  CHECK(f.run(pc) == 3);  // it returns: bounded by the grace, not forever (else CTest's timeout)
  CHECK(pc.kills == 1);
  // SIGTERM first; SIGKILL when the grace ended, not before it was asked for.
  CHECK(pc.stops == std::vector<std::string>{"signal " + std::to_string(SIGTERM), "kill"});
  const auto& attempt = f.agent->attempts().at(0);
  REQUIRE(attempt.outcome.stopped.size() == 1);
  CHECK(attempt.outcome.stopped[0].status.signal == SIGKILL);
}

TEST_CASE("agent: a signal to the agent is forwarded / no restart / exit 128+N") {
  Fixture f({"--nproc-per-node", "2", "--max-restarts", "5"});
  FakeProcessContext pc([&f](int, int) {
    f.signals.raise(SIGTERM);  // arrives while the workers run
    return std::vector<FakeWorker>{{}, {}};
  });
  CHECK(f.run(pc) == 128 + SIGTERM);
  CHECK(pc.launches.size() == 1);
  CHECK(pc.signals == std::vector<int>{SIGTERM});
}

TEST_CASE("agent: SIGINT is forwarded as SIGINT") {
  Fixture f({"--nproc-per-node", "1"});
  FakeProcessContext pc([&f](int, int) {
    f.signals.raise(SIGINT);
    return std::vector<FakeWorker>{{}};
  });
  CHECK(f.run(pc) == 130);
  CHECK(pc.signals == std::vector<int>{SIGINT});
}

TEST_CASE("agent: a membership change re-rendezvous without counting a restart") {
  Fixture f({"--nproc-per-node", "2", "--max-restarts", "0"});
  f.rendezvous.eventsAfterRound = {RendezvousEvent{RendezvousEventKind::MembershipChanged, "a node joined"}};
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{}, {}};  // running when the event comes
    return allSucceed(n);
  });
  CHECK(f.run(pc) == 0);
  REQUIRE(pc.launches.size() == 2);
  CHECK(envValue(pc.launches[1][0], "TORCHELASTIC_RESTART_COUNT") == "0");
}

TEST_CASE("agent: a failure on another node counts as a restart") {
  Fixture f({"--nproc-per-node", "1", "--max-restarts", "1"});
  f.rendezvous.eventsAfterRound = {RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 2 failed"}};
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{}};
    return allSucceed(n);
  });
  CHECK(f.run(pc) == 0);
  REQUIRE(pc.launches.size() == 2);
  CHECK(envValue(pc.launches[1][0], "TORCHELASTIC_RESTART_COUNT") == "1");
}

TEST_CASE("agent: the worker environment is torchrun's") {
  Fixture f({"--nproc-per-node", "4", "--role", "trainer", "--max-restarts", "2"});
  FakeProcessContext pc([](int, int n) { return allSucceed(n); });
  REQUIRE(f.run(pc) == 0);
  const auto& ws = pc.launches.at(0);
  REQUIRE(ws.size() == 4);
  for (int r = 0; r < 4; ++r) {
    const auto& w = ws[static_cast<std::size_t>(r)];
    CHECK(envValue(w, "RANK") == std::to_string(r));
    CHECK(envValue(w, "LOCAL_RANK") == std::to_string(r));
    CHECK(envValue(w, "ROLE_RANK") == std::to_string(r));
    CHECK(envValue(w, "GROUP_RANK") == "0");
    CHECK(envValue(w, "ROLE_NAME") == "trainer");
    CHECK(envValue(w, "LOCAL_WORLD_SIZE") == "4");
    CHECK(envValue(w, "WORLD_SIZE") == "4");
    CHECK(envValue(w, "ROLE_WORLD_SIZE") == "4");
    CHECK(envValue(w, "GROUP_WORLD_SIZE") == "1");
    CHECK(envValue(w, "MASTER_ADDR") == "127.0.0.1");
    CHECK(envValue(w, "MASTER_PORT") == "1234");
    CHECK(envValue(w, "TORCHELASTIC_RUN_ID") == "fake-run");
    CHECK(envValue(w, "TORCHELASTIC_USE_AGENT_STORE") == "True");
    CHECK(envValue(w, "TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
    CHECK(envValue(w, "OMP_NUM_THREADS") == "1");
    CHECK(envValue(w, "PATH") == "/usr/bin");  // the agent's environment is inherited
    CHECK(w.argv == std::vector<std::string>{"/bin/true"});
  }
}

TEST_CASE("worker env: user settings win over defaults and contract variables win over inherited ones") {
  RendezvousInfo info;
  info.runId = "r";
  info.numNodes = 2;
  info.nodeRank = 1;
  info.nprocPerNode = {3, 2};  // heterogeneous nodes: global ranks are prefix sums
  info.computeRanks();
  info.storeHost = "h";
  info.storePort = 9;
  LaunchConfig c;
  auto vars = contractVariables(c, info, 1, 0, "/e.json");
  CHECK(vars.at("RANK") == "4");
  CHECK(vars.at("WORLD_SIZE") == "5");
  CHECK(vars.at("LOCAL_WORLD_SIZE") == "2");
  std::vector<std::string> base = {"RANK=99", "OMP_NUM_THREADS=8", "NCCL_ASYNC_ERROR_HANDLING=0", "X=1"};
  CHECK_FALSE(shouldDefaultOmpThreads(base, 2));
  auto env = workerEnvironment(base, vars, false);
  std::set<std::string> s(env.begin(), env.end());
  CHECK(s.count("RANK=4"));
  CHECK_FALSE(s.count("RANK=99"));
  CHECK(s.count("OMP_NUM_THREADS=8"));
  CHECK(s.count("NCCL_ASYNC_ERROR_HANDLING=0"));
  CHECK(s.count("TORCH_NCCL_ASYNC_ERROR_HANDLING=1"));
  CHECK(s.count("X=1"));
  CHECK(shouldDefaultOmpThreads({"A=1"}, 2));
  CHECK_FALSE(shouldDefaultOmpThreads({"A=1"}, 1));
}

// ---- several nodes: shared counts, the exit barrier, preemption, how the agent leaves ---------------
TEST_CASE("agent: a failure on another node is counted but not reported back") {
  Fixture f({"--nproc-per-node", "1", "--max-restarts", "1"});
  f.rendezvous.eventsAfterRound = {RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 2 failed", std::nullopt}};
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{}};
    return allSucceed(n);
  });
  CHECK(f.run(pc) == 0);
  CHECK(f.rendezvous.failuresReported.empty());  // the other node reported it
  CHECK(f.rendezvous.shutdowns == std::vector<AgentOutcome>{AgentOutcome::Succeeded});
}

TEST_CASE("agent: a remote failure with no restart left ends the agent with 1") {
  Fixture f({"--nproc-per-node", "1"});
  f.rendezvous.eventsAfterRound = {RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 2 failed", std::nullopt}};
  FakeProcessContext pc([](int, int) { return std::vector<FakeWorker>{{}}; });
  CHECK(f.run(pc) == 1);
  CHECK(pc.launches.size() == 1);
  CHECK(f.summaries.empty());  // nothing failed here: no local summary
  CHECK(f.rendezvous.shutdowns == std::vector<AgentOutcome>{AgentOutcome::Failed});
}

TEST_CASE("agent: the restart count the rendezvous shares wins over the local one") {
  // A node that joins a job which already restarted twice gives its workers the job's count.
  Fixture f({"--nproc-per-node", "1", "--max-restarts", "5"});
  f.rendezvous.sharedRestartCounts = {2, 3};
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{ExitStatus::exited(4)}};
    return allSucceed(n);
  });
  CHECK(f.run(pc) == 0);
  REQUIRE(pc.launches.size() == 2);
  CHECK(envValue(pc.launches[0][0], "TORCHELASTIC_RESTART_COUNT") == "2");
  CHECK(envValue(pc.launches[1][0], "TORCHELASTIC_RESTART_COUNT") == "3");
  // Control: without a shared count the local one is used.
  Fixture g({"--nproc-per-node", "1", "--max-restarts", "5"});
  FakeProcessContext pc2([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{ExitStatus::exited(4)}};
    return allSucceed(n);
  });
  CHECK(g.run(pc2) == 0);
  CHECK(envValue(pc2.launches[1][0], "TORCHELASTIC_RESTART_COUNT") == "1");
}

TEST_CASE("agent: workers that succeeded run again when another node failed during the exit barrier") {
  Fixture f({"--nproc-per-node", "2", "--max-restarts", "1"});
  f.rendezvous.barrierResults = {RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 1 failed", std::nullopt},
                                 std::nullopt};
  FakeProcessContext pc([](int, int n) { return allSucceed(n); });
  CHECK(f.run(pc) == 0);
  REQUIRE(pc.launches.size() == 2);
  CHECK(f.rendezvous.barriers == 2);
  CHECK(envValue(pc.launches[1][0], "TORCHELASTIC_RESTART_COUNT") == "1");
  // No restart left: the success here does not make the job a success.
  Fixture g({"--nproc-per-node", "1"});
  g.rendezvous.barrierResults = {RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 1 failed", std::nullopt}};
  FakeProcessContext pc2([](int, int n) { return allSucceed(n); });
  CHECK(g.run(pc2) == 1);
}

TEST_CASE("agent: preempted workers (exit 75 after the forwarded signal) make the agent exit 75") {
  for (int code : {75, 0}) {
    Fixture f({"--nproc-per-node", "2"});
    FakeProcessContext pc([&f](int, int) {
      f.signals.raise(SIGUSR1);
      return std::vector<FakeWorker>{{}, {}};
    });
    pc.exitOnSignal = code;  // the workers save their state and exit with `code`
    int rc = f.run(pc);
    INFO("workers exit " << code);
    // Control: workers that exit 0 on the signal are not "preempted": 128+SIGUSR1 as usual.
    CHECK(rc == (code == 75 ? 75 : 128 + SIGUSR1));
    CHECK(f.rendezvous.shutdowns == std::vector<AgentOutcome>{AgentOutcome::Interrupted});
  }
}

TEST_CASE("agent: a worker that exits 75 before the agent's own copy of the signal arrives still makes it exit 75") {
  // Slurm signals every process of the step: a worker can save, exit 75 and be seen by the agent
  // (a failure: the agent stops the group with SIGTERM) before the agent reads its own SIGUSR1.
  // Every worker exited 75 and a stop signal came: the job was preempted, not failed.
  Fixture f({"--nproc-per-node", "2"});
  FakeProcessContext pc([](int, int) {
    FakeWorker saved;
    saved.exitAtStart = ExitStatus::exited(75);
    FakeWorker busy;
    busy.ignoreTerm = true;  // still in its step when the agent's SIGTERM comes; saves on SIGUSR1
    return std::vector<FakeWorker>{saved, busy};
  });
  pc.exitOnSignal = 75;
  pc.onSignalAll = [&f](int signo) {
    if (signo == SIGTERM) f.signals.raise(SIGUSR1);
  };
  CHECK(f.run(pc) == 75);
  CHECK(pc.signals == std::vector<int>{SIGTERM, SIGUSR1});
  CHECK(f.rendezvous.shutdowns == std::vector<AgentOutcome>{AgentOutcome::Interrupted});
  // Control: a worker that really failed (exit 1) keeps the signal's exit code.
  Fixture g({"--nproc-per-node", "2"});
  FakeProcessContext failed([](int, int) {
    FakeWorker crashed;
    crashed.exitAtStart = ExitStatus::exited(1);
    FakeWorker busy;
    busy.ignoreTerm = true;
    return std::vector<FakeWorker>{crashed, busy};
  });
  failed.exitOnSignal = 75;
  failed.onSignalAll = [&g](int signo) {
    if (signo == SIGTERM) g.signals.raise(SIGUSR1);
  };
  CHECK(g.run(failed) == 128 + SIGUSR1);
}

TEST_CASE("agent: a rendezvous that gives up ends the agent with 3 and leaves") {
  Fixture f({"--nproc-per-node", "1", "--max-restarts", "3"});
  f.rendezvous.eventsAfterRound = {
      RendezvousEvent{RendezvousEventKind::Failed, "cut off", std::chrono::milliseconds(10)}};
  FakeProcessContext pc([](int, int) { return std::vector<FakeWorker>{{}}; });
  CHECK(f.run(pc) == 3);
  CHECK(pc.launches.size() == 1);
  CHECK(f.rendezvous.shutdowns == std::vector<AgentOutcome>{AgentOutcome::Interrupted});
}

namespace {

namespace cc = ctorch::contract::control;

// The fake workers' side of in-place recovery's control channel, on threads of their own (the
// agent's event loop runs on the test's thread): each connects as the worker or spare its launch
// names (its rank, its CTORCH_INCARNATION, the job's key) and does what the test says.
class ControlWorkers {
 public:
  explicit ControlWorkers(Fixture& f) : f_(f), r_(f.rendezvous) {}
  ~ControlWorkers() {
    stop_ = true;  // spares still waiting for a rank give up
    for (auto& t : threads_) t.join();
  }

  // Connects as launch `w` (a spare when it has CTORCH_SPARE); welcomed when it returns.
  std::shared_ptr<cc::BlockingClient> connect(const WorkerLaunch& w) {
    const std::string key = *ctorch::contract::auth::fromHex(envValue(w, "CTORCH_CONTROL_KEY"));
    const auto incarnation = cc::parseIncarnation(envValue(w, "CTORCH_INCARNATION"));
    REQUIRE(incarnation);
    const bool spare = envValue(w, "CTORCH_SPARE") != "<unset>";
    const cc::Message hello = spare ? cc::spareHello(0, envValue(w, "CTORCH_SPARE"), *incarnation, 100 + w.localRank)
                                    : cc::workerHello(w.globalRank, *incarnation, 100 + w.localRank);
    auto client = std::make_shared<cc::BlockingClient>("127.0.0.1", r_.storePort, key, hello, 60s);
    std::lock_guard<std::mutex> lock(m_);
    clients_[w.localRank] = client;
    return client;
  }
  std::shared_ptr<cc::BlockingClient> client(int localRank) {
    std::lock_guard<std::mutex> lock(m_);
    return clients_.at(localRank);
  }

  // Runs `f` on a thread of its own; what it throws fails the test at the end (errors()).
  void run(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(m_);
    threads_.emplace_back([this, f = std::move(f)] {
      try {
        f();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(m_);
        errors_.push_back(e.what());
      }
    });
  }

  // On a thread: every worker of `launches` connects and says whether it can recover in place
  // (`incapable`: the local ranks that say they cannot); once the agent has heard the job's answer
  // from the coordinator (and `spares` spares are ready), `then` runs.
  void declareAll(const std::vector<WorkerLaunch>& launches, std::function<void()> then, std::set<int> incapable = {},
                  int spares = 0) {
    run([this, launches, then = std::move(then), incapable, spares] {
      for (const auto& w : launches) {
        cc::Message m = cc::message(cc::Type::kDeclare);
        m.value = incapable.count(w.localRank) ? 0 : 1;
        m.text = m.value ? "" : "a test's rank that cannot";
        connect(w)->send(m);
      }
      const int want = incapable.empty() ? 1 : 0;
      if (!waitFor([&] { return agent().heardCapability() == want && readySpares() >= spares; }))
        throw std::runtime_error("the agent never heard the job's capability (the coordinator's: " +
                                 std::to_string(r_.control->stats().capability) + ")");
      then();
    });
  }

  // The agent under test (run() has created it before any worker starts).
  const ElasticAgent& agent() const { return *f_.agent; }

  // Polls `pred` until true, 60 s at most (a hang guard).
  static bool waitFor(const std::function<bool()>& pred) {
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (!pred()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(5ms);
    }
    return true;
  }

  // A spare connects and waits for its assignment (recorded in assignments()).
  void spare(const WorkerLaunch& w) {
    run([this, w] {
      auto client = connect(w);
      {
        std::lock_guard<std::mutex> lock(m_);
        ++ready_;
      }
      const auto deadline = std::chrono::steady_clock::now() + 60s;
      while (!stop_ && std::chrono::steady_clock::now() < deadline) {
        std::optional<cc::Message> m;
        try {
          m = client->receive(std::chrono::steady_clock::now() + 200ms);
        } catch (const cc::ControlError&) {
          return;  // the group ended: the coordinator closed
        }
        if (m && m->type == cc::Type::kAssign) {
          std::lock_guard<std::mutex> lock(m_);
          assignments_.push_back(*m);
          return;
        }
      }
    });
  }
  int readySpares() {
    std::lock_guard<std::mutex> lock(m_);
    return ready_;
  }
  std::vector<cc::Message> assignments() {
    std::lock_guard<std::mutex> lock(m_);
    return assignments_;
  }
  std::vector<std::string> errors() {
    std::lock_guard<std::mutex> lock(m_);
    return errors_;
  }

 private:
  Fixture& f_;
  FakeRendezvous& r_;
  std::mutex m_;
  std::map<int, std::shared_ptr<cc::BlockingClient>> clients_;
  std::vector<std::thread> threads_;
  std::vector<std::string> errors_;
  std::vector<cc::Message> assignments_;
  int ready_ = 0;
  std::atomic<bool> stop_{false};
};

// Once the spare has its assignment, it (now local rank `to`) and the survivor (local rank 0) finish.
void finishOnceAssigned(ControlWorkers& cw, FakeProcessContext& pc, int to) {
  cw.run([&cw, &pc, to] {
    ControlWorkers::waitFor([&] { return !cw.assignments().empty(); });
    pc.exitWorker(to, ExitStatus::exited(0));
    pc.exitWorker(0, ExitStatus::exited(0));
  });
}

std::vector<std::string> inPlaceArgs(int nproc, int maxRestarts, std::vector<std::string> more = {"--preloaded-workers", "0"}) {
  std::vector<std::string> a{"--nproc-per-node", std::to_string(nproc), "--max-restarts", std::to_string(maxRestarts),
                             "--recovery", "in-place"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

} // namespace

TEST_CASE("agent: --recovery in-place replaces only the failed worker, with its rank and CTORCH_REPLACEMENT") {
  Fixture f(inPlaceArgs(3, 2));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int attempt, int n) {
    REQUIRE(attempt == 0);  // never a second group
    return std::vector<FakeWorker>(static_cast<std::size_t>(n));
  });
  pc.onStart = [&](int, const std::vector<WorkerLaunch>& launches) {
    cw.declareAll(launches, [&pc] { pc.exitWorker(1, ExitStatus::killed(SIGKILL)); });
  };
  CHECK(f.run(pc) == 0);
  CHECK(cw.errors().empty());
  CHECK(pc.launches.size() == 1);
  CHECK(pc.signals.empty());  // the survivors were not stopped
  REQUIRE(pc.added.size() == 1);
  const WorkerLaunch& r = pc.added[0];
  CHECK(r.localRank == 1);
  CHECK(envValue(r, "RANK") == "1");
  CHECK(envValue(r, "CTORCH_REPLACEMENT") == "1");
  CHECK(envValue(r, "CTORCH_RECOVERY") == "in-place");
  CHECK(envValue(r, "TORCHELASTIC_RESTART_COUNT") == "0");  // the same group (and store prefix)
  // A new process, a new incarnation: nothing said about the failed one names it.
  const auto before = cc::parseIncarnation(envValue(pc.launches[0][1], "CTORCH_INCARNATION"));
  const auto after = cc::parseIncarnation(envValue(r, "CTORCH_INCARNATION"));
  REQUIRE(before);
  REQUIRE(after);
  CHECK(*before != *after);
  CHECK(envValue(pc.launches[0][0], "CTORCH_RECOVERY") == "in-place");
  CHECK(envValue(pc.launches[0][0], "CTORCH_REPLACEMENT") == "<unset>");
  CHECK(f.rendezvous.rounds == 1);
  CHECK(f.summaries.empty());
}

TEST_CASE("agent: --recovery in-place counts replacements against --max-restarts, then fails as torchrun") {
  Fixture f(inPlaceArgs(2, 1));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int, int n) { return std::vector<FakeWorker>(static_cast<std::size_t>(n)); });
  pc.onStart = [&](int attempt, const std::vector<WorkerLaunch>& launches) {
    if (attempt == 0) cw.declareAll(launches, [&pc] { pc.exitWorker(1, ExitStatus::exited(3)); });
  };
  // The replacement is lost too (a crash of its own; one that fails otherwise while the group
  // re-forms makes the group restart instead: the next test).
  pc.onAdd = [&pc](const WorkerLaunch& w) { pc.exitWorker(w.localRank, ExitStatus::killed(SIGSEGV)); };
  CHECK(f.run(pc) == 128 + SIGSEGV);  // and no restart was left
  CHECK(pc.added.size() == 1);
  CHECK(pc.launches.size() == 1);
  CHECK(pc.signals == std::vector<int>{SIGTERM});
  REQUIRE(f.agent->failureReport());
  CHECK(f.agent->failureReport()->failures.at(0).status.signal == SIGSEGV);
}

TEST_CASE("agent: --recovery in-place falls back to one group restart when a survivor ends instead of re-forming, "
          "for that failure only (issues 28.1, 58.3)") {
  // A loop that said it can recover in place but has no try / recover() around its step: rank 1 is
  // killed, its replacement starts, and rank 0 dies of the broken connection without joining the
  // re-form. One group restart for the one fault; the next fault is met in place again (before
  // issue 58.3 every later failure of the run restarted the group).
  Fixture f(inPlaceArgs(2, 3));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int attempt, int n) {
    REQUIRE(attempt <= 1);
    return std::vector<FakeWorker>(static_cast<std::size_t>(n));
  });
  pc.onStart = [&](int, const std::vector<WorkerLaunch>& launches) {
    cw.declareAll(launches, [&pc] { pc.exitWorker(1, ExitStatus::killed(SIGKILL)); });
  };
  int adds = 0;
  pc.onAdd = [&](const WorkerLaunch&) {
    if (++adds == 1) {
      pc.exitWorker(0, ExitStatus::exited(1));  // the survivor ends, not joining
      return;
    }
    pc.exitWorker(1, ExitStatus::exited(0));  // the second fault was repaired in place: the group finishes
    pc.exitWorker(0, ExitStatus::exited(0));
  };
  CHECK(f.run(pc) == 0);
  CHECK(cw.errors().empty());
  CHECK(pc.added.size() == 2);     // the first fault's replacement (stopped with the group), the second's
  CHECK(pc.launches.size() == 2);  // one group restart, for the first fault only
  CHECK(envValue(pc.launches[1][0], "TORCHELASTIC_RESTART_COUNT") == "1");
  REQUIRE(f.agent->attempts().size() == 2);
  const GroupOutcome& first = f.agent->attempts()[0].outcome;
  CHECK(first.inPlaceFellBack);
  CHECK_FALSE(first.fellBackInReform);
  REQUIRE(first.failures.size() >= 2);
  CHECK(first.failures[0].localRank == 1);  // the root cause: the killed worker, then the survivor
  CHECK(first.failures[0].status.signal == SIGKILL);
  CHECK(first.failures[1].localRank == 0);
  CHECK_FALSE(f.agent->attempts()[1].outcome.inPlaceFellBack);

  // A survivor that joined the re-form (recover() said so on the control channel) and failed before
  // every rank built the new group (its re-form failed: a store filled to its cap) is not replaced
  // a second time either: the group restarts for that failure.
  Fixture g(inPlaceArgs(2, 2));
  g.rendezvous.serveWorkerStore(g.config.controlKey);
  ControlWorkers cw2(g);
  FakeProcessContext pc2([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>(static_cast<std::size_t>(n));
    return allSucceed(n);
  });
  pc2.onStart = [&](int attempt, const std::vector<WorkerLaunch>& launches) {
    if (attempt == 0) cw2.declareAll(launches, [&pc2] { pc2.exitWorker(1, ExitStatus::killed(SIGKILL)); });
  };
  pc2.onAdd = [&](const WorkerLaunch&) {
    cw2.run([&] {
      cc::Message reform = cc::message(cc::Type::kReform);
      reform.generation = 0;
      reform.value = 1;
      cw2.client(0)->send(reform);
      // The coordinator tells the agent that rank 0 waits in the re-form; then rank 0 fails.
      if (!ControlWorkers::waitFor([&] { return cw2.agent().heardInReform(0); }))
        throw std::runtime_error("the agent never heard that rank 0 joined the re-form");
      pc2.exitWorker(0, ExitStatus::exited(1));
    });
  };
  CHECK(g.run(pc2) == 0);
  CHECK(cw2.errors().empty());
  CHECK(pc2.added.size() == 1);
  CHECK(pc2.launches.size() == 2);
  CHECK(g.agent->attempts()[0].outcome.inPlaceFellBack);
  CHECK(g.agent->attempts()[0].outcome.fellBackInReform);
}

TEST_CASE("agent: --recovery in-place restarts the group when the coordinator does not answer (its host was lost)") {
  // No workers' store: node rank 0's host died with it, so a replacement could not join and the
  // survivors could not re-form; the group restarts (the next round brings a new store).
  Fixture f(inPlaceArgs(2, 1));
  f.rendezvous.storePort = 1;  // privileged and unserved: refused at once
  FakeProcessContext pc([](int attempt, int) {
    if (attempt == 0) return std::vector<FakeWorker>{{}, {ExitStatus::exited(1)}};
    return allSucceed(2);
  });
  CHECK(f.run(pc) == 0);
  CHECK(pc.added.empty());           // nothing replaced in place
  CHECK(pc.launches.size() == 2);    // the group restarted
  CHECK(f.rendezvous.rounds == 2);
  // Control: the same failure with the coordinator answering is repaired in place.
  Fixture g(inPlaceArgs(2, 1));
  g.rendezvous.serveWorkerStore(g.config.controlKey);
  ControlWorkers cw(g);
  FakeProcessContext pc2([](int, int n) { return std::vector<FakeWorker>(static_cast<std::size_t>(n)); });
  pc2.onStart = [&](int, const std::vector<WorkerLaunch>& launches) {
    cw.declareAll(launches, [&pc2] { pc2.exitWorker(1, ExitStatus::exited(1)); });
  };
  CHECK(g.run(pc2) == 0);
  CHECK(pc2.added.size() == 1);
  CHECK(pc2.launches.size() == 1);
}

namespace {

// An outsider's connections to the store at `port`, each with one request served (so that the store
// cannot take them for idle newcomers), opened until the store turns one away: its cap is held.
std::vector<int> holdConnectionCap(int port) {
  namespace sp = ctorch::store::protocol;
  sp::Bytes request = sp::encodeValidate();
  const sp::Bytes numKeys = sp::Writer().u8(7).take();  // GETNUMKEYS
  request.insert(request.end(), numKeys.begin(), numKeys.end());
  std::vector<int> held;
  for (int i = 0; i < 256; ++i) {
    const int fd = ctorch::launcher_test::connectLoopback(port);
    if (fd < 0) break;
    std::uint8_t reply[8];
    const bool served = ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size()) &&
                        ::recv(fd, reply, sizeof reply, MSG_WAITALL) == static_cast<ssize_t>(sizeof reply);
    if (!served) {
      ::close(fd);
      break;
    }
    held.push_back(fd);
  }
  return held;
}

} // namespace

// Issue 58.2: an outsider holds the workers' store's connection cap (connections that each sent a
// request, taking every slot that frees). A replacement could not connect ("Connection reset by
// peer"), failed, was replaced again: every restart went in seconds, and the job was lost without
// the group restart that brings a fresh store. Now the agent finds the store turning connections
// away before it replaces, and restarts the group instead.
TEST_CASE("agent: --recovery in-place restarts the group with a fresh store when the workers' store turns new "
          "connections away (issue 58.2)") {
  Fixture f(inPlaceArgs(2, 2));
  f.rendezvous.serveWorkerStore(f.config.controlKey, 8);  // the two workers' sessions, the agent's, and 5 more
  ControlWorkers cw(f);
  std::vector<int> outsider;
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>(static_cast<std::size_t>(n));
    return allSucceed(n);  // the next round's workers, on their fresh store
  });
  pc.onStart = [&](int attempt, const std::vector<WorkerLaunch>& launches) {
    if (attempt == 0)
      cw.declareAll(launches, [&] {
        outsider = holdConnectionCap(f.rendezvous.storePort);
        pc.exitWorker(1, ExitStatus::exited(1));
      });
  };
  // A replacement connects to the workers' store first; turned away, it fails.
  pc.onAdd = [&](const WorkerLaunch& w) {
    ctorch::store::TcpStoreClientOptions o;
    o.timeout = 10s;
    o.retryConnect = false;
    try {
      ctorch::store::TcpStoreClient c("127.0.0.1", static_cast<std::uint16_t>(f.rendezvous.storePort), o);
      c.check({"k"});
      pc.exitWorker(w.localRank, ExitStatus::exited(0));
    } catch (const ctorch::store::StoreError&) {
      pc.exitWorker(w.localRank, ExitStatus::exited(1));
    }
  };
  const int code = f.run(pc);
  for (int fd : outsider) ::close(fd);
  CHECK(code == 0);
  CHECK(cw.errors().empty());
  CHECK(outsider.size() >= 1);
  CHECK(pc.added.empty());         // no replacement sent to a store that turns it away
  CHECK(pc.launches.size() == 2);  // the group restarted (its next round brings a fresh store)
  CHECK(f.rendezvous.rounds == 2);
}

TEST_CASE("agent: --recovery in-place restarts at once after a failure before every rank said it can recover in place") {
  // The README's plain loop (no ResilientTraining) never says it can: a kill costs what a restart
  // costs, not a replacement's start plus a survivor's timeout.
  Fixture f(inPlaceArgs(2, 2));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 0) return std::vector<FakeWorker>{{}, {ExitStatus::killed(SIGKILL)}};
    return allSucceed(n);
  });
  CHECK(f.run(pc) == 0);
  CHECK(pc.added.empty());
  CHECK(pc.launches.size() == 2);
  CHECK(pc.signals == std::vector<int>{SIGTERM});
}

TEST_CASE("agent: --recovery in-place: a rank that says it cannot recover in place makes the run restart the group") {
  // ctorch-train --sharding full says so at start: its spares go, and every later failure restarts
  // the whole group at once (one restart each), as --recovery restart.
  Fixture f(inPlaceArgs(2, 3, {}));  // a preloaded worker by default
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int attempt, int n) {
    if (attempt == 1) return std::vector<FakeWorker>{{}, {ExitStatus::exited(1)}};  // a later fault
    if (attempt == 2) return allSucceed(n);
    return std::vector<FakeWorker>(static_cast<std::size_t>(n));
  });
  pc.onStart = [&](int attempt, const std::vector<WorkerLaunch>& launches) {
    if (attempt == 0) cw.declareAll(launches, [&pc] { pc.exitWorker(1, ExitStatus::killed(SIGKILL)); }, {1});
  };
  pc.onAdd = [](const WorkerLaunch& w) { REQUIRE(w.localRank < 0); };  // preloaded workers only
  CHECK(f.run(pc) == 0);
  CHECK(cw.errors().empty());
  CHECK(pc.launches.size() == 3);  // two faults, two restarts
  CHECK(pc.relabels.empty());      // nothing handed to the preloaded worker
  for (const auto& w : pc.added) CHECK(envValue(w, "CTORCH_PRELOADED") == "1");
  CHECK(pc.added.size() == 1);     // started with the first group, killed when the rank said so; none later
}

TEST_CASE("agent: --recovery in-place kills only the processes the coordinator names: silent ones, never one that "
          "waits in the re-form") {
  Fixture f(inPlaceArgs(3, 3));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int attempt, int n) {
    REQUIRE(attempt == 0);
    return std::vector<FakeWorker>(static_cast<std::size_t>(n));
  });
  pc.onStart = [&](int, const std::vector<WorkerLaunch>& launches) {
    cw.declareAll(launches, [&] {
      // Ranks 0 and 2 lost a peer and wait in the re-form; rank 1 hangs (says nothing).
      for (int r : {0, 2}) {
        cc::Message reform = cc::message(cc::Type::kReform);
        reform.generation = 0;
        reform.value = 1;
        cw.client(r)->send(reform);
      }
      // Both waits are known to the coordinator (it told the agent) before rank 0 asks.
      if (!ControlWorkers::waitFor([&] { return cw.agent().heardInReform(0) && cw.agent().heardInReform(2); }))
        throw std::runtime_error("the agent never heard that ranks 0 and 2 wait in the re-form");
      cc::Message evict = cc::message(cc::Type::kEvictSilent);
      evict.generation = 0;
      evict.value = 0;
      cw.client(0)->send(evict);
      const auto answer = cw.client(0)->receive(std::chrono::steady_clock::now() + 60s);
      if (!answer || answer->type != cc::Type::kEvicting || answer->value != 1 || answer->text != "waiting for rank(s) 1")
        throw std::runtime_error("the coordinator did not evict exactly rank 1");
    });
  };
  pc.onAdd = [&pc](const WorkerLaunch& w) {
    pc.exitWorker(w.localRank, ExitStatus::exited(0));
    pc.finishAll();
  };
  CHECK(f.run(pc) == 0);
  CHECK(cw.errors().empty());
  CHECK(pc.killed == std::vector<pid_t>{101});
  REQUIRE(pc.added.size() == 1);
  CHECK(pc.added[0].localRank == 1);
  CHECK(f.rendezvous.control->stats().killsOrdered == 1);
}

TEST_CASE("agent: --recovery in-place with a spare: the spare takes the failed rank over and a new spare starts") {
  Fixture f(inPlaceArgs(2, 1, {"--spare-workers", "1"}));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int attempt, int n) {
    REQUIRE(attempt == 0);
    return std::vector<FakeWorker>(static_cast<std::size_t>(n));
  });
  pc.onStart = [&](int, const std::vector<WorkerLaunch>& launches) {
    cw.declareAll(launches, [&pc] { pc.exitWorker(1, ExitStatus::killed(SIGKILL)); }, {}, 1);
  };
  pc.onAdd = [&](const WorkerLaunch& w) {
    REQUIRE(w.localRank < 0);  // only spares: they wait
    cw.spare(w);
  };
  pc.onRelabel = [&](int, int to) { finishOnceAssigned(cw, pc, to); };
  CHECK(f.run(pc) == 0);
  CHECK(cw.errors().empty());
  CHECK(pc.launches.size() == 1);
  CHECK(pc.signals.empty());
  CHECK(pc.relabels == std::vector<std::pair<int, int>>{{-1, 1}});
  REQUIRE(pc.added.size() == 2);  // the first spare, and the one started after the hand-over
  const WorkerLaunch& spare = pc.added[0];
  CHECK(spare.localRank == -1);
  CHECK(envValue(spare, "CTORCH_SPARE") == "0-0-1");
  CHECK(envValue(spare, "RANK") == "<unset>");
  CHECK(envValue(spare, "LOCAL_RANK") == "<unset>");
  CHECK(envValue(spare, "TORCHELASTIC_ERROR_FILE") == "<unset>");
  CHECK(envValue(pc.added[1], "CTORCH_SPARE") == "0-0-2");
  // Its assignment came on its own authenticated connection.
  const auto assignments = cw.assignments();
  REQUIRE(assignments.size() == 1);
  CHECK(assignments[0].rank == 1);
  CHECK(assignments[0].value == 1);   // local rank
  CHECK(assignments[0].value2 == 1);  // CTORCH_REPLACEMENT
}

TEST_CASE("agent: --recovery in-place starts a preloaded worker by default, which takes the failed rank over") {
  Fixture f(inPlaceArgs(2, 1, {}));
  f.rendezvous.serveWorkerStore(f.config.controlKey);
  ControlWorkers cw(f);
  FakeProcessContext pc([](int attempt, int n) {
    REQUIRE(attempt == 0);
    return std::vector<FakeWorker>(static_cast<std::size_t>(n));
  });
  pc.onStart = [&](int, const std::vector<WorkerLaunch>& launches) {
    cw.declareAll(launches, [&pc] { pc.exitWorker(1, ExitStatus::killed(SIGKILL)); }, {}, 1);
  };
  pc.onAdd = [&](const WorkerLaunch& w) {
    REQUIRE(w.localRank < 0);  // only preloaded workers: they wait
    cw.spare(w);
  };
  pc.onRelabel = [&](int, int to) { finishOnceAssigned(cw, pc, to); };
  CHECK(f.run(pc) == 0);
  CHECK(cw.errors().empty());
  CHECK(pc.relabels == std::vector<std::pair<int, int>>{{-1, 1}});
  REQUIRE(pc.added.size() == 2);  // the first, and the one started after the hand-over
  for (const auto& w : pc.added) {
    CHECK(envValue(w, "CTORCH_PRELOADED") == "1");
    CHECK(envValue(w, "RANK") == "<unset>");
  }
  const auto assignments = cw.assignments();
  REQUIRE(assignments.size() == 1);
  CHECK(assignments[0].rank == 1);
  CHECK(assignments[0].value2 == 1);
}

TEST_CASE("agent: without --recovery in-place the workers get no CTORCH_RECOVERY") {
  Fixture f({"--nproc-per-node", "2"});
  FakeProcessContext pc([](int, int n) { return allSucceed(n); });
  CHECK(f.run(pc) == 0);
  CHECK(envValue(pc.launches[0][0], "CTORCH_RECOVERY") == "<unset>");
}
