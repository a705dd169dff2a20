// The built-in rendezvous backends. "static": a fixed number of nodes with given node ranks; node 0
// hosts the workers' TCPStore at --master-addr:--master-port (a taken port is an error, never a
// silent join of someone else's store). With several nodes, every agent meets the others in that
// store before every attempt and at the end (exit barrier, so node 0 keeps the store up until all
// are done), and a worker failure on any node restarts the workers of every node: the failing node
// records it under the attempt's key, the others see it within a poll interval (eventFd) and
// restart too, each counting one restart, so every node's TORCHELASTIC_RESTART_COUNT agrees.
// "standalone": one node, the store on a free port, a random run id.
// Every restart round after the first gives the workers a fresh store on a free port (MASTER_PORT
// changes), so no round sees an earlier round's keys, whatever the workers' key convention.
#pragma once

#include "ctorch/control/control_plane.hpp"

#include "ctorch/launcher/rendezvous.hpp"

#include <cstdint>
#include <memory>

namespace ctorch::store {
class TcpStoreServer;
class TcpStoreClient;
}

namespace ctorch::launcher {

struct StaticRendezvousOptions {
  std::string masterAddr = "127.0.0.1";  // what workers get as MASTER_ADDR
  int masterPort = 29500;                // 0: any free port (single node only)
  std::string bindHost;                  // where node 0 listens; empty: every interface
  int numNodes = 1;
  int nodeRank = 0;
  std::string runId = "none";
  std::string backendName = "static";
  std::string hostname;
  // Bound on waiting for node 0's store (other node ranks).
  std::chrono::milliseconds joinTimeout{std::chrono::minutes(10)};
  // How often a running node looks for a failure recorded by another node.
  std::chrono::milliseconds pollInterval{std::chrono::milliseconds(200)};
  // --recovery in-place: the control plane each workers' store of node 0 hosts (null: none).
  control::ControlPlaneFactory controlPlane;
};

class StaticRendezvous : public RendezvousHandler {
 public:
  // Node 0 starts the store here; throws RendezvousError if the port cannot be bound.
  explicit StaticRendezvous(StaticRendezvousOptions options);
  ~StaticRendezvous() override;

  std::string backend() const override { return options_.backendName; }
  RendezvousInfo next(const RendezvousRequest& request) override;
  int eventFd() const override { return timerFd_; }
  std::optional<RendezvousEvent> takeEvent() override;
  void reportFailure(const std::string& reason) override;
  std::optional<RendezvousEvent> exitBarrier(std::chrono::milliseconds timeout) override;
  void shutdown(AgentOutcome outcome) override;

  int storePort() const { return port_; }

 private:
  StaticRendezvousOptions options_;
  // All nodes add 1 to `key`, then wait until it reaches the node count (bounded, cancellable).
  // While waiting, a failure recorded for the attempt ends the wait with that failure's text.
  std::optional<std::string> barrier(const std::string& key, std::chrono::steady_clock::time_point deadline,
                                     const RendezvousRequest* request);
  void connect(std::chrono::steady_clock::time_point deadline, const RendezvousRequest& request);
  std::string key(const std::string& name) const;
  std::string failedKey() const;
  std::optional<std::string> recordedFailure();
  void armTimer(bool on);
  std::unique_ptr<store::TcpStoreServer> makeServer(std::uint16_t port) const;
  // Node 0: the port of this round's workers' store (see the .cpp).
  int freshWorkerStore();

  std::unique_ptr<store::TcpStoreServer> server_;        // at --master-port: agents, round 0's workers
  std::unique_ptr<store::TcpStoreServer> workerServer_;  // rounds after the first
  std::unique_ptr<store::TcpStoreClient> client_;
  int port_ = 0;
  int round_ = 0;    // attempts started (next() calls)
  int attempt_ = -1; // the attempt running now
  int timerFd_ = -1;
  bool reported_ = false;  // this attempt's failure event was given to the agent
};

StaticRendezvousOptions staticOptionsFrom(const LaunchConfig& config);

} // namespace ctorch::launcher
