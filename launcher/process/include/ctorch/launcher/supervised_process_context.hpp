// The real ProcessContext: one supervisor process per worker (see src/supervisor.hpp), worker
// output through pipes into an OutputSink (or straight into files), exits reported at once over a
// socket, no polling and no signal handlers (a supervisor's exit is the EOF of its socket).
#pragma once

#include "ctorch/launcher/process_context.hpp"

#include <signal.h>

#include <chrono>
#include <memory>
#include <vector>

namespace ctorch::launcher {

struct SupervisedProcessContextOptions {
  OutputSink* sink = nullptr;  // receives the output of streams with OutputSpec::toAgent
  // What a supervisor waits, after its worker exited, before SIGKILLing what the worker left
  // behind (they get SIGTERM first).
  std::chrono::milliseconds leftoverGrace{std::chrono::seconds(30)};
  // The signal mask workers start with; defaults to the mask of the thread creating the context
  // minus nothing (callers that block signals for a signalfd pass the mask from before).
  std::optional<sigset_t> workerMask;
};

class SupervisedProcessContext : public ProcessContext {
 public:
  explicit SupervisedProcessContext(SupervisedProcessContextOptions options);
  // Kills whatever still runs and waits for the supervisors: nothing outlives the context.
  ~SupervisedProcessContext() override;

  void start(const std::vector<WorkerLaunch>& workers) override;
  void add(const WorkerLaunch& worker) override;
  void kill(pid_t pid) override;
  void killRank(int localRank) override;
  void relabel(int fromLocalRank, int toLocalRank) override;
  int fd() const override;
  std::vector<WorkerExit> process() override;
  void signalAll(int signo) override;
  void killAll() override;
  bool finished() const override;
  std::map<int, pid_t> pids() const override;

 private:
  struct Worker;
  void closeWorker(Worker& w);
  void launch(const WorkerLaunch& launch, bool appendLogs);
  void onControl(std::size_t index, std::vector<WorkerExit>& exits);
  void onPipe(std::size_t index, Stream stream, bool drainToEof);
  void supervisorGone(std::size_t index, std::vector<WorkerExit>& exits);
  void send(Worker& w, int type, int value);

  SupervisedProcessContextOptions options_;
  int epoll_ = -1;
  std::vector<std::unique_ptr<Worker>> workers_;
};

} // namespace ctorch::launcher
