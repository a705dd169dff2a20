#include "ctorch/launcher/static_rendezvous.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "log.hpp"

#include <poll.h>

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
  so.debugLog = [](const std::string& message) { log("store").debug("{}", message); };
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

namespace {

void checkCancel(int cancelFd, const char* what) {
  if (cancelFd < 0) return;
  pollfd p{cancelFd, POLLIN, 0};
  if (::poll(&p, 1, 0) > 0) throw RendezvousInterrupted(std::string("interrupted while ") + what);
}

} // namespace

void StaticRendezvous::connect(std::chrono::steady_clock::time_point deadline, int cancelFd) {
  // Short tries, so that a signal to the agent (cancelFd) is noticed while node 0 is not up yet.
  std::string lastError;
  for (;;) {
    checkCancel(cancelFd, "waiting for node 0's store");
    try {
      store::TcpStoreClientOptions co;
      co.timeout = std::chrono::milliseconds(500);
      client_ = std::make_unique<store::TcpStoreClient>(
          options_.nodeRank == 0 ? std::string("127.0.0.1") : options_.masterAddr,
          static_cast<std::uint16_t>(port_), co);
      return;
    } catch (const store::StoreError& e) {
      lastError = e.what();
    }
    if (std::chrono::steady_clock::now() >= deadline)
      throw RendezvousTimeout("node 0's store at " + options_.masterAddr + ":" + std::to_string(port_) +
                              " did not answer in time: " + lastError);
  }
}

void StaticRendezvous::barrier(const std::string& name, std::chrono::steady_clock::time_point deadline,
                               int cancelFd) {
  const std::string base = "ctorchrun/static/" + options_.runId + "/" + name;
  if (client_->add(base, 1) == options_.numNodes) client_->set(base + "/done", store::toBytes("1"));
  for (;;) {
    checkCancel(cancelFd, ("in the " + name + " barrier").c_str());
    try {
      client_->wait({base + "/done"}, std::chrono::milliseconds(200));
      return;
    } catch (const store::StoreTimeout&) {
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::int64_t arrived = client_->add(base, 0);
      throw RendezvousTimeout("static rendezvous: only " + std::to_string(arrived) + " of " +
                              std::to_string(options_.numNodes) + " nodes reached the " + name +
                              " barrier in time (run id " + options_.runId + ")");
    }
  }
}

RendezvousInfo StaticRendezvous::next(const RendezvousRequest& request) {
  if (options_.numNodes > 1 && round_ == 0) {
    auto deadline = std::chrono::steady_clock::now() + std::min(request.timeout, options_.joinTimeout);
    try {
      if (!client_) connect(deadline, request.cancelFd);
      barrier("start", deadline, request.cancelFd);
    } catch (const store::StoreError& e) {
      throw RendezvousError(std::string("static rendezvous: ") + e.what());
    }
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

void StaticRendezvous::exitBarrier(std::chrono::milliseconds timeout) {
  if (options_.numNodes <= 1 || !client_) return;
  try {
    barrier("exit", std::chrono::steady_clock::now() + timeout, -1);
  } catch (const std::exception& e) {
    // The workers succeeded; a peer that is late or gone does not change this node's result.
    log("rendezvous").warn("exit barrier: {}", e.what());
  }
}

void StaticRendezvous::shutdown() {
  client_.reset();
  server_.reset();
}

} // namespace ctorch::launcher
