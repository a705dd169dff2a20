// The rendezvous interface: who is in this round, which node rank this agent has, where the
// workers' store is. The agent calls next() before every (re)start of its workers and otherwise
// only listens: a handler may push asynchronous events (a peer died, a node wants to join, a worker
// failed on another node) through eventFd()/takeEvent(). Built in: "static" (fixed nodes, given
// master address) and "standalone" (one node, free port, random run id). Multi-node dynamic
// backends (issue 4: "c10d") implement the same interface and register a factory.
#pragma once

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
  // Readable when the agent has been asked to stop: a handler that waits must poll it and throw
  // RendezvousInterrupted instead of blocking a Ctrl-C. -1: none.
  int cancelFd = -1;
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
  virtual void exitBarrier(std::chrono::milliseconds timeout) { (void)timeout; }

  // The agent is leaving (any reason); release resources, tell peers if the backend can.
  virtual void shutdown() {}
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

} // namespace ctorch::launcher
