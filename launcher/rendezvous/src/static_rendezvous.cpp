#include "ctorch/launcher/static_rendezvous.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "ctorch/text/text.hpp"
#include "log.hpp"

#include <poll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace ctorch::launcher {

namespace {
int parsePortText(const std::string& text) {
  if (text.empty() || text.size() > 5 || text.find_first_not_of("0123456789") != std::string::npos) return -1;
  int port = std::stoi(text);
  return port <= 65535 ? port : -1;
}
} // namespace

StaticRendezvousOptions staticOptionsFrom(const LaunchConfig& c) {
  StaticRendezvousOptions o;
  o.masterAddr = c.rdzvEndpointHost;
  o.masterPort = c.rdzvEndpointPort;
  o.numNodes = c.maxNodes;
  o.nodeRank = c.nodeRank.value_or(0);
  o.runId = c.rdzvId;
  o.backendName = c.standalone ? "standalone" : "static";
  o.hostname = c.hostname;
  // --standalone: one node, MASTER_ADDR 127.0.0.1: its stores listen on the loopback only, so nobody
  // on the network reaches them (torchrun's listen on every interface).
  if (c.standalone) o.bindHost = "127.0.0.1";
  o.controlPlane = controlPlaneFor(c);
  return o;
}

StaticRendezvous::StaticRendezvous(StaticRendezvousOptions options) : options_(std::move(options)) {
  port_ = options_.masterPort;
  if (options_.numNodes > 1) {
    // Created now: the agent registers eventFd() once, when it is constructed.
    timerFd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (timerFd_ < 0) throw std::system_error(errno, std::generic_category(), "timerfd_create");
  }
  if (options_.nodeRank != 0) return;
  try {
    server_ = makeServer(static_cast<std::uint16_t>(options_.masterPort));
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

std::unique_ptr<store::TcpStoreServer> StaticRendezvous::makeServer(std::uint16_t port) const {
  store::TcpStoreServerOptions so;
  so.host = options_.bindHost;
  so.port = port;
  so.debugLog = [](const std::string& message) { log("store").debug("{}", message); };
  // A client that leaves its replies unread once they fill the server is dropped one of these
  // windows after it stopped taking them, the others' requests waiting meanwhile: as the c10d
  // backend's stores at its default heartbeats, well inside any worker's store timeout (issue 58.1).
  so.replyTimeout = std::chrono::milliseconds(250);
  if (options_.controlPlane) so.side = options_.controlPlane();
  return std::make_unique<store::TcpStoreServer>(so);
}

int StaticRendezvous::freshWorkerStore() {
  // The first round's workers use the store at --master-port, as torchrun's do; every later round
  // gets a new store on a free port, in which no key of an earlier round can be seen. Workers of
  // every version meet there: PyTorch < 2.6 prefixes its keys with /worker/attempt_<n>, 2.6+ does
  // not (it relies on a fresh store per round), and a key left behind by a killed worker (even
  // one still in flight when it died) lands in the old store, never in the new one.
  workerServer_.reset();
  if (round_ == 0) return port_;
  try {
    workerServer_ = makeServer(0);
  } catch (const store::StoreError& e) {
    throw RendezvousError(std::string("cannot start the workers' store for this round: ") + e.what());
  }
  return workerServer_->port();
}

StaticRendezvous::~StaticRendezvous() {
  if (timerFd_ >= 0) ::close(timerFd_);
}

std::string StaticRendezvous::key(const std::string& name) const {
  return "ctorchrun/static/" + options_.runId + "/" + name;
}

std::string StaticRendezvous::failedKey() const {
  return key("attempt" + std::to_string(attempt_) + "/failed");
}

void StaticRendezvous::armTimer(bool on) {
  if (timerFd_ < 0) return;
  itimerspec spec{};
  if (on) {
    auto ms = std::max<long long>(options_.pollInterval.count(), 1);
    spec.it_interval.tv_sec = ms / 1000;
    spec.it_interval.tv_nsec = (ms % 1000) * 1000000;
    spec.it_value = spec.it_interval;
  }
  ::timerfd_settime(timerFd_, 0, &spec, nullptr);
}

namespace {
// A wait that says so every few seconds: a node that never comes is visible, not a silent hang.
constexpr std::chrono::seconds kWaitingLogEvery{5};

// Whole seconds: the wait is logged every few seconds.
std::string secondsText(std::chrono::steady_clock::duration d) {
  return text::secondsText(std::chrono::duration_cast<std::chrono::seconds>(d));
}
} // namespace

void StaticRendezvous::connect(std::chrono::steady_clock::time_point deadline, const RendezvousRequest& request) {
  // Short tries, so that a signal to the agent is noticed while node 0 is not up yet.
  std::string lastError;
  const auto start = std::chrono::steady_clock::now();
  auto nextLog = start + kWaitingLogEvery;
  for (;;) {
    if (std::chrono::steady_clock::now() >= nextLog) {
      nextLog += kWaitingLogEvery;
      log("rendezvous").info("waiting for node 0's store at {}:{} ({}; gives up after {})", options_.masterAddr,
                             port_, secondsText(std::chrono::steady_clock::now() - start), secondsText(deadline - start));
    }
    if (request.stopNow()) throw RendezvousInterrupted("interrupted while waiting for node 0's store");
    try {
      store::TcpStoreClientOptions co;
      co.timeout = std::chrono::milliseconds(500);
      client_ = std::make_unique<store::TcpStoreClient>(
          options_.nodeRank == 0 ? std::string("127.0.0.1") : options_.masterAddr,
          static_cast<std::uint16_t>(port_), co);
      // Replies are quick once connected; waits have their own bounds.
      client_->setOperationTimeout(std::chrono::seconds(30));
      return;
    } catch (const store::StoreError& e) {
      lastError = e.what();
    }
    if (std::chrono::steady_clock::now() >= deadline)
      throw RendezvousTimeout("node 0's store at " + options_.masterAddr + ":" + std::to_string(port_) +
                              " did not answer in time: " + lastError);
  }
}

std::optional<std::string> StaticRendezvous::recordedFailure() {
  if (!client_->check({failedKey()})) return std::nullopt;
  return store::toString(client_->get(failedKey()));
}

std::optional<std::string> StaticRendezvous::barrier(const std::string& name,
                                                     std::chrono::steady_clock::time_point deadline,
                                                     const RendezvousRequest* request) {
  const std::string base = key(name);
  if (client_->add(base, 1) == options_.numNodes) client_->set(base + "/done", store::toBytes("1"));
  const auto start = std::chrono::steady_clock::now();
  auto nextLog = start + kWaitingLogEvery;
  for (;;) {
    if (request && request->stopNow()) throw RendezvousInterrupted("interrupted in the " + name + " barrier");
    if (request && std::chrono::steady_clock::now() >= nextLog) {
      nextLog += kWaitingLogEvery;
      const std::int64_t arrived = client_->add(base, 0);
      log("rendezvous").info("waiting for the other nodes: {} of {} here ({} at {}:{}, run id {}; gives up after {})",
                             arrived, options_.numNodes, secondsText(std::chrono::steady_clock::now() - start),
                             options_.masterAddr, port_, options_.runId, secondsText(deadline - start));
    }
    try {
      client_->wait({base + "/done"}, std::chrono::milliseconds(200));
      return std::nullopt;
    } catch (const store::StoreTimeout&) {
    }
    if (!request) {
      if (auto f = recordedFailure()) return f;
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
  armTimer(false);
  const int attempt = round_;
  int workerPort = options_.nodeRank == 0 ? freshWorkerStore() : port_;
  if (options_.numNodes > 1) {
    auto deadline = std::chrono::steady_clock::now() + std::min(request.timeout, options_.joinTimeout);
    const std::string portKey = key("attempt" + std::to_string(attempt) + "/store_port");
    try {
      if (!client_) connect(deadline, request);
      // Announced before node 0 enters the barrier, so it is there when the barrier completes.
      if (options_.nodeRank == 0) client_->set(portKey, store::toBytes(std::to_string(workerPort)));
      // Every attempt starts together on every node (a restart anywhere restarts all).
      barrier("attempt" + std::to_string(attempt) + "/start", deadline, &request);
      if (options_.nodeRank != 0) {
        const std::string text = store::toString(client_->get(portKey));
        workerPort = parsePortText(text);
        if (workerPort <= 0)
          throw RendezvousError("node 0 announced an invalid workers' store port '" + text +
                                "': is every node running the same ctorchrun version?");
      }
    } catch (const store::StoreError& e) {
      throw RendezvousError(std::string("static rendezvous: ") + e.what() +
                            (options_.nodeRank == 0 ? "" : " (is node 0's ctorchrun still running?)"));
    }
  }
  attempt_ = attempt;
  reported_ = false;
  RendezvousInfo info;
  info.runId = options_.runId;
  info.round = round_++;
  info.nodeRank = options_.nodeRank;
  info.numNodes = options_.numNodes;
  // Static means every node brings the same number of workers (as torchrun assumes).
  info.nprocPerNode.assign(static_cast<std::size_t>(options_.numNodes), request.localNproc);
  info.computeRanks();
  info.storeHost = options_.masterAddr;
  info.storePort = workerPort;
  info.agentStore = true;
  info.nodeHosts.assign(static_cast<std::size_t>(options_.numNodes), std::string());
  info.nodeHosts[static_cast<std::size_t>(options_.nodeRank)] = options_.hostname;
  armTimer(options_.numNodes > 1);
  return info;
}

std::optional<RendezvousEvent> StaticRendezvous::takeEvent() {
  std::uint64_t expirations = 0;
  if (timerFd_ >= 0) [[maybe_unused]] auto n = ::read(timerFd_, &expirations, sizeof expirations);
  if (!client_ || reported_ || attempt_ < 0) return std::nullopt;
  try {
    if (auto f = recordedFailure()) {
      reported_ = true;
      return RendezvousEvent{RendezvousEventKind::RemoteFailure, "workers failed on " + *f, std::nullopt};
    }
  } catch (const store::StoreError& e) {
    // Node 0's agent is gone (its store with it): the workers' collectives are broken too.
    reported_ = true;
    return RendezvousEvent{RendezvousEventKind::Failed,
                           "lost node 0's store at " + options_.masterAddr + ":" + std::to_string(port_) +
                               " (" + e.what() + "): node 0's ctorchrun stopped",
                           std::chrono::seconds(5)};
  }
  return std::nullopt;
}

void StaticRendezvous::reportFailure(const std::string& reason) {
  if (!client_ || attempt_ < 0) return;
  try {
    // Only the first report of an attempt is kept: it names the root cause.
    client_->compareSet(failedKey(), {},
                        store::toBytes("node " + std::to_string(options_.nodeRank) + " (" + options_.hostname +
                                       "): " + reason));
  } catch (const std::exception& e) {
    log("rendezvous").warn("could not tell the other nodes about the failure: {}", e.what());
  }
}

std::optional<RendezvousEvent> StaticRendezvous::exitBarrier(std::chrono::milliseconds timeout) {
  armTimer(false);
  if (options_.numNodes <= 1 || !client_) return std::nullopt;
  try {
    if (auto f = barrier("attempt" + std::to_string(attempt_) + "/exit", std::chrono::steady_clock::now() + timeout,
                         nullptr))
      return RendezvousEvent{RendezvousEventKind::RemoteFailure, "workers failed on " + *f, std::nullopt};
  } catch (const std::exception& e) {
    // The workers succeeded; a peer that is late or gone does not change this node's result.
    log("rendezvous").warn("exit barrier: {}", e.what());
  }
  return std::nullopt;
}

void StaticRendezvous::shutdown(AgentOutcome) {
  armTimer(false);
  client_.reset();
  workerServer_.reset();
  server_.reset();
}

} // namespace ctorch::launcher
