// ProcessContext: start, watch and stop one group of local workers. The agent drives it from its
// poll loop (fd() + process()) and decides everything else; tests substitute a fake. The real one
// (SupervisedProcessContext) gives each worker a tiny supervisor process so that nothing a worker
// starts can outlive the launcher, even when the launcher is SIGKILLed.
#pragma once

#include "ctorch/launcher/exit_status.hpp"

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::launcher {

enum class Stream { Stdout, Stderr };

// Where one of a worker's streams goes: to the agent (which prefixes lines for the console and
// may copy them into `file`), or straight into `file`, or nowhere (toAgent false, no file).
struct OutputSpec {
  bool toAgent = true;
  std::optional<std::filesystem::path> file;
};

struct WorkerLaunch {
  int localRank = 0;
  int globalRank = 0;
  std::string executable;         // path passed to execve
  std::vector<std::string> argv;  // argv[0] as the user named the program
  std::vector<std::string> env;   // complete environment, KEY=VALUE
  OutputSpec out;
  OutputSpec err;
};

struct WorkerExit {
  int localRank = 0;
  pid_t pid = 0;
  ExitStatus status;
  std::chrono::system_clock::time_point time;
};

// Receives worker output as it arrives (arbitrary chunks, not lines).
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual void onOutput(int localRank, Stream stream, std::string_view data) = 0;
  virtual void onClosed(int localRank, Stream stream) = 0;
};

class ProcessContext {
 public:
  virtual ~ProcessContext() = default;

  // Starts one worker per entry. The previous group must be finished().
  virtual void start(const std::vector<WorkerLaunch>& workers) = 0;

  // Starts one more worker while the group runs (a replacement for a failed one, --recovery
  // in-place); its log files are appended to, not truncated.
  virtual void add(const WorkerLaunch& worker) {
    (void)worker;
    throw std::logic_error("this process context cannot add a worker to a running group");
  }

  // SIGKILLs the worker with this pid (and what it started), if it is one of the group's and runs.
  virtual void kill(pid_t pid) { (void)pid; }
  // SIGKILLs the running worker started with (or relabelled to) this local rank.
  virtual void killRank(int localRank) { (void)localRank; }
  // A spare (started under a negative local rank) takes `toLocalRank` over: its exit and output are
  // reported under that rank from now on.
  virtual void relabel(int fromLocalRank, int toLocalRank) {
    (void)fromLocalRank;
    (void)toLocalRank;
    throw std::logic_error("this process context cannot relabel a worker");
  }

  // Readable when process() has something to do.
  virtual int fd() const = 0;

  // Does what is ready without blocking (reads output, notices exits); returns the workers that
  // exited since the last call, in the order observed.
  virtual std::vector<WorkerExit> process() = 0;

  // Sends `signo` to every live worker's process group.
  virtual void signalAll(int signo) = 0;

  // SIGKILLs every worker and everything it started.
  virtual void killAll() = 0;

  // True when every worker and every process it started is gone and all output was delivered.
  virtual bool finished() const = 0;

  // local rank -> pid of the started workers (0 until known).
  virtual std::map<int, pid_t> pids() const = 0;
};

} // namespace ctorch::launcher
