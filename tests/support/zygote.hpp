// The test programs' fork server ("zygote"): a process forked at the very start of main() that forks
// registered workers of this binary on request, so that a worker skips exec and LibTorch's start-up
// (its operator registration: ~0.45 CPU-s a process on bookworm, ~0.8 in the modern lane). Process
// asks it only where a forked worker cannot be told from an exec'd one, and execs otherwise.
// (tests/CMakeLists.txt names support's two sources; these are defined in multiproc.cpp.)
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::test::zygote {

using Environment = std::map<std::string, std::string>;

// ---- Decisions (no I/O) --------------------------------------------------------------------------
// Variables no library of a test program reads while it loads, only later through getenv: the worker
// contract's (RANK, MASTER_PORT, TORCHELASTIC_*, SLURM_*, ...) and the project's own CTORCH_* (read
// inside functions, never by a namespace-scope initializer). They may differ between the image a
// worker is forked from and the worker. Every other variable may have been read at load time
// (LD_*, OMP_* by libgomp and OpenBLAS, MALLOC_*/GLIBC_TUNABLES by glibc, GLOG_* and
// TORCH_CPP_LOG_LEVEL by c10's static initializers, sanitizers' *SAN_OPTIONS, ...): it must match.
bool readOnlyAtRuntime(std::string_view name);

// The first variable (by name) whose value differs between `image` and `requested` (set in one, unset
// or other in the other) and that is not readOnlyAtRuntime; nullopt when a worker forked from the
// image would see what an exec'd one sees.
std::optional<std::string> loadTimeDifference(const Environment& image, const Environment& requested);

// How a spawn request is served.
enum class Route {
  kExec,   // as without a zygote: fork and exec
  kFork,   // forked from the zygote's image
  kAdopt,  // the zygote first re-executes itself with the requested environment (one start-up for
           // this and every later worker with it), then forks
};

struct RouteFacts {
  bool disabled = false;          // CTORCH_TEST_NO_ZYGOTE=1, or no zygote in this process
  bool selfWorker = false;        // argv is `<selfExe()> --ctorch-worker NAME ...`
  std::string processDifference;  // what this process changed since main() began that a child inherits
                                  // (rlimits, umask, an inheritable descriptor, ...); empty: nothing
  std::optional<std::string> envDifference;  // loadTimeDifference(image, requested)
  bool adoptable = false;         // the zygote has no child now: it may re-execute itself
};

struct RouteChoice {
  Route route = Route::kExec;
  std::string reason;  // why not kFork, for the trace
};

RouteChoice chooseRoute(const RouteFacts& facts);

// ---- The server: started by the test main --------------------------------------------------------
// Called by main() right after installing its crash handlers, which it passes as `onWorkerStart` (what
// an exec'd worker's main would do before maybeRunWorker). In a test process (not a worker, and
// without CTORCH_TEST_NO_ZYGOTE=1) forks the zygote and returns nullopt. In a zygote re-executed with
// a worker environment (`--ctorch-zygote FD PARENT`) serves until its parent closes the socket and
// returns the exit code.
std::optional<int> start(int argc, char** argv, void (*onWorkerStart)());

// ---- The client: Process --------------------------------------------------------------------------
struct SpawnRequest {
  std::vector<std::string> argv;
  Environment env;          // exactly the worker's environment
  std::string cwd;          // empty: the requester's
  int outputFd = -1;        // becomes the worker's stdout and stderr
};

// The worker's pid when the zygote forked it (it is in its own process group already); nullopt when
// the request must be exec'd (chooseRoute, or the zygote is gone).
std::optional<int> spawn(const SpawnRequest& request);

// The wait status (as waitpid gives it) of a zygote-spawned pid that exited, else nullopt; never blocks.
std::optional<int> exitStatus(int pid);

// Waits up to `bound` for a zygote-spawned pid to exit; if it is still running then, or the zygote is
// gone, the status says killed by SIGKILL (the zygote's children die with it).
int awaitExit(int pid, std::chrono::milliseconds bound);

// The zygote reaps a pid whose exit the caller has seen (until then it stays a zombie, so that its
// pid and process group cannot be taken by another process), or reaps it on exit without a report.
void release(int pid);

// What this process's zygote is, for tests of the harness and the trace (CTORCH_TEST_ZYGOTE_TRACE=1).
struct Status {
  bool running = false;      // a zygote serves this process
  int reexecuted = 0;        // times it re-executed itself with a worker environment
  int threadsBeforeFork = 0; // this process's threads at the start of main()
  int threadsAfterFork = 0;  // ... right after forking the zygote (fork handlers may join pools)
  int zygoteThreads = 0;     // the re-executed zygote's threads when it started (0: not re-executed)
  int forked = 0;            // workers forked so far
  int execed = 0;            // requests that went to exec instead
  std::string unavailable;   // why no zygote serves, if none does
};
Status status();

} // namespace ctorch::test::zygote
