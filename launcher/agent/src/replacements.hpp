// --recovery in-place, the agent's hands: starts a failed worker's replacement (or hands its rank
// to a spare), kills the workers the survivors ask to evict, and tells the GroupMonitor when the
// group re-formed, all through the workers' store (contract::inplace). The decisions stay in
// GroupMonitor and RestartPolicy. Private to the agent (launcher/agent/src).
#pragma once

#include "ctorch/launcher/group_monitor.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/process_context.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/launcher/worker_logs.hpp"
#include "ctorch/store/tcp_store_client.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace ctorch::launcher {

class Replacements {
 public:
  Replacements(const LaunchConfig& config, ProcessContext& processes, WorkerLogs& logs);
  ~Replacements();
  Replacements(const Replacements&) = delete;
  Replacements& operator=(const Replacements&) = delete;

  // Readable every kEvictPoll while a group runs (serveEvictions); -1 without --recovery in-place.
  int timerFd() const { return timerFd_; }

  // A group was started with `launches`: forgets the last group's spares and store client, starts
  // --spare-workers spares and --preloaded-workers preloaded workers, arms the eviction timer.
  void beginGroup(const RendezvousInfo& info, int restartCount, const std::vector<WorkerLaunch>& launches,
                  const std::vector<WorkerLogs::WorkerFiles>& files);
  // The group is gone: disarms the timer, drops the store client.
  void endGroup();

  // MonitorActions::replaceWorker: starts local rank `localRank` again (or hands it to a spare)
  // while the others keep running; counts the replacement in `policy`.
  void replace(int localRank, const GroupMonitor& monitor, RestartPolicy& policy);
  // Whether the workers' store answers: a replacement, and the survivors' re-forming, need it.
  bool storeAnswers();
  // While a re-form is pending: whether global rank `rank` said it takes part (alive in the failed
  // generation, or arrived at a newer one). True when the store cannot tell.
  bool joinedReform(int rank);
  // On timerFd(): kills the workers the survivors asked to evict (they stopped answering), and
  // tells `monitor` once every rank arrived at the re-formed group.
  void serveEvictions(GroupMonitor& monitor);

  // A process with a negative local rank ended: a spare that held no rank yet.
  void spareEnded(const WorkerExit& exit);
  // Spares hold no state: they are killed, not stopped gracefully.
  void killSpares();

 private:
  store::TcpStoreClient& workerStore();
  void checkReformed(store::TcpStoreClient& store, GroupMonitor& monitor);
  bool acceptEviction(store::TcpStoreClient& store, const std::string& key, const std::string& value, int rank,
                      int pid);
  void startSpare(bool preloaded);
  bool handToSpare(const WorkerLaunch& replacement);

  struct Spare {
    std::string id;
    int tag = 0;  // the negative local rank it runs under until it takes one over
    bool preloaded = false;  // --preloaded-workers: waits before its program's main()
  };

  const LaunchConfig& config_;
  ProcessContext& processes_;
  WorkerLogs& logs_;
  int timerFd_ = -1;
  RendezvousInfo info_;                  // the running group's
  int restartCount_ = 0;
  std::vector<WorkerLaunch> launches_;  // the running group's, for replacements
  std::vector<WorkerLogs::WorkerFiles> files_;
  // The group generation when the pending replacement was started (-1: unknown): a survivor that
  // joins the re-form says it is alive in it (contract::inplace::aliveKey).
  std::int64_t reformBase_ = -1;
  // The workers' store: eviction requests in, spare assignments out.
  std::unique_ptr<store::TcpStoreClient> workerStore_;
  // After the workers' store failed to answer, eviction requests are not read again before this
  // (doubling pauses up to 4 s): a lost store host must not hold the event loop up every tick.
  std::chrono::steady_clock::time_point workerStoreRetryAt_{};
  std::chrono::milliseconds workerStoreBackoff_{0};
  std::vector<Spare> spares_;
  int sparesStarted_ = 0;
  std::set<pid_t> evicted_;
  std::set<std::string> refusedEvictions_;  // key + value, logged once each
};

} // namespace ctorch::launcher
