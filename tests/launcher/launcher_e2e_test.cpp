// ctorchrun end to end: the real binary with fake_worker (and Python workers) as real processes.
// The contract for 1..4 workers, restarts in every mode, exit codes, signals and the grace period,
// zero survivors after SIGKILL of the agent, logs, prefixes and interleaving, the failure summary,
// every bad input, and the Python peer check against Debian's torchrun.
#include "ctorch_catch.hpp"

#include "launcher_test_util.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <pty.h>
#include <poll.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

using namespace ctorch;
using namespace ctorch::launcher_test;
using namespace std::chrono_literals;

namespace {

std::vector<std::string> args(std::initializer_list<std::string> head, std::initializer_list<std::string> worker) {
  std::vector<std::string> out(head);
  out.push_back(fakeWorkerBin());
  out.insert(out.end(), worker);
  return out;
}

// Waits until `count` lines containing `text` appeared in the process output. The deadline only
// keeps a broken run from hanging: nothing is expected to take long.
bool waitForLines(test::Process& p, const std::string& text, int count, std::chrono::milliseconds deadline = 60s) {
  return eventually(
      [&] {
        std::string out = p.outputSoFar();
        int n = 0;
        for (std::size_t pos = out.find(text); pos != std::string::npos; pos = out.find(text, pos + 1)) ++n;
        return n >= count;
      },
      deadline);
}

std::size_t countOf(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (auto p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// ctorchrun with its stdout on `stdoutFd` (a pipe nobody reads, a pty) and its stderr into
// `stderrPath`, in its own process group.
pid_t spawnWithStdout(const test::SpawnOptions& so, int stdoutFd, const std::string& stderrPath,
                      int stderrFd = -1) {
  std::vector<std::string> envStore;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    std::string key = kv.substr(0, kv.find('='));
    if (so.setEnv.count(key) || std::find(so.unsetEnv.begin(), so.unsetEnv.end(), key) != so.unsetEnv.end()) continue;
    envStore.push_back(kv);
  }
  for (const auto& [k, v] : so.setEnv) envStore.push_back(k + "=" + v);
  std::vector<std::string> argvStore = so.argv;
  std::vector<char*> argv, envp;
  for (auto& a : argvStore) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : envStore) envp.push_back(e.data());
  envp.push_back(nullptr);
  int err = stderrFd >= 0 ? ::fcntl(stderrFd, F_DUPFD_CLOEXEC, 3)
                          : ::open(stderrPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  REQUIRE(err >= 0);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::dup2(stdoutFd, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    ::execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  ::setpgid(pid, pid);
  ::close(err);
  return pid;
}

// The wait status, or nullopt after killing the process group at the deadline.
std::optional<int> waitWithin(pid_t pid, std::chrono::milliseconds deadline) {
  auto end = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    if (std::chrono::steady_clock::now() >= end) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return std::nullopt;
    }
    std::this_thread::sleep_for(10ms);
  }
}

// Guards against leftovers when an assertion fails half-way.
struct MarkGuard {
  std::string mark;
  explicit MarkGuard(const std::string& tag) : mark(uniqueMark(tag)) {}
  ~MarkGuard() { killMarked(mark); }
};

} // namespace

// ---- The worker contract ------------------------------------------------------------------------

TEST_CASE("e2e contract: every variable for 1 to 4 workers (standalone)") {
  for (int n = 1; n <= 4; ++n) {
    auto r = runCtorchrun(args({"--standalone", "--nproc-per-node", std::to_string(n)}, {"env"}));
    INFO("nproc " << n << ": " << r.describe() << "\n" << r.output);
    REQUIRE(r.ok());
    auto env = envByRank(r.output);
    REQUIRE(env.size() == static_cast<std::size_t>(n));
    std::set<std::string> ports, runIds;
    for (int rank = 0; rank < n; ++rank) {
      auto& e = env[rank];
      CHECK(e["RANK"] == std::to_string(rank));
      CHECK(e["LOCAL_RANK"] == std::to_string(rank));
      CHECK(e["GROUP_RANK"] == "0");
      CHECK(e["ROLE_RANK"] == std::to_string(rank));
      CHECK(e["ROLE_NAME"] == "default");
      CHECK(e["LOCAL_WORLD_SIZE"] == std::to_string(n));
      CHECK(e["WORLD_SIZE"] == std::to_string(n));
      CHECK(e["ROLE_WORLD_SIZE"] == std::to_string(n));
      CHECK(e["GROUP_WORLD_SIZE"] == "1");
      CHECK(e["MASTER_ADDR"] == "127.0.0.1");
      CHECK(std::stoi(e["MASTER_PORT"]) > 0);
      CHECK(e["TORCHELASTIC_RESTART_COUNT"] == "0");
      CHECK(e["TORCHELASTIC_MAX_RESTARTS"] == "0");
      CHECK(e["TORCHELASTIC_RUN_ID"].size() == 36);
      CHECK(e["TORCHELASTIC_USE_AGENT_STORE"] == "True");
      CHECK(e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1");
      CHECK(e["NCCL_ASYNC_ERROR_HANDLING"] == "1");
      CHECK(e["OMP_NUM_THREADS"] == (n > 1 ? "1" : "<unset>"));
      // torchrun's layout: <log-dir>/<run_id>_<random>/attempt_<k>/<local_rank>/error.json.
      CHECK(std::regex_search(e["TORCHELASTIC_ERROR_FILE"],
                              std::regex("/" + e["TORCHELASTIC_RUN_ID"] + "_[A-Za-z0-9]{6}/attempt_0/" +
                                         std::to_string(rank) + "/error\\.json$")));
      ports.insert(e["MASTER_PORT"]);
      runIds.insert(e["TORCHELASTIC_RUN_ID"]);
    }
    CHECK(ports.size() == 1);
    CHECK(runIds.size() == 1);
  }
}

TEST_CASE("e2e contract: static master port / run id / role and an explicit OMP_NUM_THREADS") {
  // The port must reach the workers as given: a fixed one, drawn again if another server has it.
  int port = 0;
  auto r = test::withFreshPort([&](int candidate) {
    port = candidate;
    return runCtorchrun(args({"--nproc-per-node", "2", "--master-port", std::to_string(port), "--rdzv-id", "job7",
                              "--role", "trainer", "--max-restarts", "3"},
                             {"env"}),
                        {{"OMP_NUM_THREADS", "4"}});
  });
  INFO(r.output);
  REQUIRE(r.ok());
  auto env = envByRank(r.output, "trainer");
  REQUIRE(env.size() == 2);
  for (auto& [rank, e] : env) {
    CHECK(e["MASTER_PORT"] == std::to_string(port));
    CHECK(e["TORCHELASTIC_RUN_ID"] == "job7");
    CHECK(e["ROLE_NAME"] == "trainer");
    CHECK(e["TORCHELASTIC_MAX_RESTARTS"] == "3");
    CHECK(e["OMP_NUM_THREADS"] == "4");
  }
}

TEST_CASE("e2e contract: PET_ variables configure ctorchrun like flags") {
  auto r = runCtorchrun(args({}, {"env"}), {{"PET_NPROC_PER_NODE", "3"}, {"PET_STANDALONE", "1"}});
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(envByRank(r.output).size() == 3);
}

// Issue 28.7: a static --nnodes 2 whose other node never comes was silent until Ctrl-C.
TEST_CASE("e2e contract: a static node waiting for the others says so every few seconds, and stops on SIGTERM") {
  const std::string waiting = "waiting for the other nodes: 1 of 2 here";
  int port = 0;
  std::unique_ptr<test::Process> alone;
  test::withFreshPort([&](int candidate) {
    port = candidate;
    alone = std::make_unique<test::Process>(ctorchrunSpawn(
        args({"--log-level", "info", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
              std::to_string(port), "--rdzv-id", "lonely"},
             {"env"})));
    // It says so every 5 s; it exits at once if the port was taken.
    eventually([&] { return alone->outputSoFar().find(waiting) != std::string::npos || !alone->running(); }, 60s);
    return !alone->running() && test::portTaken(alone->outputSoFar());
  });
  INFO(alone->outputSoFar());
  REQUIRE(alone->running());
  CHECK_THAT(alone->outputSoFar(), Catch::Contains(waiting));
  CHECK_THAT(alone->outputSoFar(), Catch::Contains("127.0.0.1:" + std::to_string(port) + ", run id lonely"));
  ::kill(alone->pid(), SIGTERM);  // ctorchrun itself, as Ctrl-C or scancel would
  auto r = alone->wait();
  INFO(r.output);
  CHECK_FALSE(r.timedOut);
  CHECK_FALSE(r.ok());
}

TEST_CASE("e2e contract: two static nodes on loopback: node ranks and global ranks") {
  int port = 0;
  auto [r0, r1] = test::withFreshPort([&](int candidate) {
    port = candidate;
    auto node = [&](int rank) {
      return ctorchrunSpawn(args({"--nnodes", "2", "--node-rank", std::to_string(rank), "--nproc-per-node", "2",
                                  "--master-addr", "127.0.0.1", "--master-port", std::to_string(port)},
                                 {"env"}));
    };
    test::Process second(node(1));  // starts first and waits for node 0's store
    test::Process first(node(0));
    auto firstResult = first.wait();
    // Node 0 could not serve the port: node 1 may be talking to whoever has it. Ended, not waited for.
    if (test::portTaken(firstResult)) second.signalGroup(SIGKILL);
    return std::make_pair(firstResult, second.wait());
  });
  INFO("node 0: " << r0.output << "\nnode 1: " << r1.output);
  REQUIRE(r0.ok());
  REQUIRE(r1.ok());
  for (auto [out, nodeRank] : {std::pair<std::string, int>{r0.output, 0}, {r1.output, 1}}) {
    // Several nodes: the console prefix carries the host and the global rank.
    std::map<int, std::map<std::string, std::string>> env;
    for (const auto& line : linesWith(out, "[")) {
      auto colon = line.find(":default");
      auto close = line.find("]:ENV ");
      if (colon == std::string::npos || close == std::string::npos) continue;
      int rank = std::stoi(line.substr(colon + 8, close - colon - 8));
      auto kv = line.substr(close + 6);
      env[rank][kv.substr(0, kv.find('='))] = kv.substr(kv.find('=') + 1);
    }
    REQUIRE(env.size() == 2);
    for (auto& [rank, e] : env) {
      CHECK(rank / 2 == nodeRank);
      CHECK(e["RANK"] == std::to_string(rank));
      CHECK(e["LOCAL_RANK"] == std::to_string(rank % 2));
      CHECK(e["GROUP_RANK"] == std::to_string(nodeRank));
      CHECK(e["WORLD_SIZE"] == "4");
      CHECK(e["GROUP_WORLD_SIZE"] == "2");
      CHECK(e["MASTER_PORT"] == std::to_string(port));
    }
  }
}

TEST_CASE("e2e contract: -m runs a Python module under PYTHON_EXEC") {
  auto r = runCtorchrun({"--standalone", "--nproc-per-node", "2", "-m", "platform"});
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(linesWith(r.output, "[default1]:Linux").size() == 1);
}

// ---- Restarts and exit codes -------------------------------------------------------------------------

TEST_CASE("e2e restart: the whole group restarts until it succeeds / in every mode") {
  for (std::string mode : {"standalone", "static"}) {
    std::vector<std::string> a = {"--nproc-per-node", "2", "--max-restarts", "3"};
    if (mode == "standalone") a.push_back("--standalone");
    else {
      a.push_back("--master-port");
      a.push_back("0");  // one node: its store binds any port and tells its workers
    }
    a.push_back(fakeWorkerBin());
    for (std::string w : {"print", "attempt {rank}", "if-restart-below", "2", "exit", "3", "env"}) a.push_back(w);
    auto r = runCtorchrun(a);
    INFO(mode << ": " << r.describe() << "\n" << r.output);
    CHECK(r.ok());
    auto env = envByRank(r.output);  // only the last attempt gets past "exit 3"
    REQUIRE(env.size() == 2);
    CHECK(env[0]["TORCHELASTIC_RESTART_COUNT"] == "2");
    CHECK(countOf(r.output, "restarting, restart") == 2);
  }
}

TEST_CASE("e2e restart: every round's workers get a store without the earlier rounds' keys") {
  // PyTorch 2.6+ workers use the agent's store without a per-attempt key prefix: a key left by the
  // crashed round (Gloo's addresses) would be read by the restarted one. One worker writes a key,
  // then the group crashes; the restarted workers must not see it, in either single-node mode.
  for (std::string mode : {"standalone", "static"}) {
    std::vector<std::string> a = {"--nproc-per-node", "2", "--max-restarts", "2"};
    if (mode == "standalone") a.push_back("--standalone");
    else {
      a.push_back("--master-port");
      a.push_back("0");  // one node: its store binds any port and tells its workers
    }
    a.push_back(fakeWorkerBin());
    // Rank 0 sets the key and only then fails; rank 1 waits to be stopped (the key is set for sure).
    for (std::string w : {"if-rank", "0", "if-restart-below", "1", "store-set", "stale", "if-rank", "0",
                          "if-restart-below", "1", "print", "stale key set", "if-rank", "0", "if-restart-below", "1",
                          "exit", "3", "if-restart-below", "1", "hang", "store-has", "stale", "env"})
      a.push_back(w);
    auto r = runCtorchrun(a);
    INFO(mode << ": " << r.describe() << "\n" << r.output);
    CHECK(r.ok());
    CHECK(countOf(r.output, "[default0]:stale key set") == 1);  // control: the crashed round wrote it
    CHECK(countOf(r.output, "STORE stale present") == 0);
    CHECK(countOf(r.output, "STORE stale absent") == 2);  // both workers of the restarted round
    auto env = envByRank(r.output);
    REQUIRE(env.size() == 2);
    CHECK(env[0]["TORCHELASTIC_RESTART_COUNT"] == "1");
    CHECK(env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"]);
  }
}

TEST_CASE("e2e restart: exhausted restarts end with the root cause's exit code and a summary") {
  auto r = runCtorchrun(args({"--standalone", "--nproc-per-node", "3", "--max-restarts", "1"},
                             {"if-rank", "2", "exit", "42", "hang"}));
  INFO(r.output);
  CHECK(r.exitCode == 42);
  CHECK(r.output.find("FAILED: 1 of 3 workers failed (attempt 2 of 2") != std::string::npos);
  CHECK(r.output.find("root cause (first failure observed): rank 2, exit 42") != std::string::npos);
  CHECK(r.output.find("2 stopped by ctorchrun") != std::string::npos);
}

TEST_CASE("e2e exit codes: a worker's signal becomes 128+N / not a blanket 1") {
  auto segv = runCtorchrun(args({"--standalone", "--nproc-per-node", "2"}, {"if-rank", "1", "signal", "SEGV", "hang"}));
  INFO(segv.output);
  CHECK(segv.exitCode == 128 + SIGSEGV);
  CHECK(segv.output.find("signal 11 (SIGSEGV)") != std::string::npos);
  auto abrt = runCtorchrun(args({"--standalone"}, {"signal", "ABRT"}));
  CHECK(abrt.exitCode == 128 + SIGABRT);
  auto code = runCtorchrun(args({"--standalone"}, {"exit", "7"}));
  CHECK(code.exitCode == 7);
}

TEST_CASE("e2e error file: the worker's recorded message appears in the summary") {
  auto r = runCtorchrun(args({"--standalone", "--nproc-per-node", "2"},
                             {"if-rank", "1", "error-file", "RuntimeError: boom at step 3", "if-rank", "1",
                              "exit", "5", "hang"}));
  INFO(r.output);
  CHECK(r.exitCode == 5);
  CHECK(r.output.find("RuntimeError: boom at step 3") != std::string::npos);
  CHECK(r.output.find("fake_worker: frame 2") != std::string::npos);  // the traceback
}

// ---- Signals --------------------------------------------------------------------------------------

TEST_CASE("e2e signals: SIGTERM / SIGINT and SIGUSR1 to ctorchrun reach every worker - exit 128+N") {
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) {
    test::Process p(ctorchrunSpawn(args({"--standalone", "--nproc-per-node", "2", "--max-restarts", "3"},
                                        {"trap-term", "0", "print", "ready", "hang"})));
    REQUIRE(waitForLines(p, "]:ready", 2));
    ::kill(p.pid(), sig);
    auto r = p.wait();
    INFO(strsignal(sig) << ": " << r.describe() << "\n" << r.output);
    CHECK(r.exitCode == 128 + sig);
    if (sig == SIGTERM) CHECK(countOf(r.output, "]:got SIGTERM") == 2);  // forwarded, handled
    CHECK(countOf(r.output, "]:ready") == 2);  // not restarted
  }
}

// Issue 13.1: `timeout` signals ctorchrun and then its whole process group; Slurm signals the step's
// tree while srun forwards too. Those copies are one stop: every worker gets exactly one SIGTERM,
// saves its snapshot (which takes a while) and exits 75 - nobody is SIGKILLed.
TEST_CASE("e2e signals: copies of one stop (timeout / process-group kill) are one stop - snapshot saved, exit 75") {
  test::TempDir dir;
  const std::string snapshot = (dir / "step").string();
  auto check = [&](const test::ProcessResult& r) {
    INFO(r.describe() << "\n" << r.output);
    CHECK(r.exitCode == 75);
    CHECK(countOf(r.output, "]:preempted at step") == 2);
    CHECK(countOf(r.output, "]:stop signals received: 1") == 2);
    CHECK(r.output.find("grace period over") == std::string::npos);
    CHECK(r.output.find("killing the workers") == std::string::npos);
    CHECK(std::filesystem::exists(snapshot));
  };
  const std::vector<std::string> job = args({"--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "20"},
                                            {"save-delay", "1500", "train", snapshot, "100000", "50"});
  SECTION("coreutils timeout: the signal to ctorchrun, then to its process group") {
    auto so = ctorchrunSpawn(job);
    so.argv.insert(so.argv.begin(), {"timeout", "-s", "TERM", "--preserve-status", "600"});
    test::Process p(so);
    REQUIRE(waitForLines(p, "]:resumed at step", 2));
    // Its time is up once the workers run: timeout takes SIGALRM as its own timer's expiry.
    ::kill(p.pid(), SIGALRM);
    check(p.wait());
  }
  SECTION("kill PID then kill -TERM -PGID a moment later (not coalesced by the kernel)") {
    test::Process p(ctorchrunSpawn(job));
    REQUIRE(waitForLines(p, "]:resumed at step", 2));
    ::kill(p.pid(), SIGTERM);
    // The agent has taken the first copy (two pending copies would be one for the kernel).
    REQUIRE(waitForLines(p, "received SIGTERM: forwarding it to the workers", 1));
    p.signalGroup(SIGTERM);
    check(p.wait());
  }
}

TEST_CASE("e2e signals: a deliberate second stop after the duplicate window kills at once") {
  test::TempDir dir;
  test::Process p(ctorchrunSpawn(args({"--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "30"},
                                      {"save-delay", "20000", "train", (dir / "step").string(), "100000", "50"})));
  REQUIRE(waitForLines(p, "]:resumed at step", 2));
  ::kill(p.pid(), SIGTERM);
  REQUIRE(waitForLines(p, "received SIGTERM: forwarding it to the workers", 1));
  // Read by the agent before it said so: 1.5 s from here is past kDuplicateStopWindow for sure.
  std::this_thread::sleep_for(1500ms);
  ::kill(p.pid(), SIGTERM);
  auto r = p.wait();
  INFO(r.describe() << "\n" << r.output);
  CHECK(r.exitCode == 128 + SIGTERM);
  // The second signal killed them, not the 30 s grace, and before their 20 s save ended.
  const auto now = r.output.find("received SIGTERM again while stopping: killing the workers now");
  CHECK(now != std::string::npos);
  CHECK(r.output.find("grace period over") == std::string::npos);  // the grace never ran out
  CHECK(r.output.find("]:preempted at step") == std::string::npos);
}

TEST_CASE("e2e signals: a worker ignoring SIGTERM is killed after --shutdown-timeout") {
  test::TempDir dir;
  const std::string gate = (dir / "gate").string();
  test::Process p(ctorchrunSpawn(args({"--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "10"},
                                      {"ignore-term", "print", "ready", "wait-file", gate, "print", "released", "hang"})));
  REQUIRE(waitForLines(p, "]:ready", 2));
  ::kill(p.pid(), SIGTERM);
  // The grace period is granted: the workers, told to stop, still run when the test acts after that.
  REQUIRE(waitForLines(p, "]:ignoring SIGTERM", 2));
  test::writeFile(gate, "");
  REQUIRE(waitForLines(p, "]:released", 2));
  auto r = p.wait();
  INFO(r.output);
  CHECK(r.exitCode == 128 + SIGTERM);
  // ... and when it runs out, they are killed: after both had gone on.
  const auto killed = r.output.find("grace period over");
  REQUIRE(killed != std::string::npos);
  CHECK(countOf(r.output.substr(0, killed), "]:released") == 2);
}

// ---- No orphans ---------------------------------------------------------------------------------

TEST_CASE("e2e orphans: SIGKILL of ctorchrun leaves zero survivors (workers / grandchildren / setsid)") {
  MarkGuard g("sigkill");
  test::Process p(ctorchrunSpawn(args({"--standalone", "--nproc-per-node", "2"},
                                      {"spawn", g.mark, "spawn", g.mark, "setsid", "spawn-tree", g.mark,
                                       "print", "ready", "hang"}),
                                 {{"CTORCH_TEST_MARK", g.mark}}));
  REQUIRE(waitForLines(p, "]:ready", 2));
  // Control: the marked tree exists (agent, 2 supervisors, 2 workers, 4 grandchildren each).
  REQUIRE(eventually([&] { return processesMarked(g.mark).size() >= 13; }, 60s));
  ::kill(p.pid(), SIGKILL);
  auto r = p.wait();
  CHECK(r.termSignal == SIGKILL);
  bool none = eventually([&] { return processesMarked(g.mark).empty(); }, 60s);
  INFO("survivors: " << Catch::Detail::stringify(processesMarked(g.mark)));
  CHECK(none);
}

TEST_CASE("e2e orphans: a worker's leftovers are cleaned up on success and on failure") {
  MarkGuard g("leftover");
  auto ok = runCtorchrun(args({"--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "2"},
                              {"spawn", g.mark, "setsid", "spawn", g.mark, "print", "done"}),
                         {{"CTORCH_TEST_MARK", g.mark}});
  INFO(ok.output);
  CHECK(ok.ok());
  CHECK(processesMarked(g.mark).empty());
  auto bad = runCtorchrun(args({"--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "2"},
                               {"spawn-tree", g.mark, "if-rank", "0", "exit", "4", "hang"}),
                          {{"CTORCH_TEST_MARK", g.mark}});
  CHECK(bad.exitCode == 4);
  CHECK(processesMarked(g.mark).empty());
}

// ---- Logs -----------------------------------------------------------------------------------------

TEST_CASE("e2e logs: prefixes / --tee / --redirects and the log directory layout") {
  test::TempDir dir;
  auto r = runCtorchrun(args({"--nproc-per-node", "2", "--master-port", "0", "--rdzv-id", "logjob", "--log-dir",
                              dir.path().string(), "--tee", "1", "--redirects", "2"},
                             {"print", "hello {rank}", "eprint", "problem {rank}"}));
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(r.output.find("[default0]:hello 0\n") != std::string::npos);
  CHECK(r.output.find("[default1]:hello 1\n") != std::string::npos);
  CHECK(r.output.find("problem") == std::string::npos);  // stderr redirected: file only
  // torchrun's layout: <log-dir>/<run_id>_<random>/attempt_<k>/<local_rank>/.
  std::vector<std::filesystem::path> runs;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) runs.push_back(e.path());
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].filename().string().rfind("logjob_", 0) == 0);
  for (int rank = 0; rank < 2; ++rank) {
    auto rd = runs[0] / "attempt_0" / std::to_string(rank);
    CHECK(test::readFile(rd / "stdout.log") == "hello " + std::to_string(rank) + "\n");
    CHECK(test::readFile(rd / "stderr.log") == "problem " + std::to_string(rank) + "\n");
  }
}

// Issue 13.2: -r without --log-dir used to write into a temporary directory, never name it and
// delete it on success; a reused --log-dir overwrote the previous run.
TEST_CASE("e2e logs: -r without --log-dir keeps and names the files / a reused --log-dir keeps both runs") {
  auto r = runCtorchrun(args({"--log-level", "info", "--standalone", "-r", "3"}, {"print", "only in the file"}));
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(r.output.find("]:only in the file") == std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex(R"(worker logs and error files: (\S+))")));
  const std::filesystem::path run = m[1].str();
  CHECK(test::readFile(run / "attempt_0" / "0" / "stdout.log") == "only in the file\n");
  std::filesystem::remove_all(run.parent_path());

  test::TempDir dir;
  for (const char* text : {"first run", "second run"}) {
    auto again = runCtorchrun(args({"--nproc-per-node", "1", "--master-port", "0", "--rdzv-id", "samejob",
                                    "--log-dir", dir.path().string(), "-r", "1"},
                                   {"print", text}));
    REQUIRE(again.ok());
  }
  std::set<std::string> outputs;
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    outputs.insert(test::readFile(e.path() / "attempt_0" / "0" / "stdout.log"));
  CHECK(outputs == std::set<std::string>{"first run\n", "second run\n"});
}

// Issue 13.8: after a clean stop (every worker saved its state, exit 75) ctorchrun claimed "worker
// logs kept in /tmp/ctorchrun_..." - nothing failed, so nothing is kept, and nothing piles up.
TEST_CASE("e2e logs: a clean stop (exit 75) leaves no temporary directory and claims none / a failure keeps it") {
  test::TempDir tmp("ctorch-tmpdir");
  test::TempDir dir;
  test::Process p(ctorchrunSpawn(args({"--log-level", "info", "--standalone", "--nproc-per-node", "2"},
                                      {"train", (dir / "step").string(), "100000", "50"}),
                                 {{"TMPDIR", tmp.path().string()}}));
  REQUIRE(waitForLines(p, "]:resumed at step", 2));
  ::kill(p.pid(), SIGTERM);
  auto r = p.wait();
  INFO(r.describe() << "\n" << r.output);
  CHECK(r.exitCode == 75);
  CHECK(r.output.find("kept in") == std::string::npos);
  CHECK(std::filesystem::is_empty(tmp.path()));
  auto failed = runCtorchrun(args({"--log-level", "info", "--standalone"}, {"exit", "3"}), {{"TMPDIR", tmp.path().string()}});
  INFO(failed.output);
  CHECK(failed.exitCode == 3);
  CHECK(failed.output.find("worker logs and error files kept in " + tmp.path().string()) != std::string::npos);
  CHECK_FALSE(std::filesystem::is_empty(tmp.path()));
}

TEST_CASE("e2e logs: --local-ranks-filter shows only the chosen ranks") {
  auto r = runCtorchrun(args({"--standalone", "--nproc-per-node", "3", "--local-ranks-filter", "1"},
                             {"print", "line {rank}"}));
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(r.output.find("[default1]:line 1") != std::string::npos);
  CHECK(r.output.find("line 0") == std::string::npos);
  CHECK(r.output.find("line 2") == std::string::npos);
}

TEST_CASE("e2e logs: lines of four fast workers never interleave mid-line") {
  const int kLines = 2000;
  auto r = runCtorchrun(args({"--standalone", "--nproc-per-node", "4"}, {"lines", std::to_string(kLines), "300"}));
  REQUIRE(r.ok());
  std::regex line(R"(\[default(\d)\]:L r(\d) n\d+ ([a-z])+ END)");
  std::istringstream in(r.output);
  std::string l;
  int good = 0, bad = 0;
  std::string firstBad;
  while (std::getline(in, l)) {
    if (l.rfind("[default", 0) != 0) continue;
    std::smatch m;
    if (std::regex_match(l, m, line) && m[1] == m[2]) {
      ++good;
    } else {
      if (!bad) firstBad = l.substr(0, 200);
      ++bad;
    }
  }
  INFO("first malformed line: " << firstBad);
  CHECK(bad == 0);
  CHECK(good == 4 * kLines);
}

// Issue 12.5: `ctorchrun ... | less` (paused) or a stuck log shipper. The agent must act on a
// worker's exit and on SIGTERM while its stdout is full: output that cannot be written is dropped
// (counted), never waited for.
TEST_CASE("e2e console: a stdout pipe nobody reads never blocks the agent - exit code and SIGTERM are prompt") {
  test::TempDir dir;
  int pipeFds[2];
  REQUIRE(::pipe2(pipeFds, O_CLOEXEC) == 0);  // the test never reads pipeFds[0]
  const std::string errPath = (dir / "stderr").string();
  // 8 MB of output: more than the pipe and ctorchrun's console buffer (4 MiB) hold.
  SECTION("a worker floods the console, then exits 7: ctorchrun exits 7") {
    pid_t pid = spawnWithStdout(ctorchrunSpawn(args({"--standalone"}, {"lines", "40000", "200", "exit", "7"})),
                                pipeFds[1], errPath);
    auto status = waitWithin(pid, 120s);  // a blocked agent never exits: only that hits the bound
    INFO(test::readFile(errPath));
    REQUIRE(status);
    CHECK(WIFEXITED(*status));
    CHECK(WEXITSTATUS(*status) == 7);
    CHECK(test::readFile(errPath).find("bytes of worker output were dropped: the console was not read") !=
          std::string::npos);
  }
  SECTION("a worker floods the console and hangs: SIGTERM still stops everything") {
    pid_t pid = spawnWithStdout(
        ctorchrunSpawn(args({"--standalone", "--nproc-per-node", "2"}, {"lines", "40000", "200", "eprint", "flooded", "hang"})),
        pipeFds[1], errPath);
    bool flooded = eventually([&] { return countOf(test::readFile(errPath), "]:flooded") == 2; }, 120s);
    ::kill(pid, SIGTERM);
    auto status = waitWithin(pid, 120s);  // a blocked agent never acts on it: only that hits the bound
    INFO(test::readFile(errPath));
    CHECK(flooded);  // the agent kept passing stderr on while stdout was stuck
    REQUIRE(status);
    CHECK(WIFEXITED(*status));
    CHECK(WEXITSTATUS(*status) == 128 + SIGTERM);
    // The workers ended on the forwarded SIGTERM, not by the SIGKILL after the grace period.
    CHECK(test::readFile(errPath).find("grace period over") == std::string::npos);
  }
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);
}

// Issue 27.8: stdout and stderr on one pipe nobody reads. The workers' output was already
// non-blocking, but the agent's own log lines (a worker failed, the failure summary) were blocking
// writes to the same pipe: ctorchrun hung on its first line after the pipe filled.
TEST_CASE("e2e console: stdout and stderr on one pipe nobody reads - the agent's own lines never block it") {
  int pipeFds[2];
  REQUIRE(::pipe2(pipeFds, O_CLOEXEC) == 0);  // the test never reads pipeFds[0]
  pid_t pid = spawnWithStdout(ctorchrunSpawn(args({"--standalone", "--nproc-per-node", "2"},
                                                  {"lines", "50000", "200", "exit", "7"})),
                              pipeFds[1], "", pipeFds[1]);
  auto status = waitWithin(pid, 120s);
  REQUIRE(status);  // not killed at the deadline
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 7);
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);
}

// Issue 27.7: --tee on a full file system (a 256 KiB tmpfs; root only). The file ends where the
// disk did, which is said once when it happens and again at the end; the console keeps every line.
TEST_CASE("e2e logs: a --tee file on a full disk is said once and again at the end, the console keeps every line") {
  if (::geteuid() != 0) CTORCH_SKIP("mounting a tmpfs needs root");
  test::TempDir dir;
  const auto logDir = dir / "logs";
  std::filesystem::create_directories(logDir);
  if (::mount("tmpfs", logDir.c_str(), "tmpfs", 0, "size=256k") != 0)
    CTORCH_SKIP(std::string("cannot mount a tmpfs here: ") + std::strerror(errno));
  struct Unmount {
    std::filesystem::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{logDir};
  auto r = runCtorchrun(args({"--standalone", "--log-dir", logDir.string(), "--tee", "3"}, {"lines", "3000", "120"}));
  INFO(r.output.substr(0, 2000) << "\n...\n" << r.output.substr(r.output.size() > 3000 ? r.output.size() - 3000 : 0));
  CHECK(r.ok());
  CHECK(countOf(r.output, "cannot write the log file") == 1);
  CHECK(countOf(r.output, "No space left on device") == 2);  // when it happened, and at the end
  CHECK(r.output.find("1 worker log file(s) are incomplete") != std::string::npos);
  CHECK(countOf(r.output, "]:L r0 n") == 3000);
}

// Issue 13.4: tqdm writes "\r 33%|###" without a newline; on a terminal it must show at once, not
// when the line (or the job) ends.
TEST_CASE("e2e console: on a terminal, partial lines (CR progress bars) pass through at once") {
  test::TempDir dir;
  const std::string gate = (dir / "go-on").string();
  int master = -1, slave = -1;
  REQUIRE(::openpty(&master, &slave, nullptr, nullptr, nullptr) == 0);
  ::fcntl(master, F_SETFD, FD_CLOEXEC);
  // The worker holds its partial line until the test has looked at the terminal.
  pid_t pid = spawnWithStdout(
      ctorchrunSpawn(args({"--standalone"}, {"partial", "\\r 33%|###", "wait-file", gate, "partial",
                                             "\\r 66%|######", "print", "", "print", "done"})),
      slave, (dir / "stderr").string());
  ::close(slave);
  std::string seen;
  auto readSome = [&](int ms) {
    pollfd p{master, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return false;
    char buf[4096];
    ssize_t n = ::read(master, buf, sizeof buf);
    if (n <= 0) return false;  // EIO once every slave is closed
    seen.append(buf, static_cast<std::size_t>(n));
    return true;
  };
  // Bounds against a hang only.
  auto start = std::chrono::steady_clock::now();
  while (seen.find("33%") == std::string::npos && std::chrono::steady_clock::now() - start < 60s) readSome(100);
  INFO("terminal so far: " << Catch::Detail::stringify(seen));
  CHECK(seen.find("[default0]: 33%|###") != std::string::npos);
  CHECK(seen.find("done") == std::string::npos);  // shown while the worker still waits
  test::writeFile(gate, "");
  start = std::chrono::steady_clock::now();
  while (seen.find("done") == std::string::npos && std::chrono::steady_clock::now() - start < 60s) readSome(100);
  auto status = waitWithin(pid, 60s);
  while (readSome(50)) {
  }
  ::close(master);
  REQUIRE(status);
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 0);
  CHECK(seen.find("\r[default0]: 66%|######") != std::string::npos);
  CHECK(seen.find("[default0]:done") != std::string::npos);
}

// ---- Bad input --------------------------------------------------------------------------------------

TEST_CASE("e2e bad input: one line naming the value / non-zero exit / no hang / no stray process") {
  MarkGuard g("badinput");
  int busyPort = 0;
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(listener, 1) == 0);
  socklen_t len = sizeof a;
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
  busyPort = ntohs(a.sin_port);
  test::TempDir dir;
  auto notExec = (dir / "not_executable").string();
  test::writeFile(notExec, "#!/bin/sh\necho hi\n");

  struct Case {
    std::vector<std::string> args;
    std::string mustContain;
    int exitCode;
  };
  std::vector<Case> cases = {
      {{"--bogus-flag", "/bin/true"}, "'--bogus-flag'", 2},
      {{"--nnodes", "3:1", "/bin/true"}, "'3:1'", 2},
      {{"--nproc-per-node", "0", "/bin/true"}, "'0'", 2},
      {{"--nproc-per-node", "abc", "/bin/true"}, "'abc'", 2},
      {{"--master-port", "70000", "/bin/true"}, "'70000'", 2},
      {{"--master-port", std::to_string(busyPort), "/bin/true"}, std::to_string(busyPort), 3},
      {{"--rdzv-backend", "nosuch", "/bin/true"}, "'nosuch'", 2},
      {{"--rdzv-conf", "timeout", "/bin/true"}, "'timeout'", 2},
      {{"--nproc-per-node", "2"}, "missing the training program", 2},
      {{notExec}, "not executable", 126},
      {{(dir / "missing_prog").string()}, "not found", 127},
      {{"--nnodes"}, "--nnodes", 2},
  };
  bool noGpu = true;
  for (const char* p : {"/proc/driver/nvidia/gpus", "/dev/nvidia0"})
    if (std::filesystem::exists(p)) noGpu = false;
  if (noGpu) cases.push_back({{"--nproc-per-node", "gpu", "/bin/true"}, "'gpu'", 2});
  else WARN("this machine has an NVIDIA GPU: the 'gpu with no GPU' case is covered by config_test only");

  for (const auto& c : cases) {
    auto r = runCtorchrun(c.args, {{"CTORCH_TEST_MARK", g.mark}}, 60s);
    INFO("args " << Catch::Detail::stringify(c.args) << "\n" << r.describe() << "\n" << r.output);
    CHECK_FALSE(r.timedOut);
    CHECK(r.exitCode == c.exitCode);
    std::string out = r.output;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    CHECK(out.find('\n') == std::string::npos);  // exactly one line
    CHECK(out.rfind("ctorchrun: error: ", 0) == 0);
    CHECK(out.find(c.mustContain) != std::string::npos);
    CHECK(out.find("terminate called") == std::string::npos);
    CHECK(processesMarked(g.mark).empty());
  }
  ::close(listener);
}

TEST_CASE("e2e help and version") {
  auto h = runCtorchrun({"--help"});
  CHECK(h.ok());
  CHECK(h.output.find("Worker contract") != std::string::npos);
  CHECK(h.output.find("TORCHELASTIC_USE_AGENT_STORE") != std::string::npos);
  auto v = runCtorchrun({"--version"});
  CHECK(v.ok());
  CHECK(v.output.rfind("ctorchrun ", 0) == 0);
}

// Issue 13.9: torchrun's users type prefixes (argparse); a filter naming no existing rank hid everything.
TEST_CASE("e2e help: exit code 75 and value types listed / --nproc 2 / --local-ranks-filter 5 of 2 refused") {
  auto h = runCtorchrun({"--help"});
  CHECK(h.output.find("\n  75 ") != std::string::npos);
  CHECK(h.output.find(" TEXT") == std::string::npos);
  auto r = runCtorchrun(args({"--stand", "--nproc", "2"}, {"env"}));
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(envByRank(r.output).size() == 2);
  auto f = runCtorchrun(args({"--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "5"}, {"print", "x"}));
  INFO(f.output);
  CHECK(f.exitCode == 2);
  CHECK(f.output.find("'5'") != std::string::npos);
}

TEST_CASE("e2e logging: the resolved configuration is logged once at start") {
  auto r = runCtorchrun(args({"--log-level", "info", "--standalone", "--nproc-per-node", "2"}, {"print", "x"}));
  REQUIRE(r.ok());
  CHECK(countOf(r.output, "[ctorchrun] [info] ctorchrun ") == 1);
  CHECK(r.output.find("2 worker(s)") != std::string::npos);
  // Without --log-level, SPDLOG_LEVEL decides.
  auto so = ctorchrunSpawn({"--log-level", "info", "--standalone", fakeWorkerBin(), "print", "x"});
  so.argv.erase(so.argv.begin() + 1, so.argv.begin() + 3);
  so.setEnv["SPDLOG_LEVEL"] = "error";
  auto envOnly = test::run(so);
  INFO(envOnly.output);
  CHECK(envOnly.ok());
  CHECK(envOnly.output.find("[info]") == std::string::npos);
  CHECK(envOnly.output.find("[default0]:x") != std::string::npos);
}

// ---- Python workers ---------------------------------------------------------------------------------

// Issue 13.3: python3 first on PATH has no torch (here: one that skips site-packages); ctorchrun
// must pick one that has it, and log which.
TEST_CASE("e2e python: without PYTHON_EXEC a .py runs under an interpreter that finds torch, named in the log") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  test::TempDir dir;
  auto fake = (dir / "python3").string();
  test::writeFile(fake, "#!/bin/sh\nexec /usr/bin/python3 -S \"$@\"\n");
  ::chmod(fake.c_str(), 0755);
  auto script = (dir / "has_torch.py").string();
  test::writeFile(script, "import importlib.util, sys\nprint('HAS-TORCH', importlib.util.find_spec('torch') is not None, sys.executable)\n");
  auto so = ctorchrunSpawn({"--log-level", "info", "--standalone", script}, {{"PATH", dir.path().string() + ":/usr/bin:/bin"}});
  so.setEnv.erase("PYTHON_EXEC");
  so.unsetEnv.push_back("PYTHON_EXEC");
  auto r = test::run(so);
  INFO(r.describe() << "\n" << r.output);
  REQUIRE(r.ok());
  CHECK(r.output.find("[default0]:HAS-TORCH True") != std::string::npos);
  CHECK(r.output.find("Python interpreter: /usr/bin/python3") != std::string::npos);
}

TEST_CASE("e2e python: init_process_group gloo + all_reduce with 2 and 4 Python workers") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  for (int n : {2, 4}) {
    auto r = runCtorchrun({"--standalone", "--nproc-per-node", std::to_string(n), dataDir() + "/gloo_allreduce.py"},
                          {}, 180s);
    INFO(r.describe() << "\n" << r.output);
    REQUIRE(r.ok());
    CHECK(countOf(r.output, "ALLREDUCE-OK") == static_cast<std::size_t>(n));
  }
}

TEST_CASE("e2e python: a Python gloo job restarts after a crash and rejoins the store") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  test::TempDir dir;
  auto script = (dir / "crash_once.py").string();
  test::writeFile(script,
                  "import os, sys\n"
                  "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
                  "    sys.exit(17)\n"
                  "exec(open(sys.argv[1]).read())\n");
  auto r = runCtorchrun({"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", script,
                         dataDir() + "/gloo_allreduce.py"},
                        {}, 180s);
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(countOf(r.output, "ALLREDUCE-OK") == 2);
}

TEST_CASE("e2e python peer: torchrun's half-read lines are made whole before they are compared") {
  // What Debian's torchrun 2.14 printed in CI (stop 53): the tailer read "ENV RANK=0" before its '\n'.
  const std::string split = "W1128 torchrun warning\n"
                            "[default0]:ENV RANK=0[default1]:ENV RANK=1\n"
                            "[default0]:\n"
                            "[default1]:ENV LOCAL_RANK=1\n"
                            "[default0]:ENV LOC[default0]:AL_RANK=0\n"
                            "I1128 torchrun info\n"
                            "[default1]:PARAMS 0.5";
  const std::string whole = "W1128 torchrun warning\n"
                            "[default1]:ENV RANK=1\n"
                            "[default0]:ENV RANK=0\n"
                            "[default1]:ENV LOCAL_RANK=1\n"
                            "[default0]:ENV LOCAL_RANK=0\n"
                            "I1128 torchrun info\n"
                            "[default1]:PARAMS 0.5\n";
  CHECK(rejoinTailedLines(split) == whole);
  auto env = envByRank(rejoinTailedLines(split));
  CHECK(env[0]["RANK"] == "0");
  CHECK(env[0]["LOCAL_RANK"] == "0");
  CHECK(env[1]["RANK"] == "1");
  CHECK(rejoinTailedLines("no workers\n") == "no workers\n");
}

TEST_CASE("e2e python peer: same environment and same final parameters as Debian's torchrun") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  if (!std::filesystem::exists("/usr/bin/torchrun")) CTORCH_SKIP("/usr/bin/torchrun is not installed");
  test::TempDir dir;
  const std::string script = dataDir() + "/ddp_peer.py";
  // Debian's torchrun 1.13 on Python 3.11 needs -r 1 -t 1 --log_dir (see notes/test-lab.md).
  test::SpawnOptions peer;
  peer.timeout = 240s;
  peer.unsetEnv = {"OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NCCL_ASYNC_ERROR_HANDLING"};
  // torchrun's agent binds --master_port and hands that number to its workers: a fixed port, drawn
  // again when the agent says it was taken.
  auto theirs = test::withFreshPort([&](int port) {
    peer.argv = {"/usr/bin/torchrun", "--nproc_per_node", "2", "--master_port", std::to_string(port), "-r", "1",
                 "-t", "1", "--log_dir", (dir / ("torchrun-" + std::to_string(port))).string(), script};
    return test::run(peer);
  });
  INFO("torchrun: " << theirs.describe() << "\n" << theirs.output);
  theirs.output = rejoinTailedLines(theirs.output);
  REQUIRE(theirs.ok());
  auto ours = runCtorchrun({"--nproc-per-node", "2", "--master-port", "0", script}, {}, 240s);
  INFO("ctorchrun: " << ours.describe() << "\n" << ours.output);
  REQUIRE(ours.ok());

  auto theirEnv = envByRank(theirs.output);
  auto ourEnv = envByRank(ours.output);
  REQUIRE(theirEnv.size() == 2);
  REQUIRE(ourEnv.size() == 2);
  for (int rank = 0; rank < 2; ++rank) {
    for (auto& [k, v] : theirEnv[rank]) {
      if (k == "MASTER_PORT" || k == "TORCHELASTIC_RUN_ID" || k == "TORCHELASTIC_ERROR_FILE") continue;
      // torchrun 2.x sets only TORCH_NCCL_ASYNC_ERROR_HANDLING; ctorchrun also sets the name that
      // LibTorch / PyTorch 1.x workers read, whatever the workers' release.
      if (k == "NCCL_ASYNC_ERROR_HANDLING" && v == "<unset>") continue;
      INFO("rank " << rank << " " << k);
      CHECK(ourEnv[rank][k] == v);
    }
    // The exceptions: a port of its own, and an error file in each launcher's log directory.
    CHECK(ourEnv[rank]["TORCHELASTIC_ERROR_FILE"].find("/attempt_0/" + std::to_string(rank) + "/error.json") != std::string::npos);
  }
  auto params = [](const std::string& out) {
    std::vector<std::string> p;
    for (const auto& l : linesWith(out, "[default")) {
      auto at = l.find("]:PARAMS ");
      if (at != std::string::npos) p.push_back(l.substr(at + 2));
    }
    return p;
  };
  auto theirParams = params(theirs.output), ourParams = params(ours.output);
  REQUIRE(theirParams.size() == 2);
  REQUIRE(ourParams.size() == 2);
  CHECK(theirParams[0] == theirParams[1]);  // DDP kept the replicas equal
  CHECK(ourParams[0] == theirParams[0]);
  CHECK(ourParams[1] == theirParams[1]);
}

// ---- The seeds' torchrun tutorial (tests/launcher/data/snapshot_tutorial.py) ------------------------
// Crash + restart in every rendezvous mode must end with the parameters of a run that never
// crashed: the restarted round meets in a store without the crashed round's keys (PyTorch 2.6+
// workers use it without a per-attempt prefix) and resumes from snapshot.pt.

namespace {

struct TutorialRun {
  std::string digest;
  std::string output;
};

// Rank 0's "DIGEST <hex>" line ("[default0]:" or, with several nodes, "[<host>:default0]:").
std::string digestOf(const std::string& output) {
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("default0]:DIGEST ");
    if (at != std::string::npos) return line.substr(at + 17);
  }
  return "";
}

// mode: standalone, static or c10d (two agents of one worker each); crash: rank 1 exits 13 at the
// start of epoch 2 in the first round.
TutorialRun runTutorial(const std::string& mode, bool crash, const std::map<std::string, std::string>& extraEnv = {}) {
  test::TempDir dir("ctorch-tutorial");
  std::map<std::string, std::string> env = extraEnv;
  env["OMP_NUM_THREADS"] = "1";
  if (crash) {
    env["CRASH_RANK"] = "1";
    env["CRASH_EPOCH"] = "2";
  }
  const std::vector<std::string> program = {dataDir() + "/snapshot_tutorial.py", "4", "1",
                                            (dir / "snapshot.pt").string()};
  auto withProgram = [&](std::vector<std::string> a) {
    a.insert(a.end(), program.begin(), program.end());
    return a;
  };
  TutorialRun out;
  if (mode != "c10d") {
    std::vector<std::string> a = {"--nproc-per-node", "2", "--max-restarts", "1"};
    if (mode == "standalone") a.push_back("--standalone");
    else a.insert(a.end(), {"--master-port", "0"});
    auto r = runCtorchrun(withProgram(a), env, 240s);
    INFO(mode << ": " << r.describe() << "\n" << r.output);
    CHECK(r.ok());
    out.output = r.output;
  } else {
    // The rendezvous store is this test's (bound to port 0); both agents are its clients.
    const auto store = test::HostedStore::rendezvous();
    const std::string endpoint = "127.0.0.1:" + std::to_string(store.port());
    std::vector<std::unique_ptr<test::Process>> agents;
    for (int node = 0; node < 2; ++node) {
      agents.push_back(std::make_unique<test::Process>(ctorchrunSpawn(
          withProgram({"--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", "tutorial", "--rdzv-conf", "is_host=false",
                       "--node-rank", std::to_string(node)}),
          env, 240s)));
    }
    for (auto& agent : agents) {
      auto r = agent->wait();
      INFO("c10d agent: " << r.describe() << "\n" << r.output);
      CHECK(r.ok());
      out.output += r.output;
    }
  }
  out.digest = digestOf(out.output);
  return out;
}

} // namespace

TEST_CASE("e2e python tutorial: crash + restart ends bit-identical to a run that never crashed, in every mode") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  const auto reference = runTutorial("standalone", /*crash=*/false);
  REQUIRE(reference.digest.size() == 64);
  for (std::string mode : {"standalone", "static", "c10d"}) {
    const auto r = runTutorial(mode, /*crash=*/true);
    INFO(mode << ":\n" << r.output);
    CHECK(countOf(r.output, "crashing at epoch 2") == 1);
    // Both ranks resumed (from epoch 1's snapshot, or epoch 0's when rank 0 was stopped mid-save).
    CHECK(countOf(r.output, "Resuming training from snapshot at Epoch ") == 2);
    CHECK(r.digest == reference.digest);
  }
  // Control: resuming wrongly (the tutorial's own EPOCHS_RUN, which replays an epoch) must show.
  const auto replayed = runTutorial("standalone", /*crash=*/true, {{"TUTORIAL_REPLAY_BUG", "1"}});
  INFO(replayed.output);
  CHECK(countOf(replayed.output, "Resuming training from snapshot at Epoch ") == 2);
  CHECK(replayed.digest.size() == 64);
  CHECK(replayed.digest != reference.digest);
}
