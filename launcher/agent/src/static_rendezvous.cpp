#include "ctorch/launcher/static_rendezvous.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"

#include <cerrno>

namespace ctorch::launcher {

StaticRendezvousOptions staticOptionsFrom(const LaunchConfig& c) {
  StaticRendezvousOptions o;
  o.masterAddr = c.rdzvEndpointHost;
  o.masterPort = c.rdzvEndpointPort;
  o.numNodes = c.maxNodes;
  o.nodeRank = c.nodeRank.value_or(0);
  o.runId = c.rdzvId;
  o.backendName = c.standalone ? "standalone" : "static";
  o.hostname = c.hostname;
  if (c.standalone) o.bindHost = "";  // every interface, like torchrun's agent store
  return o;
}

StaticRendezvous::StaticRendezvous(StaticRendezvousOptions options) : options_(std::move(options)) {
  port_ = options_.masterPort;
  if (options_.nodeRank != 0) return;
  store::TcpStoreServerOptions so;
  so.host = options_.bindHost;
  so.port = static_cast<std::uint16_t>(options_.masterPort);
  try {
    server_ = std::make_unique<store::TcpStoreServer>(so);
  } catch (const store::StoreBindError& e) {
    std::string flag = options_.backendName == "standalone" ? "" : "--master-port ";
    if (e.error() == EADDRINUSE)
      throw RendezvousError(flag + std::to_string(options_.masterPort) +
                            ": port already in use (another job's store?); choose a free "
                            "--master-port or use --standalone");
    throw RendezvousError(e.what());
  }
  port_ = server_->port();
}

StaticRendezvous::~StaticRendezvous() = default;

RendezvousInfo StaticRendezvous::next(const RendezvousRequest& request) {
  if (options_.nodeRank != 0 && !storeChecked_) {
    // Nothing to agree on, but starting workers before node 0's store exists only moves the
    // failure into every worker: wait for it here, bounded.
    try {
      store::TcpStoreClientOptions co;
      co.timeout = std::min(request.timeout, options_.joinTimeout);
      store::TcpStoreClient probe(options_.masterAddr, static_cast<std::uint16_t>(port_), co);
    } catch (const store::StoreError& e) {
      throw RendezvousTimeout("node 0's store at " + options_.masterAddr + ":" +
                              std::to_string(port_) + " did not answer: " + e.what());
    }
    storeChecked_ = true;
  }
  RendezvousInfo info;
  info.runId = options_.runId;
  info.round = round_++;
  info.nodeRank = options_.nodeRank;
  info.numNodes = options_.numNodes;
  // Static means every node brings the same number of workers (as torchrun assumes).
  info.nprocPerNode.assign(static_cast<std::size_t>(options_.numNodes), request.localNproc);
  info.computeRanks();
  info.storeHost = options_.masterAddr;
  info.storePort = port_;
  info.agentStore = true;
  info.nodeHosts.assign(static_cast<std::size_t>(options_.numNodes), std::string());
  info.nodeHosts[static_cast<std::size_t>(options_.nodeRank)] = options_.hostname;
  return info;
}

void StaticRendezvous::shutdown() { server_.reset(); }

} // namespace ctorch::launcher
