// The rendezvous interface: who is in this round, which node rank this agent has, where the
// workers' store is. The agent calls next() before every (re)start of its workers and otherwise
// only listens: a handler may push asynchronous events (a peer died, a node wants to join, a worker
// failed on another node) through eventFd()/takeEvent(). Built in: "static" (fixed nodes, given
// master address) and "standalone" (one node, free port, random run id). Multi-node dynamic
// backends (issue 4: "c10d") implement the same interface and register a factory.
#pragma once

#include "ctorch/control/control_plane.hpp"
#include "ctorch/launcher/launch_config.hpp"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher {

struct RendezvousRequest {
  int localNproc = 1;                   // workers this node brings (nodes may differ)
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // Readable when the agent may have been asked to stop: a handler that waits must poll it and,
  // when it is readable, ask stopRequested(); if that says yes, throw RendezvousInterrupted
  // instead of blocking a Ctrl-C. -1: none.
  int cancelFd = -1;
  // True when the agent has been asked to stop. It may consume what made cancelFd readable
  // without being a stop request (SIGCHLD of a reaped orphan), so a readable cancelFd alone is
  // no reason to give up. Unset: a readable cancelFd means stop.
  std::function<bool()> stopRequested;

  // What the handler asks while waiting: the fd is readable and stopRequested() agrees.
  bool stopNow() const;
};

// One completed round.
struct RendezvousInfo {
  std::string runId;
  int round = 0;                      // increases with every completed rendezvous
  int nodeRank = 0;                   // GROUP_RANK
  int numNodes = 1;                   // GROUP_WORLD_SIZE
  std::vector<int> nprocPerNode;      // by node rank
  std::vector<int> rankOffsets;       // first global rank of each node: prefix sums of nprocPerNode
  int worldSize = 1;                  // sum of nprocPerNode
  std::string storeHost;              // MASTER_ADDR given to workers
  int storePort = 0;                  // MASTER_PORT given to workers
  bool agentStore = true;             // TORCHELASTIC_USE_AGENT_STORE
  std::vector<std::string> nodeHosts; // by node rank, for log prefixes and the failure summary
  // The job's count of restarts when the backend shares one across nodes (c10d): every node gives
  // its workers this TORCHELASTIC_RESTART_COUNT (Python workers derive their store prefix from it,
  // so the nodes must agree). Unset: the agent counts locally (static: every node counts every
  // restart, so the counts agree too).
  std::optional<int> restartCount;

  int localNproc() const { return nprocPerNode.at(static_cast<std::size_t>(nodeRank)); }
  int globalRank(int localRank) const {
    return rankOffsets.at(static_cast<std::size_t>(nodeRank)) + localRank;
  }
  // Fills nprocPerNode-derived fields (offsets, world size); throws std::invalid_argument.
  void computeRanks();
};

enum class RendezvousEventKind {
  MembershipChanged,  // a peer died or a node waits to join: stop, re-rendezvous, not a failure
  RemoteFailure,      // workers failed on another node: restart (counted, like a local failure)
  Failed,             // the rendezvous itself cannot continue (e.g. below min nodes): give up
};

struct RendezvousEvent {
  RendezvousEventKind kind = RendezvousEventKind::MembershipChanged;
  std::string reason;
  // Stop the workers with this grace period when it is shorter than --shutdown-timeout: a lost
  // peer leaves the workers' collectives broken, so there is no point in waiting long for a
  // snapshot that cannot happen (torchrun issue #111646).
  std::optional<std::chrono::milliseconds> grace;
};

// Why the agent is leaving (RendezvousHandler::shutdown).
enum class AgentOutcome {
  Succeeded,    // every worker succeeded (after the exit barrier): the job is done
  Failed,       // the workers failed and no restart is left: the job failed
  Interrupted,  // a signal, or the rendezvous itself gave up: only this node leaves
};

class RendezvousHandler {
 public:
  virtual ~RendezvousHandler() = default;

  virtual std::string backend() const = 0;

  // Blocks until a round completes. Throws RendezvousTimeout, RendezvousInterrupted or
  // RendezvousError.
  virtual RendezvousInfo next(const RendezvousRequest& request) = 0;

  // Asynchronous events while workers run: the fd becomes readable when takeEvent() may return
  // something. -1: this handler never has events.
  virtual int eventFd() const { return -1; }
  virtual std::optional<RendezvousEvent> takeEvent() { return std::nullopt; }

  // This node's workers failed and will be restarted (or not): peers must restart theirs too.
  virtual void reportFailure(const std::string& reason) { (void)reason; }

  // This node's workers all succeeded: wait (bounded) for the other nodes before exiting.
  // nullopt: done (every node finished, or waiting made no sense any more; logged). A
  // RemoteFailure event: workers failed on another node in this round, so this node's workers
  // must run again with everyone's (the agent restarts them, counted).
  virtual std::optional<RendezvousEvent> exitBarrier(std::chrono::milliseconds timeout) {
    (void)timeout;
    return std::nullopt;
  }

  // The agent is leaving; release resources and tell peers as the outcome warrants.
  virtual void shutdown(AgentOutcome outcome) { (void)outcome; }
};

using RendezvousFactory = std::function<std::unique_ptr<RendezvousHandler>(const LaunchConfig&)>;

// Backends are registered by name ("static" is built in and always present).
void registerRendezvousBackend(const std::string& name, RendezvousFactory factory);
bool rendezvousBackendAvailable(const std::string& name);
std::vector<std::string> availableRendezvousBackends();

// torchrun's backend names, available here or not (so that "c10d" gets a clearer message than
// an unknown name).
const std::vector<std::string>& torchrunRendezvousBackends();

// Creates the handler for config.rdzvBackend ("standalone" when config.standalone).
std::unique_ptr<RendezvousHandler> createRendezvousHandler(const LaunchConfig& config);

// --recovery in-place: the job's control plane (the coordinator, control/control_plane.hpp) that
// each workers' store node rank 0 serves hosts on its port, logging to the "control" logger; null
// without --recovery in-place.
control::ControlPlaneFactory controlPlaneFor(const LaunchConfig& config);

} // namespace ctorch::launcher
