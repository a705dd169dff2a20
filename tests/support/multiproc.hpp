// Test support: real multi-process tests without fixed ports.
// A test binary re-executes itself as N worker processes (`--ctorch-worker <name> args...`),
// each with the torchrun worker environment, captures their output and reaps them within a
// deadline (killing the whole process group on timeout). No LibTorch here.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ctorch::test {

// ---- Workers registered in a test binary ----------------------------------------------------------
using WorkerFn = std::function<int(const std::vector<std::string>& args)>;

struct WorkerRegistrar {
  WorkerRegistrar(const char* name, WorkerFn fn);
};

// Defines a worker entry point runnable as `<test-binary> --ctorch-worker NAME args...`.
// The body returns the process exit code; an escaping exception prints it and exits 1.
#define CTORCH_TEST_WORKER(NAME)                                                              \
  static int ctorch_test_worker_##NAME(const std::vector<std::string>& args);                 \
  static ::ctorch::test::WorkerRegistrar ctorch_test_worker_reg_##NAME(#NAME,                 \
                                                                       ctorch_test_worker_##NAME); \
  static int ctorch_test_worker_##NAME([[maybe_unused]] const std::vector<std::string>& args)

// Called by the test main: runs the worker named in argv if asked to, returns its exit code.
std::optional<int> maybeRunWorker(int argc, char** argv);

// ---- Processes -------------------------------------------------------------------------------------
struct ProcessResult {
  int exitCode = -1;       // exit status when the process exited normally, else -1
  int termSignal = 0;      // signal that killed it, else 0
  bool timedOut = false;   // killed by us at the deadline
  std::string output;      // stdout and stderr, interleaved as written
  std::chrono::milliseconds elapsed{0};

  bool ok() const { return !timedOut && termSignal == 0 && exitCode == 0; }
  // A one-line description for assertion messages: "exit 3", "signal 9 (Killed)", "timed out".
  std::string describe() const;
};

struct SpawnOptions {
  std::vector<std::string> argv;                     // argv[0] is the program (path or name on PATH)
  std::map<std::string, std::string> setEnv;         // added to / overriding the inherited environment
  std::vector<std::string> unsetEnv;                 // removed from the inherited environment
  std::optional<std::filesystem::path> cwd;
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

// A child running in its own process group, dying with us (PR_SET_PDEATHSIG), output to a file.
class Process {
 public:
  explicit Process(const SpawnOptions& options);
  ~Process();  // kills the process group and reaps if still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  int pid() const { return pid_; }
  bool running();
  // Sends `signo` to the child's process group.
  void signalGroup(int signo);
  // Waits until exit or until the deadline set by SpawnOptions::timeout (then SIGKILLs the group).
  ProcessResult wait();
  // Current content of the output file (for tests that watch progress).
  std::string outputSoFar() const;
  // Whether the test program's fork server forked it (zygote.hpp) instead of fork and exec.
  bool viaZygote() const { return viaZygote_; }

 private:
  void reapKilled();

  int pid_ = -1;
  bool viaZygote_ = false;
  bool reaped_ = false;
  ProcessResult result_;
  std::filesystem::path outputPath_;
  std::chrono::steady_clock::time_point start_, deadline_;
};

// Runs a command to completion (see SpawnOptions::timeout).
ProcessResult run(const SpawnOptions& options);

// ---- Multi-rank runs of this very binary ------------------------------------------------------------
// Who serves the ranks' TCPStore when no masterPort is given.
enum class StoreHost {
  // The harness, on a port it bound itself (0 = any): every rank is a client of it
  // (TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT=0), as under torchrun's agent.
  kHarness,
  // Rank 0 (c10d's default without an agent), on a fixedPortCandidate(); the whole group runs again
  // on a fresh port when an output says the port was taken. For tests of rank 0's hosting itself.
  kRankZero,
};

struct WorkerGroupOptions {
  std::string worker;                             // name given to CTORCH_TEST_WORKER
  int worldSize = 2;
  std::vector<std::string> args;                  // passed to every rank
  std::map<std::string, std::string> env;         // extra environment for every rank
  // Per-rank environment on top of the above (rank -> vars).
  std::map<int, std::map<std::string, std::string>> rankEnv;
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  // If false, no RANK/WORLD_SIZE/... are set (the worker sees only `env`).
  bool torchrunEnv = true;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 0;                             // nonzero: used as given, nobody hosts for you
  StoreHost store = StoreHost::kHarness;          // with masterPort 0
  // A rank that fails makes the others' remaining time 10 s (they may be blocked in a collective
  // with it). An exit with one of these codes is what the test expects of that rank: it does not.
  std::set<int> expectedExitCodes;
};

// Starts worldSize processes of this binary running `worker` with the torchrun environment
// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0, MASTER_ADDR, MASTER_PORT and, with
// StoreHost::kHarness, the agent store's variables), all sharing one deadline; on the first timeout
// every rank is killed. Results are in rank order (of the last run with StoreHost::kRankZero).
std::vector<ProcessResult> runWorkerGroup(const WorkerGroupOptions& options);

// Fails the current test (Catch2 REQUIRE) unless every rank exited 0; prints their output if not.
void requireAllOk(const std::vector<ProcessResult>& results);

// ---- Small utilities ---------------------------------------------------------------------------------
std::filesystem::path selfExe();

// ---- Ports without races ------------------------------------------------------------------------------
// No port is ever picked by binding 0, closing and handing the number on: any outgoing connection on
// the machine (Gloo opens N^2 of them) can take an ephemeral port in between. A server binds 0 itself
// and says which port it got (HostedStore, `ctorchrun --standalone`, `--master-port 0`); where a
// test must give a server a fixed port (a flag under test), it draws a fixedPortCandidate() and runs
// again with a fresh one when the server says the port was taken (withFreshPort).

// A random TCP port below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range),
// where no outgoing connection takes one: only another server that drew the same number can.
int fixedPortCandidate();

// Whether a process's output says the port it was to listen on was taken (ctorchrun's "port already
// in use", LibTorch's "errno: 98 - Address already in use", Python's "[Errno 98]").
bool portTaken(const std::string& output);
bool portTaken(const ProcessResult& result);
bool portTaken(const std::vector<ProcessResult>& results);
template <class A, class B>
bool portTaken(const std::pair<A, B>& results) {
  return portTaken(results.first) || portTaken(results.second);
}

inline constexpr int kFreshPortAttempts = 8;

// Calls attempt(port) with fresh fixedPortCandidate()s while portTaken(its result), at most
// kFreshPortAttempts times; returns the last result. `attempt` returns a ProcessResult, a vector of
// them, a bool (true: the port was taken), or a type with a portTaken overload.
template <class Attempt>
auto withFreshPort(Attempt&& attempt) -> std::invoke_result_t<Attempt&, int> {
  for (int i = 1;; ++i) {
    auto result = attempt(fixedPortCandidate());
    bool taken;
    if constexpr (std::is_same_v<decltype(result), bool>)
      taken = result;
    else
      taken = portTaken(result);
    if (i == kFreshPortAttempts || !taken) return result;
  }
}

// A 127.0.0.1 port bound (never listening) for the object's lifetime: a connection to it is refused
// at once, and nobody else can bind it meanwhile. For tests of "nothing listens there".
class ReservedPort {
 public:
  ReservedPort();
  ~ReservedPort();
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A c10d TCPStore-protocol server (ctorchrun's own, ctorch::store::TcpStoreServer) on 127.0.0.1,
// on the port it bound (0 = any), served from a thread of this process for the object's lifetime.
class HostedStore {
 public:
  HostedStore();
  // As a ctorchrun agent hosts the rendezvous store (its agents' liveness keys go with their
  // connection): for agents started with `--rdzv-conf is_host=false`.
  static HostedStore rendezvous();
  ~HostedStore();
  HostedStore(HostedStore&&) noexcept;
  HostedStore& operator=(HostedStore&&) noexcept;
  int port() const;
  // Whether this build has the store server (it is ctorchrun's: off with CTORCH_BUILD_LAUNCHER=OFF).
  static bool available();

 private:
  struct Impl;
  explicit HostedStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A fresh directory under $TMPDIR (or /tmp), removed with its content on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "ctorch-test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

std::string readFile(const std::filesystem::path& path);

// A TCP socket process `pid` listens on (its own: the socket's inode is among its open files), with
// its address and port as /proc/net/tcp and /proc/net/tcp6 give them.
struct Listener {
  std::string address;  // hex, as the kernel prints it
  int port = 0;
  bool v6 = false;
};
std::vector<Listener> listenersOf(int pid);
void writeFile(const std::filesystem::path& path, const std::string& content);

} // namespace ctorch::test

// Skips the rest of a test case, reported by CTest as "Not Run (skipped)" (the test properties set
// SKIP_REGULAR_EXPRESSION to CTORCH_SKIPPED). Catch2 v2 has no SKIP of its own.
#define CTORCH_SKIP(reason)                   \
  do {                                        \
    WARN("CTORCH_SKIPPED: " << reason);       \
    return;                                   \
  } while (false)
