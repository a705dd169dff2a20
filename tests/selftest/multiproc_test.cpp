// Tests of the multi-process test support itself: a harness that cannot fail proves nothing.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "zygote.hpp"

#include "ctorch/store/tcp_store_client.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

extern char** environ;

using namespace ctorch::test;

CTORCH_TEST_WORKER(echo_rank) {
  std::printf("rank=%s world=%s port=%s arg=%s\n", std::getenv("RANK"), std::getenv("WORLD_SIZE"),
              std::getenv("MASTER_PORT"), args.empty() ? "" : args[0].c_str());
  return std::atoi(std::getenv("RANK"));  // rank r exits with r
}

CTORCH_TEST_WORKER(sleep_forever) {
  std::this_thread::sleep_for(std::chrono::hours(1));
  return 0;
}

CTORCH_TEST_WORKER(crash) {
  std::raise(SIGSEGV);
  return 0;
}

TEST_CASE("selftest: workers get the torchrun environment and their own exit codes") {
  auto results = runWorkerGroup({.worker = "echo_rank", .worldSize = 3, .args = {"x"}});
  REQUIRE(results.size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(results[r].exitCode == r);
    CHECK_THAT(results[r].output, Catch::Contains("rank=" + std::to_string(r) + " world=3"));
    CHECK_THAT(results[r].output, Catch::Contains("arg=x"));
  }
}

TEST_CASE("selftest: a hanging worker is killed at the deadline and reported as timed out") {
  auto results = runWorkerGroup(
      {.worker = "sleep_forever", .worldSize = 1, .timeout = std::chrono::milliseconds(300)});
  CHECK(results[0].timedOut);
  CHECK_FALSE(results[0].ok());
}

TEST_CASE("selftest: a crash is reported with its signal and stops the group early") {
  WorkerGroupOptions o;
  o.worker = "crash";
  o.worldSize = 1;
  auto results = runWorkerGroup(o);
  CHECK(results[0].termSignal == SIGSEGV);
}

// Rank r writes key r into the store at MASTER_PORT and reads every other rank's: the harness's
// store serves them all (no LibTorch here: ctorchrun's own client).
CTORCH_TEST_WORKER(store_roundtrip) {
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  std::printf("agent store=%s restart count=%s\n", std::getenv("TORCHELASTIC_USE_AGENT_STORE"),
              std::getenv("TORCHELASTIC_RESTART_COUNT"));
  ctorch::store::TcpStoreClientOptions o;
  o.timeout = std::chrono::seconds(60);
  ctorch::store::TcpStoreClient client(std::getenv("MASTER_ADDR"),
                                       static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT"))), o);
  const auto text = std::to_string(rank * 10);
  client.set("rank" + std::to_string(rank), ctorch::store::Bytes(text.begin(), text.end()));
  for (int r = 0; r < world; ++r) {
    client.wait({"rank" + std::to_string(r)});
    const auto value = client.get("rank" + std::to_string(r));
    std::printf("rank %d read rank%d=%s\n", rank, r, std::string(value.begin(), value.end()).c_str());
  }
  return 0;
}

TEST_CASE("selftest: the harness hosts the store on a port it bound and every rank is its client") {
  auto results = runWorkerGroup({.worker = "store_roundtrip", .worldSize = 3});
  requireAllOk(results);
  for (int r = 0; r < 3; ++r) {
    CHECK_THAT(results[r].output, Catch::Contains("agent store=True restart count=0"));
    for (int other = 0; other < 3; ++other)
      CHECK_THAT(results[r].output, Catch::Contains("rank " + std::to_string(r) + " read rank" + std::to_string(other) +
                                                    "=" + std::to_string(other * 10)));
  }
}

TEST_CASE("selftest: fixed-port candidates lie below the ephemeral range and a taken one is retried") {
  int low = 0, high = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  REQUIRE(low > 20000);
  std::vector<int> tried;
  const bool taken = withFreshPort([&](int port) {
    tried.push_back(port);
    return tried.size() < 3;  // the first two "were taken"
  });
  CHECK_FALSE(taken);
  REQUIRE(tried.size() == 3);
  for (int port : tried) {
    CHECK(port >= 20000);
    CHECK(port < low);
  }
  // A port that stays taken is given up after kFreshPortAttempts, with the last result.
  int calls = 0;
  CHECK(withFreshPort([&](int) { return ++calls > 0; }));
  CHECK(calls == kFreshPortAttempts);
}

TEST_CASE("selftest: what says a port was taken, and what does not") {
  CHECK(portTaken("ctorchrun: error: --master-port 29500: port already in use (another job's store?)"));
  CHECK(portTaken("The server socket has failed to bind to [::]:29500 (errno: 98 - Address already in use)."));
  CHECK(portTaken("OSError: [Errno 98] Address already in use"));
  CHECK_FALSE(portTaken("Connection refused"));
  CHECK_FALSE(portTaken(std::vector<ProcessResult>(2)));
}

TEST_CASE("selftest: a reserved port refuses connections and cannot be bound by anyone else") {
  ReservedPort reserved;
  REQUIRE(reserved.port() > 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(reserved.port()));
  int c = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(c >= 0);
  CHECK(::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0);
  CHECK(errno == ECONNREFUSED);
  ::close(c);
  int b = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(b, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as c10d's server sets it
  CHECK(::bind(b, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0);
  CHECK(errno == EADDRINUSE);
  ::close(b);
}

// ---- The fork server (zygote.hpp) ----------------------------------------------------------------------

namespace {

namespace zygote = ctorch::test::zygote;

// Prints what a test can compare between a forked and an exec'd worker, then does what args[0] says:
// "exit" exits 7, "hang" sleeps, "wait" says "ready" and sleeps (for a signal), "raise" raises SIGTERM.
CTORCH_TEST_WORKER(zygote_probe) {
  std::set<std::string> env(environ, environ + std::distance(environ, std::find(environ, environ + (1 << 20), nullptr)));
  for (const auto& kv : env) std::printf("env %s\n", kv.c_str());
  std::printf("cwd %s\n", std::filesystem::current_path().c_str());
  std::printf("own group %d\n", ::getpgrp() == ::getpid() ? 1 : 0);
  struct sigaction usr2 {};
  ::sigaction(SIGUSR2, nullptr, &usr2);
  std::printf("SIGUSR2 ignored %d\n", usr2.sa_handler == SIG_IGN ? 1 : 0);
  sigset_t mask;
  ::sigprocmask(SIG_SETMASK, nullptr, &mask);
  std::printf("SIGCHLD blocked %d\n", sigismember(&mask, SIGCHLD));
  std::error_code ec;
  for (const auto& fd : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (target.rfind("/proc/", 0) != 0)  // the listing's own descriptor
      std::printf("fd %s %s\n", fd.path().filename().c_str(),
                  target[0] == '/' ? "file" : target.substr(0, target.find(':')).c_str());
  }
  std::fflush(stdout);
  const std::string what = args.empty() ? "exit" : args[0];
  if (what == "raise") std::raise(SIGTERM);
  if (what == "hang" || what == "wait") {
    if (what == "wait") std::printf("ready\n");
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::hours(1));
  }
  return 7;
}

std::set<std::string> linesStartingWith(const std::string& output, const std::string& prefix) {
  std::set<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) out.insert(line.substr(prefix.size()));
  return out;
}

SpawnOptions probe(const std::string& what, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  SpawnOptions so;
  so.argv = {selfExe().string(), "--ctorch-worker", "zygote_probe", what};
  so.timeout = timeout;
  return so;
}

// What each check below observes of one worker, through whichever route the harness took.
struct Observed {
  bool viaZygote = false;
  ProcessResult exited, timedOut, signalled, raised;
  std::set<std::string> env, expectedEnv;
  std::string cwd, expectedCwd;
  bool groupAtOnce = false;
};

Observed observeWorkers() {
  Observed o;
  TempDir dir("ctorch-zygote-cwd");
  SpawnOptions so = probe("exit");
  so.cwd = dir.path();
  so.setEnv = {{"CTORCH_TEST_MARK", "zygote probe"}, {"RANK", "5"}};
  so.unsetEnv = {"CTORCH_TEST_PROBE_UNSET"};
  ::setenv("CTORCH_TEST_PROBE_UNSET", "in the test's environment only", 1);
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    const std::string name = kv.substr(0, kv.find('='));
    if (name != "CTORCH_TEST_PROBE_UNSET" && name != "CTORCH_TEST_MARK" && name != "RANK") o.expectedEnv.insert(kv);
  }
  o.expectedEnv.insert("CTORCH_TEST_MARK=zygote probe");
  o.expectedEnv.insert("RANK=5");
  o.expectedCwd = std::filesystem::canonical(dir.path()).string();
  {
    Process p(so);
    o.viaZygote = p.viaZygote();
    o.groupAtOnce = ::getpgid(p.pid()) == p.pid();  // no race with signalGroup: the group is there
    o.exited = p.wait();
  }
  o.env = linesStartingWith(o.exited.output, "env ");
  const auto cwd = linesStartingWith(o.exited.output, "cwd ");
  o.cwd = cwd.empty() ? "" : *cwd.begin();
  o.timedOut = run(probe("hang", std::chrono::milliseconds(300)));
  {
    Process p(probe("wait"));
    for (int i = 0; i < 6000 && p.outputSoFar().find("ready") == std::string::npos && p.running(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    p.signalGroup(SIGUSR1);
    o.signalled = p.wait();
  }
  o.raised = run(probe("raise"));
  ::unsetenv("CTORCH_TEST_PROBE_UNSET");
  return o;
}

void requireSameAsExec(const Observed& o) {
  INFO(o.exited.output);
  CHECK(o.env == o.expectedEnv);
  CHECK(o.cwd == o.expectedCwd);
  CHECK(o.groupAtOnce);
  CHECK_THAT(o.exited.output, Catch::Contains("own group 1"));
  CHECK_THAT(o.exited.output, Catch::Contains("SIGCHLD blocked 0"));
  CHECK(o.exited.exitCode == 7);
  CHECK(o.exited.termSignal == 0);
  CHECK(o.timedOut.timedOut);
  CHECK(o.signalled.termSignal == SIGUSR1);
  CHECK_FALSE(o.signalled.timedOut);
  CHECK(o.raised.termSignal == SIGTERM);
}

// Sets CTORCH_TEST_NO_ZYGOTE=1 for its lifetime.
struct NoZygote {
  NoZygote() { ::setenv("CTORCH_TEST_NO_ZYGOTE", "1", 1); }
  ~NoZygote() { ::unsetenv("CTORCH_TEST_NO_ZYGOTE"); }
};

} // namespace

TEST_CASE("selftest: a forked worker sees exactly its environment and cwd, leads its group, times out, takes a "
          "signal and reports its exit as an exec'd one does, and CTORCH_TEST_NO_ZYGOTE=1 execs") {
  if (!zygote::status().running) CTORCH_SKIP("no fork server in this process: " << zygote::status().unavailable);
  const Observed forked = observeWorkers();
  CHECK(forked.viaZygote);
  requireSameAsExec(forked);
  Observed execed;
  {
    NoZygote off;
    execed = observeWorkers();
  }
  CHECK_FALSE(execed.viaZygote);
  requireSameAsExec(execed);
  // What else a worker inherits: the same descriptors (not the zygote's socket), the same signals.
  CHECK(linesStartingWith(forked.exited.output, "fd ") == linesStartingWith(execed.exited.output, "fd "));
  CHECK(zygote::status().running);
}

TEST_CASE("selftest: what the requester ignores stays ignored in a forked worker, as across exec") {
  if (!zygote::status().running) CTORCH_SKIP("no fork server in this process: " << zygote::status().unavailable);
  ::signal(SIGUSR2, SIG_IGN);
  Process forked(probe("exit"));
  const ProcessResult f = forked.wait();
  ProcessResult e;
  {
    NoZygote off;
    e = run(probe("exit"));
  }
  ::signal(SIGUSR2, SIG_DFL);
  CHECK(forked.viaZygote());
  CHECK_THAT(f.output, Catch::Contains("SIGUSR2 ignored 1"));
  CHECK_THAT(e.output, Catch::Contains("SIGUSR2 ignored 1"));
  Process plain(probe("exit"));
  CHECK_THAT(plain.wait().output, Catch::Contains("SIGUSR2 ignored 0"));
}

TEST_CASE("selftest: a load-time variable, a changed resource limit or another program is exec'd") {
  if (!zygote::status().running) CTORCH_SKIP("no fork server in this process: " << zygote::status().unavailable);
  Process first(probe("hang"));  // alive throughout: the zygote may not re-execute itself
  CHECK(first.viaZygote());
  SpawnOptions loadTime = probe("exit");
  loadTime.setEnv = {{"MALLOC_ARENA_MAX", "1"}};  // glibc reads it when it starts
  Process withMalloc(loadTime);
  CHECK_FALSE(withMalloc.viaZygote());
  const ProcessResult m = withMalloc.wait();
  CHECK(m.exitCode == 7);
  CHECK_THAT(m.output, Catch::Contains("env MALLOC_ARENA_MAX=1"));
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_CORE, &saved) == 0);
  rlimit lowered = saved;
  lowered.rlim_cur = saved.rlim_cur == 0 ? 1 : 0;
  if (lowered.rlim_cur <= saved.rlim_max && ::setrlimit(RLIMIT_CORE, &lowered) == 0) {
    Process limited(probe("exit"));
    CHECK_FALSE(limited.viaZygote());
    CHECK(limited.wait().exitCode == 7);
    ::setrlimit(RLIMIT_CORE, &saved);
  }
  Process sh({.argv = {"sh", "-c", "exit 3"}});
  CHECK_FALSE(sh.viaZygote());
  CHECK(sh.wait().exitCode == 3);
  Process again(probe("exit"));
  CHECK(again.viaZygote());
  CHECK(again.wait().exitCode == 7);
  CHECK(first.running());
}

TEST_CASE("selftest: the fork server's decisions - runtime variables may differ, a load-time one re-executes an "
          "idle zygote and is exec'd beside a running worker") {
  using zygote::Route;
  CHECK(zygote::readOnlyAtRuntime("RANK"));
  CHECK(zygote::readOnlyAtRuntime("MASTER_PORT"));
  CHECK(zygote::readOnlyAtRuntime("TORCHELASTIC_RESTART_COUNT"));
  CHECK(zygote::readOnlyAtRuntime("CTORCH_TEST_IO_FAULT"));
  for (const char* loadTime : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "MALLOC_ARENA_MAX",
                               "GLIBC_TUNABLES", "TORCH_CPP_LOG_LEVEL", "ASAN_OPTIONS", "PATH", "RANKS"})
    CHECK_FALSE(zygote::readOnlyAtRuntime(loadTime));
  const zygote::Environment image = {{"HOME", "/root"}, {"PATH", "/bin"}};
  CHECK_FALSE(zygote::loadTimeDifference(image, image));
  CHECK_FALSE(zygote::loadTimeDifference(image, {{"HOME", "/root"}, {"PATH", "/bin"}, {"RANK", "1"}}));
  CHECK(zygote::loadTimeDifference(image, {{"HOME", "/root"}, {"PATH", "/bin"}, {"OMP_NUM_THREADS", "1"}}) ==
        "OMP_NUM_THREADS");
  CHECK(zygote::loadTimeDifference(image, {{"PATH", "/bin"}}) == "HOME");
  CHECK(zygote::loadTimeDifference(image, {{"HOME", "/root"}, {"PATH", "/usr/bin"}}) == "PATH");

  zygote::RouteFacts facts;
  facts.selfWorker = true;
  CHECK(zygote::chooseRoute(facts).route == Route::kFork);
  facts.envDifference = "OMP_NUM_THREADS";
  facts.adoptable = true;
  CHECK(zygote::chooseRoute(facts).route == Route::kAdopt);
  facts.adoptable = false;
  CHECK(zygote::chooseRoute(facts).route == Route::kExec);
  CHECK_THAT(zygote::chooseRoute(facts).reason, Catch::Contains("OMP_NUM_THREADS"));
  facts.envDifference.reset();
  facts.processDifference = "resource limit 4 changed";
  CHECK(zygote::chooseRoute(facts).route == Route::kExec);
  facts.processDifference.clear();
  facts.selfWorker = false;
  CHECK(zygote::chooseRoute(facts).route == Route::kExec);
  facts.selfWorker = true;
  facts.disabled = true;
  CHECK(zygote::chooseRoute(facts).route == Route::kExec);
}
