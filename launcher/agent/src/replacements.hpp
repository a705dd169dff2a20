// --recovery in-place, the agent's hands: starts a failed worker's replacement (or hands its rank
// to a spare), kills the processes the coordinator names (they stopped answering their peers), and
// tells the GroupMonitor when the group re-formed or cannot recover in place. Everything it acts on
// comes over its authenticated link to the job's coordinator (control_link.hpp), nothing from the
// c10d store; every process it starts carries a fresh random incarnation, and a kill names one, so
// a command about an earlier process (or launch) names no process of now. The decisions stay in
// GroupMonitor and RestartPolicy. Private to the agent (launcher/agent/src).
#pragma once

#include "control_link.hpp"
#include "ctorch/launcher/group_monitor.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/process_context.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/launcher/worker_logs.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
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

  // Readable when the coordinator's link has work (onReady); -1 without --recovery in-place.
  int fd() const { return link_ ? link_->fd() : -1; }

  // Before a group starts: gives each worker its incarnation (CTORCH_INCARNATION). When the run no
  // longer recovers in place (`inPlace` false), takes in-place recovery's variables away instead:
  // its workers then run as under --recovery restart.
  void prepare(std::vector<WorkerLaunch>& launches, bool inPlace);
  // The group was started with `launches`: opens the link to the coordinator (node rank 0's
  // workers' store), starts --spare-workers spares and --preloaded-workers preloaded workers.
  // Nothing when `inPlace` is false (the run recovers by restarts only, from now on).
  void beginGroup(const RendezvousInfo& info, int restartCount, const std::vector<WorkerLaunch>& launches,
                  const std::vector<WorkerLogs::WorkerFiles>& files, bool inPlace);
  // The group is gone: closes the link.
  void endGroup();

  // MonitorActions::replaceWorker: starts local rank `localRank` again (or hands it to a spare)
  // while the others keep running; counts the replacement in `policy`.
  void replace(int localRank, RestartPolicy& policy);
  // Whether a failed worker of global rank `rank` can be replaced in place now: the coordinator
  // answers and every rank said it can recover in place. Says why not, once per reason.
  bool canReplace(int rank);
  // While a re-form is pending: whether the process that held global rank `rank` had taken part
  // in it (waiting in it as a survivor, or joining it as a replacement).
  bool joinedReform(int rank) const;
  // On fd(): what the coordinator said (kills, the re-form's end, the job's capability).
  void onReady(GroupMonitor& monitor);
  // Set once when a rank said it cannot recover in place: the run restarts the group from now on.
  std::optional<std::string> takeInPlaceImpossible();
  // What the coordinator has said so far, for another thread (ElasticAgent's accessors): -1 not
  // yet whether every rank can recover in place, 1 every rank can, 0 one cannot; and whether it
  // said global rank `rank`'s process takes part in the pending re-form.
  int heardCapability() const;
  bool heardInReform(int rank) const;

  // A process with a negative local rank ended: a spare that held no rank yet.
  void spareEnded(const WorkerExit& exit);
  // Spares hold no state: they are killed, not stopped gracefully.
  void killSpares();

 private:
  void welcomed();
  void onMessage(const contract::control::Message& m);
  void startSpare(bool preloaded);
  bool handToSpare(const WorkerLaunch& replacement, int replacementNumber);
  void registerRank(int localRank, bool replacement);

  struct Spare {
    std::string id;
    int tag = 0;                    // the negative local rank it runs under until it takes one over
    bool preloaded = false;         // --preloaded-workers: waits before its program's main()
    std::uint64_t incarnation = 0;
    bool ready = false;             // connected to the coordinator, waiting for a rank
  };

  const LaunchConfig& config_;
  ProcessContext& processes_;
  WorkerLogs& logs_;
  std::unique_ptr<ControlLink> link_;
  GroupMonitor* monitor_ = nullptr;  // while onReady() runs
  RendezvousInfo info_;              // the running group's
  int restartCount_ = 0;
  std::vector<WorkerLaunch> launches_;  // the running group's, for replacements
  std::vector<WorkerLogs::WorkerFiles> files_;
  std::map<int, std::uint64_t> incarnations_;  // local rank -> the process holding it now
  std::set<int> replacedRanks_;                // local ranks held by a replacement
  // Written on the agent's thread under heardMutex_ (read there without it): what the coordinator said.
  mutable std::mutex heardMutex_;
  std::map<int, std::uint64_t> inReform_;      // global rank -> process the coordinator said takes part
  int capability_ = -1;                        // the coordinator's word: -1 not yet, 1 every rank can, 0 not
  std::string incapable_;                      // why not (rank and reason)
  bool incapableTaken_ = false;
  std::set<std::string> explained_;            // reasons for a group restart already logged
  std::vector<Spare> spares_;
  int sparesStarted_ = 0;
  std::set<pid_t> evicted_;
};

} // namespace ctorch::launcher
