// The built-in rendezvous backends. "static": a fixed number of nodes with given node ranks; node 0
// hosts the workers' TCPStore at --master-addr:--master-port (a taken port is an error, never a
// silent join of someone else's store). With several nodes, every agent meets the others in that
// store before the first start and again at the end (exit barrier, so node 0 keeps the store up
// until all are done); restarts stay local (propagating a failure to other nodes is the dynamic
// backend's job). "standalone": one node, the store on a free port, a random run id.
#pragma once

#include "ctorch/launcher/rendezvous.hpp"

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
};

class StaticRendezvous : public RendezvousHandler {
 public:
  // Node 0 starts the store here; throws RendezvousError if the port cannot be bound.
  explicit StaticRendezvous(StaticRendezvousOptions options);
  ~StaticRendezvous() override;

  std::string backend() const override { return options_.backendName; }
  RendezvousInfo next(const RendezvousRequest& request) override;
  void exitBarrier(std::chrono::milliseconds timeout) override;
  void shutdown() override;

  int storePort() const { return port_; }

 private:
  StaticRendezvousOptions options_;
  // All nodes add 1 to `key`, then wait until it reaches the node count (bounded, cancellable).
  void barrier(const std::string& key, std::chrono::steady_clock::time_point deadline, int cancelFd);
  void connect(std::chrono::steady_clock::time_point deadline, int cancelFd);

  std::unique_ptr<store::TcpStoreServer> server_;
  std::unique_ptr<store::TcpStoreClient> client_;
  int port_ = 0;
  int round_ = 0;

};

StaticRendezvousOptions staticOptionsFrom(const LaunchConfig& config);

} // namespace ctorch::launcher
