#include "ctorch/launcher/c10d_rendezvous.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"
#include "ctorch/rdzv/c10d/store_host.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "ctorch/text/text.hpp"
#include "log.hpp"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <cerrno>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>

namespace ctorch::launcher {

namespace {

// How often an agent that lost the bind of the rendezvous port to no listener tries hosting again.
constexpr int kHostAttempts = 50;
// Store failovers one re-forming may go through (the store's host, then its successor, ...).
constexpr int kMaxFailoversPerRound = 3;

// Whether something on this machine accepts connections on `port` (IPv4 or IPv6 loopback).
bool portAnswers(int port) {
  auto tryConnect = [port](int family) {
    const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return false;
    int rc = -1;
    if (family == AF_INET) {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<std::uint16_t>(port));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_port = htons(static_cast<std::uint16_t>(port));
      a.sin6_addr = in6addr_loopback;
      rc = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    ::close(fd);
    return rc == 0;
  };
  return tryConnect(AF_INET) || tryConnect(AF_INET6);
}

} // namespace

namespace rc = ctorch::rdzv::c10d;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// Keys under this prefix are ephemeral in the native store (deleted when the connection that
// wrote them closes): every agent keeps "<prefix><run id>/<node id>" there, so the store host
// learns at once when an agent's connection drops.
constexpr const char* kAliveKeyPrefix = "ctorchrun.alive/";

// Three significant digits: these are measured times ("1.23 s").
std::string secs(milliseconds ms) { return text::secondsText(ms, 3); }

milliseconds since(Clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - t);
}

// Raised by StoreLink when the store has not answered for longer than the heartbeat expiry: the
// peers have removed this node by now, so waiting longer is pointless.
struct StoreUnreachable : store::StoreConnectionError {
  StoreUnreachable(const std::string& what, bool refusedConnections)
      : store::StoreConnectionError(what), refused(refusedConnections) {}
  bool refused;  // the host answers and refuses: the store's ctorchrun is gone (not a cut link)
};

// The rendezvous' connection to the store: one TcpStoreClient, replaced when a request fails,
// with every request bounded. In "patient" mode a failed request is retried (reconnecting) until
// the store has been silent for `unreachableLimit`, or this one request has been tried for that
// long (a reconnect is no answer to it); otherwise one attempt is made and its error passes
// through (the event loop tries again at its next tick). While a stop request is set (the agent
// waits in next()), a retry also ends when the agent is asked to stop.
class StoreLink final : public rc::CasStore {
 public:
  StoreLink(std::string host, int port, milliseconds opTimeout, milliseconds unreachableLimit,
            std::string aliveKey)
      : host_(std::move(host)),
        port_(port),
        opTimeout_(opTimeout),
        limit_(unreachableLimit),
        aliveKey_(std::move(aliveKey)) {}

  // First contact: the store host may start later than this agent, so keep trying until
  // `deadline` (short tries, so that a stop request is noticed).
  void connectFirst(Clock::time_point deadline, const RendezvousRequest& request) {
    std::string lastError;
    for (;;) {
      if (request.stopNow())
        throw RendezvousInterrupted("interrupted while connecting to the rendezvous store at " + where());
      try {
        connect();
        return;
      } catch (const store::StoreError& e) {
        lastError = e.what();
      }
      if (Clock::now() >= deadline)
        throw RendezvousTimeout("the rendezvous store at " + where() + " did not answer within the join timeout: " +
                                lastError + " (is the agent hosting it, the one whose address matches "
                                "--rdzv-endpoint, running? is the port reachable?)");
      std::this_thread::sleep_for(milliseconds(50));
    }
  }

  // Store failover: from now on the store is at host:port (an empty one until its node seeds it).
  void retarget(std::string host, int port) {
    client_.reset();
    host_ = std::move(host);
    port_ = port;
    lastSuccess_ = Clock::now();
    everConnected_ = false;
    refusedSince_.reset();
  }

  void setPatient(bool patient) { patient_ = patient; }
  // Store failover: connections refused (nothing listens on the store's port, its machine answers)
  // for this long mean the store's ctorchrun is gone: no need to wait for the whole expiry.
  void setRefusedLimit(milliseconds limit) { refusedLimit_ = limit; }
  void setRequest(const RendezvousRequest* request) { request_ = request; }
  milliseconds silentFor() const { return since(lastSuccess_); }
  std::string where() const { return host_ + ":" + std::to_string(port_); }
  std::string localAddress() {
    return call([&] { return client_->localAddress(); });
  }

  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    return call([&] {
      return store::toString(client_->compareSet(key, store::toBytes(expected), store::toBytes(desired)));
    });
  }
  // c10d's get waits for a missing key; the state key exists from the executor's first
  // compare-and-set on, so a missing one was deleted (by a hostile or confused client, or the
  // store restarted empty): waiting for it would hang the agent. Check first, fail clearly.
  std::string get(const std::string& key) override {
    return call([&] {
      if (!client_->check({key}))
        throw rc::RendezvousStateError("the rendezvous state key '" + key + "' is gone from the store at " +
                                       where() + " (deleted by another client, or the store restarted empty): "
                                       "this rendezvous cannot continue");
      return store::toString(client_->get(key));
    });
  }
  bool supportsAnnouncements() const override { return true; }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    return call([&] { return client_->add(key, delta); });
  }
  void set(const std::string& key, const std::string& value) override {
    call([&] {
      client_->set(key, store::toBytes(value));
      return 0;
    });
  }
  bool check(const std::string& key) override { return check(std::vector<std::string>{key}); }
  bool check(const std::vector<std::string>& keys) {
    return call([&] { return client_->check(keys); });
  }
  void deleteKey(const std::string& key) override {
    call([&] { return client_->deleteKey(key); });
  }
  bool checkAll(const std::vector<std::string>& keys) override { return check(keys); }
  std::vector<std::string> getMany(const std::vector<std::string>& keys) override {
    return call([&] {
      std::vector<std::string> out;
      for (const auto& value : client_->multiGet(keys)) out.push_back(store::toString(value));
      return out;
    });
  }
  void dropAliveKey() {
    call([&] { return client_->deleteKey(aliveKey_); });
  }
  void disconnect() { client_.reset(); }

 private:
  void connect() {
    client_.reset();
    store::TcpStoreClientOptions o;
    o.timeout = opTimeout_;
    o.operationTimeout = opTimeout_;
    o.retryConnect = false;  // the callers retry on their own schedule
    auto c = std::make_unique<store::TcpStoreClient>(host_, static_cast<std::uint16_t>(port_), o);
    c->set(aliveKey_, store::toBytes("1"));
    client_ = std::move(c);
    if (!everConnected_) lastSuccess_ = Clock::now();
    everConnected_ = true;
  }

  template <typename F>
  auto call(F&& f) -> decltype(f()) {
    const auto started = Clock::now();
    for (;;) {
      try {
        if (!client_ || !client_->usable()) connect();
        auto result = f();
        lastSuccess_ = Clock::now();
        refusedSince_.reset();
        return result;
      } catch (const store::StoreError& e) {
        client_.reset();
        lastError_ = e.what();
        if (!dynamic_cast<const store::StoreRefused*>(&e))
          refusedSince_.reset();
        else if (!refusedSince_)
          refusedSince_ = Clock::now();
        if (refusedLimit_ && refusedSince_ && since(*refusedSince_) >= *refusedLimit_)
          throw StoreUnreachable("the rendezvous store at " + where() + " has refused connections for " +
                                 secs(since(*refusedSince_)) + ": its ctorchrun is gone (" + lastError_ + ")",
                                 true);
        if (silentFor() > limit_ || since(started) > limit_)
          throw StoreUnreachable("no answer from the rendezvous store at " + where() + " for " +
                                 secs(std::max(silentFor(), since(started))) + " (" + lastError_ + ")",
                                 false);
        if (!patient_) throw;
      }
      pause(milliseconds(50));
    }
  }

  // Sleeps between retries; ends early (throwing) when the agent is asked to stop.
  void pause(milliseconds d) {
    if (!request_ || request_->cancelFd < 0) {
      std::this_thread::sleep_for(d);
      return;
    }
    if (request_->stopNow()) throw RendezvousInterrupted("interrupted while retrying the rendezvous store at " + where());
    pollfd p{request_->cancelFd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(d.count())) > 0 && request_->stopNow())
      throw RendezvousInterrupted("interrupted while retrying the rendezvous store at " + where());
  }

  std::string host_;
  int port_;
  milliseconds opTimeout_, limit_;
  std::string aliveKey_;
  std::unique_ptr<store::TcpStoreClient> client_;
  Clock::time_point lastSuccess_ = Clock::now();  // the last answered request (a reconnect is none)
  bool everConnected_ = false;
  std::string lastError_;
  bool patient_ = true;
  const RendezvousRequest* request_ = nullptr;
  std::optional<milliseconds> refusedLimit_;
  std::optional<Clock::time_point> refusedSince_;
};

// The executor's clock: real time; its sleeps wake up for a stop request of the agent.
class AgentClock final : public rc::Clock {
 public:
  rc::Timestamp now() override {
    return std::chrono::time_point_cast<milliseconds>(std::chrono::system_clock::now());
  }
  std::chrono::steady_clock::time_point steadyNow() override { return std::chrono::steady_clock::now(); }
  void sleepFor(milliseconds d) override {
    if (check_) check_();
    if (!request_ || request_->cancelFd < 0) {
      std::this_thread::sleep_for(d);
      return;
    }
    auto until = std::chrono::steady_clock::now() + d;
    for (;;) {
      auto left = std::chrono::duration_cast<milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return;
      pollfd p{request_->cancelFd, POLLIN, 0};
      int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r > 0 && request_->stopNow()) throw RendezvousInterrupted("interrupted while waiting for the rendezvous");
      if (r < 0 && errno != EINTR) throwErrno("poll");
    }
  }
  void setRequest(const RendezvousRequest* r) { request_ = r; }
  // Runs before every wait of the executor (it may throw to end the wait).
  void setCheck(std::function<void()> check) { check_ = std::move(check); }

 private:
  const RendezvousRequest* request_ = nullptr;
  std::function<void()> check_;
};

} // namespace

C10dRendezvousOptions c10dOptionsFrom(const LaunchConfig& c) {
  C10dRendezvousOptions o;
  try {
    if (c.rdzvId.empty()) throw rc::RendezvousConfigError("--rdzv-id must not be empty");
    o.settings = rc::ctorchrunSettings(c.rdzvId, c.minNodes, c.maxNodes, c.rdzvConf);
    o.isHost = c.rdzvConf.isHost;
  } catch (const rc::RendezvousConfigError& e) {
    throw UsageError(e.what());
  }
  o.endpointHost = c.rdzvEndpointHost.empty() ? "localhost" : c.rdzvEndpointHost;
  o.endpointPort = c.rdzvEndpointPort;
  o.localAddr = c.localAddr;
  o.requestedRank = c.nodeRank;
  o.hostname = c.hostname;
  const auto& s = o.settings;
  o.tick = std::clamp(s.keepAliveInterval / 4, milliseconds(50), milliseconds(500));
  o.operationTimeout =
      std::max(milliseconds(100), std::min({s.readTimeout, s.heartbeatTimeout, s.keepAliveInterval}));
  o.storeFailover = c.storeFailover;
  return o;
}

// ---- the handler ------------------------------------------------------------------------------------
class C10dRendezvous::Impl {
 public:
  explicit Impl(C10dRendezvousOptions options) : o_(std::move(options)) {
    timerFd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (timerFd_ < 0) throwErrno("timerfd_create");
    dropFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (dropFd_ < 0) throwErrno("eventfd");
    epollFd_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epollFd_ < 0) throwErrno("epoll_create1");
    for (int fd : {timerFd_, dropFd_}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (::epoll_ctl(epollFd_, EPOLL_CTL_ADD, fd, &ev) != 0) throwErrno("epoll_ctl");
    }
    nodeId_ = rc::makeNodeId(o_.hostname.empty() ? "node" : o_.hostname, static_cast<long>(::getpid()), 0);
  }

  ~Impl() {
    // The server calls back into this object from its thread: stop it first.
    hostServer_.reset();
    standby_.reset();
    workerStore_.reset();
    ::close(epollFd_);
    ::close(dropFd_);
    ::close(timerFd_);
  }

  int eventFd() const { return epollFd_; }
  bool hostsStore() const { return hostServer_ != nullptr; }

  RendezvousInfo next(const RendezvousRequest& request) {
    armTimer(false);
    try {
      if (!link_) setUp(request);
      if (!executor_) makeExecutor(request);
    } catch (const store::StoreError&) {
      translate();
    } catch (const rc::RendezvousError&) {
      translate();
    } catch (const rc::RendezvousConfigError&) {
      translate();
    }
    eventSent_ = false;

    // A fresh workers' store for every round: the round's workers never see keys of an earlier
    // one (restarted or re-formed), whatever their TORCHELASTIC_RESTART_COUNT.
    workerStore_.reset();
    store::TcpStoreServerOptions wo;
    wo.port = 0;
    wo.debugLog = [](const std::string& m) { log("store").debug("{}", m); };
    workerStore_ = std::make_unique<store::TcpStoreServer>(wo);
    executor_->setStorePort(workerStore_->port());

    link_->setPatient(true);
    clock_.setRequest(&request);
    link_->setRequest(&request);
    rc::RoundResult r;
    // A node left with a minority of its last round while it re-forms (the others were removed:
    // cut off, after its own workers failed) stops instead of waiting for the join timeout.
    if (o_.storeFailover) clock_.setCheck([this] {
      if (auto why = minorityReason()) throw RendezvousError(*why);
    });
    struct ClearCheck {
      AgentClock& c;
      ~ClearCheck() { c.setCheck(nullptr); }
    } clearCheck{clock_};
    for (int failovers = 0;; ++failovers) {
      try {
        r = executor_->nextRound();
        break;
      } catch (const StoreUnreachable& e) {
        // The store's host was lost while this node re-formed (its workers failed with it).
        if (failovers < kMaxFailoversPerRound && failOver(e.what())) continue;
        clock_.setRequest(nullptr);
        link_->setRequest(nullptr);
        translate();
      } catch (...) {
        clock_.setRequest(nullptr);
        link_->setRequest(nullptr);
        translate();
      }
    }
    clock_.setRequest(nullptr);
    link_->setRequest(nullptr);
    if (o_.storeFailover && round_ && r.nodeCount * 2 <= round_->nodeCount) {
      // The other side of a partition may have failed over and trains on: two groups writing the
      // same snapshots must never happen, so only a majority of the last round may go on.
      std::ostringstream why;
      why << "round " << r.round << " formed with " << r.nodeCount << " of the previous round's "
          << round_->nodeCount << " nodes: not a majority, so the other side may have taken the store "
          << "over (--store-failover) and trains on; this side stops";
      round_.reset();
      throw RendezvousError(why.str());
    }
    round_ = r;
    if (r.nodeRank != 0) workerStore_.reset();  // only node rank 0's is used

    const rc::NodeSlot& head = r.nodes.at(0);
    RendezvousInfo info;
    info.runId = o_.settings.runId;
    info.round = static_cast<int>(r.round);
    info.nodeRank = r.nodeRank;
    info.numNodes = r.nodeCount;
    for (const auto& n : r.nodes) {
      info.nprocPerNode.push_back(n.nproc);
      info.nodeHosts.push_back(n.host);
    }
    info.computeRanks();
    info.storeHost = head.addr;
    if (!head.storePort)
      throw RendezvousError("node rank 0 ('" + head.id + "') announced no workers' store: is every node "
                            "running the same ctorchrun version?");
    info.storePort = *head.storePort;
    info.agentStore = true;
    info.restartCount = static_cast<int>(r.restartCount);
    armTimer(true);
    return info;
  }

  std::optional<RendezvousEvent> takeEvent() {
    drain(timerFd_);
    drain(dropFd_);
    if (!round_ || !executor_) return std::nullopt;
    link_->setPatient(false);
    std::optional<RendezvousEvent> event;
    try {
      removeDropped();
      const rc::RoundAssessment a = executor_->keepAlive();
      event = minority(a);
      if (!event) event = eventFor(a);
    } catch (const StoreUnreachable& e) {
      // With failover, the next ticks see the re-created state (the lost store host's nodes
      // removed: PeerLost, a new round at the new store).
      if (!failOver(e.what())) event = cutOff(e);
    } catch (const store::StoreError& e) {
      // One request failed; the next tick tries again (the limit above ends this).
      log("rendezvous").debug("heartbeat: {}", e.what());
    } catch (const rc::RendezvousTimeout& e) {
      log("rendezvous").warn("heartbeat: {}", e.what());
    } catch (const rc::RendezvousError& e) {
      event = RendezvousEvent{RendezvousEventKind::Failed, e.what(), kLostPeerGrace};
    }
    if (!event || eventSent_) return std::nullopt;
    eventSent_ = true;
    return event;
  }

  void reportFailure(const std::string& reason) {
    if (!executor_ || !round_) return;
    link_->setPatient(true);
    try {
      executor_->reportFailure(reason);
    } catch (const StoreUnreachable& e) {
      // Lost with the store's host: the re-formed round restarts every worker anyway.
      if (!failOver(e.what()))
        log("rendezvous").warn("could not report the failure to the other nodes: {}", e.what());
    } catch (const std::exception& e) {
      log("rendezvous").warn("could not report the failure to the other nodes: {}", e.what());
    }
  }

  std::optional<RendezvousEvent> exitBarrier(milliseconds timeout) {
    armTimer(false);
    if (!executor_ || !round_ || round_->nodeCount <= 1) return std::nullopt;
    const std::string key = "ctorchrun.exit/" + o_.settings.runId + "/" + std::to_string(round_->round);
    auto& l = log("rendezvous");
    link_->setPatient(true);
    try {
      link_->add(key, 1);
      auto deadline = Clock::now() + timeout;
      for (;;) {
        if (link_->add(key, 0) >= round_->nodeCount) return std::nullopt;
        removeDropped();
        auto a = executor_->keepAlive();
        if (a.status == rc::RoundStatus::PeerFailed)
          return RendezvousEvent{RendezvousEventKind::RemoteFailure, a.reason, std::nullopt};
        if (a.status == rc::RoundStatus::PeerLost || a.status == rc::RoundStatus::Removed ||
            a.status == rc::RoundStatus::Superseded || a.status == rc::RoundStatus::Closed) {
          l.warn("exit barrier: {}; not waiting for the other nodes", a.reason);
          return std::nullopt;
        }
        if (Clock::now() >= deadline) {
          l.warn("exit barrier: only {} of {} nodes finished within {}; exiting anyway",
                 link_->add(key, 0), round_->nodeCount, secs(timeout));
          return std::nullopt;
        }
        std::this_thread::sleep_for(o_.tick);
      }
    } catch (const std::exception& e) {
      l.warn("exit barrier: {}", e.what());
    }
    return std::nullopt;
  }

  void shutdown(AgentOutcome outcome) {
    armTimer(false);
    auto& l = log("rendezvous");
    if (link_ && executor_) {
      link_->setPatient(outcome != AgentOutcome::Interrupted);
      try {
        if (outcome == AgentOutcome::Interrupted) {
          executor_->leave();  // the others re-form without this node if enough remain
        } else {
          executor_->close();  // the job is over (done or failed): nobody may join any more
        }
      } catch (const std::exception& e) {
        l.debug("leaving the rendezvous: {}", e.what());
      }
      if (!hostServer_) {
        try {
          link_->setPatient(false);
          link_->dropAliveKey();
        } catch (const std::exception&) {
        }
      }
      if (hostServer_ && outcome != AgentOutcome::Interrupted) waitForPeersToLeave();
    }
    if (link_) link_->disconnect();
    workerStore_.reset();
    hostServer_.reset();
  }

 private:
  void setUp(const RendezvousRequest& request) {
    auto& l = log("rendezvous");
    const auto& s = o_.settings;
    auto decision = rc::decideStoreHost(o_.endpointHost, o_.isHost, rc::discoverLocalIdentity(),
                                        rc::resolveHost(o_.endpointHost));
    if (decision.isHost) {
      store::TcpStoreServerOptions so = hostOptions();
      so.port = static_cast<std::uint16_t>(o_.endpointPort);
      for (int attempt = 1;; ++attempt) {
        try {
          hostServer_ = std::make_unique<store::TcpStoreServer>(so);
          l.info("hosting the rendezvous store on port {} ({})", hostServer_->port(), decision.reason);
          break;
        } catch (const store::StoreBindError& e) {
          // Several agents of one machine, or a store already served there: as torch does, an agent
          // that only inferred it is the host joins as a client.
          if (decision.explicitChoice || e.error() != EADDRINUSE)
            throw RendezvousError("cannot host the rendezvous store on port " + std::to_string(o_.endpointPort) +
                                  ": " + e.what() +
                                  (decision.explicitChoice ? " (is_host=true in --rdzv-conf)" : ""));
          // Agents starting together can all lose the bind (two SO_REUSEADDR sockets bound, each
          // listen refused): then nobody serves the port. Only a port that answers is joined; else
          // hosting is tried again, a moment later and at a moment of this agent's own.
          if (attempt >= kHostAttempts || portAnswers(o_.endpointPort)) {
            l.info("port {} is already served on this machine: joining that store as a client",
                   o_.endpointPort);
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(5 + (::getpid() + attempt * 7) % 20));
        }
      }
    }
    if (o_.storeFailover && !hostServer_) {
      // Ready before this node joins (its port goes into its participant entry), idle until the
      // store's host is lost and this node is the next in line.
      store::TcpStoreServerOptions so = hostOptions();
      so.port = 0;
      // Connections that come and go before it serves (the others waiting for it) mean nothing.
      so.onEphemeralKeyLost = [this](const std::string& key) {
        if (standbyServes_.load()) onAliveKeyLost(key);
      };
      standby_ = std::make_unique<store::TcpStoreServer>(so);
      l.info("store failover: standby rendezvous store on port {}", standby_->port());
    }
    link_ = std::make_unique<StoreLink>(o_.endpointHost, o_.endpointPort, o_.operationTimeout,
                                        s.heartbeatExpiry(), aliveKey(nodeId_));
    // Two ticks of refusals (at least 0.5 s): a store that is merely slow never refuses.
    if (o_.storeFailover) link_->setRefusedLimit(std::max(milliseconds(500), o_.tick * 2));
    link_->connectFirst(Clock::now() + s.joinTimeout, request);
  }

  // The rendezvous store's options (also its standby's): agents' alive keys are ephemeral.
  store::TcpStoreServerOptions hostOptions() {
    store::TcpStoreServerOptions so;
    so.ephemeralKeyPrefix = std::string("/") + kAliveKeyPrefix;
    so.onEphemeralKeyLost = [this](const std::string& key) { onAliveKeyLost(key); };
    so.debugLog = [](const std::string& m) { log("store").debug("{}", m); };
    return so;
  }

  void makeExecutor(const RendezvousRequest& request) {
    rc::NodeInfo self;
    self.id = nodeId_;
    self.host = o_.hostname;
    self.nproc = request.localNproc;
    self.requestedRank = o_.requestedRank;
    // How the others reach this node (for the workers' store, if it becomes node rank 0): as
    // given, else the endpoint itself when the store is here, else the address of this machine
    // on the route to the store.
    if (!o_.localAddr.empty())
      self.addr = o_.localAddr;
    else if (hostServer_)
      self.addr = o_.endpointHost;
    else
      self.addr = link_->localAddress();
    if (standby_) self.standbyPort = standby_->port();
    self.storeHost = hostServer_ != nullptr;
    rc::ExecutorOptions eo;
    eo.log = [](const std::string& line) { log("rendezvous").info("{}", line); };
    executor_ = std::make_unique<rc::Executor>(*link_, o_.settings, self, clock_, eo);
    log("rendezvous").info("node '{}' joins rendezvous '{}' at {} (nnodes {}:{}, heartbeat every {}, dead after {})",
                           self.id, o_.settings.runId, link_->where(), o_.settings.minNodes,
                           o_.settings.maxNodes, secs(o_.settings.keepAliveInterval),
                           secs(o_.settings.heartbeatExpiry()));
  }

  std::string aliveKey(const std::string& node) const {
    return std::string(kAliveKeyPrefix) + o_.settings.runId + "/" + node;
  }

  // Server thread: an agent's connection closed while its alive key was set.
  void onAliveKeyLost(const std::string& key) {
    const std::string prefix = std::string("/") + kAliveKeyPrefix + o_.settings.runId + "/";
    if (key.compare(0, prefix.size(), prefix) != 0) return;  // another job's agent
    std::string node = key.substr(prefix.size());
    if (node.empty() || node == nodeId_) return;
    {
      std::lock_guard<std::mutex> lock(dropMutex_);
      dropped_.push_back(node);
    }
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(dropFd_, &one, sizeof one);
  }

  void removeDropped() {
    std::vector<std::string> ids;
    {
      std::lock_guard<std::mutex> lock(dropMutex_);
      ids.swap(dropped_);
    }
    if (ids.empty() || !executor_) return;
    try {
      executor_->removeNodes(ids, "the connection of its ctorchrun to the store closed (the node or its agent died)");
    } catch (...) {
      std::lock_guard<std::mutex> lock(dropMutex_);  // try again at the next tick
      dropped_.insert(dropped_.end(), ids.begin(), ids.end());
      throw;
    }
  }

  std::optional<RendezvousEvent> eventFor(const rc::RoundAssessment& a) {
    switch (a.status) {
      case rc::RoundStatus::Healthy:
        return std::nullopt;
      case rc::RoundStatus::Closed:
        // Only a node whose job ended (it failed for good, or gave up waiting for this one at
        // its exit barrier) closes the rendezvous while others still run.
        return RendezvousEvent{RendezvousEventKind::Failed,
                               "the rendezvous was closed by another node while this node's workers ran: "
                               "the job ended there",
                               kLostPeerGrace};
      case rc::RoundStatus::NodesWaiting:
        // Scale up at the workers' next step boundary: SIGTERM and the full grace period.
        return RendezvousEvent{RendezvousEventKind::MembershipChanged, a.reason + ": re-forming the round",
                               std::nullopt};
      case rc::RoundStatus::PeerFailed:
        return RendezvousEvent{RendezvousEventKind::RemoteFailure, a.reason, std::nullopt};
      case rc::RoundStatus::PeerLost:
      case rc::RoundStatus::Removed:
      case rc::RoundStatus::Superseded:
        return RendezvousEvent{RendezvousEventKind::MembershipChanged, a.reason, kLostPeerGrace};
    }
    return std::nullopt;
  }

  // --store-failover: the store did not answer for the heartbeat expiry. The survivors of the
  // last round move to the standby store of its first node (by node rank) that did not serve the
  // lost store; that node re-creates the rendezvous state there from its own copy, without the
  // lost store host's nodes, if it can reach a majority of the round (itself included): a node
  // that is merely cut off must not take the store over. True when this node now uses the new
  // store; false (logged) when it cannot (then it is cut off, as without failover).
  bool failOver(const std::string& why) {
    if (!o_.storeFailover || !round_ || !executor_ || !executor_->lastState()) return false;
    auto& l = log("rendezvous");
    const auto started = Clock::now();
    std::vector<std::string> lost;
    const rc::NodeSlot* next = nullptr;
    for (const auto& n : round_->nodes) {
      if (n.storeHost)
        lost.push_back(n.id);
      else if (!next && n.standbyPort)
        next = &n;
    }
    if (!next) {
      l.error("store failover: {}; no node of round {} has a standby store", why, round_->round);
      return false;
    }
    const std::string target = next->addr + ":" + std::to_string(*next->standbyPort);
    l.warn("store failover: {}; moving to the standby store of node '{}' at {}", why, next->id, target);
    if (next->id == nodeId_) {
      if (!standby_) return false;
      int reachable = 1;
      for (const auto& n : round_->nodes)
        if (n.id != nodeId_ && !n.storeHost && n.standbyPort && answers(n.addr, *n.standbyPort)) ++reachable;
      if (reachable * 2 <= round_->nodeCount) {
        l.error("store failover: only {} of round {}'s {} nodes answer from here (a majority must, or this "
                "node may be the one cut off): not taking the store over",
                reachable, round_->round, round_->nodeCount);
        return false;
      }
      standbyServes_ = true;
      hostServer_ = std::move(standby_);
      link_->retarget(next->addr, hostServer_->port());
      link_->setPatient(true);
      try {
        executor_->seedStore(lost, "its agent served the rendezvous store, which was lost");
      } catch (const std::exception& e) {
        l.error("store failover: could not re-create the rendezvous state in the standby store: {}", e.what());
        return false;
      }
      executor_->setStoreHost(true);
      executor_->setStandbyPort(std::nullopt);
      l.warn("store failover: this node serves the rendezvous store now (port {}), re-created from its own "
             "copy of round {} in {}", hostServer_->port(), round_->round, secs(since(started)));
      return true;
    }
    // Wait for the successor to seed its standby: it notices the loss within about the same time.
    link_->retarget(next->addr, *next->standbyPort);
    link_->setPatient(false);
    const std::string stateKey = rc::stateKey(o_.settings.runId);
    const auto deadline = started + failoverWait();
    std::string lastError = "the state was not there yet";
    for (;;) {
      try {
        if (link_->check(stateKey)) break;
      } catch (const store::StoreError& e) {
        lastError = e.what();
        link_->retarget(next->addr, *next->standbyPort);  // a failed request must not count as silence
      }
      if (Clock::now() >= deadline) {
        l.error("store failover: the standby store of node '{}' at {} held no rendezvous state within {} ({})",
                next->id, target, secs(failoverWait()), lastError);
        return false;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    try {
      executor_->adoptStore();
    } catch (const std::exception& e) {
      l.error("store failover: reading the re-created rendezvous state at {}: {}", target, e.what());
      return false;
    }
    l.warn("store failover: now using the rendezvous store of node '{}' at {} ({} after the loss was noticed)",
           next->id, target, secs(since(started)));
    return true;
  }

  // How long a survivor waits for the next node to seed its standby: that node notices the loss
  // up to a heartbeat expiry later, then probes the others.
  milliseconds failoverWait() const { return o_.settings.heartbeatExpiry() * 2 + milliseconds(2000); }

  bool answers(const std::string& host, int port) const {
    try {
      store::TcpStoreClientOptions co;
      co.timeout = std::min(o_.operationTimeout, milliseconds(1000));
      co.operationTimeout = co.timeout;
      co.retryConnect = false;
      store::TcpStoreClient probe(host, static_cast<std::uint16_t>(port), co);
      probe.check({"ctorchrun.probe"});
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  // --store-failover: a node whose round lost a majority of its nodes stops (the majority side
  // may have failed over to another store and trains on without it).
  std::optional<RendezvousEvent> minority(const rc::RoundAssessment& a) {
    if (a.status != rc::RoundStatus::PeerLost && a.status != rc::RoundStatus::Removed) return std::nullopt;
    auto why = minorityReason();
    if (!why) return std::nullopt;
    return RendezvousEvent{RendezvousEventKind::Failed, a.reason + ": " + *why + "; stopping its workers",
                           kLostPeerGrace};
  }

  // Set when, with --store-failover, no more than half of the last round's nodes are still in the
  // rendezvous as this node sees it: in any of its lists (a node re-joining has left the round for
  // the wait list or the next round; a lost node is removed from all of them).
  std::optional<std::string> minorityReason() const {
    if (!o_.storeFailover || !round_ || round_->nodeCount < 2 || !executor_) return std::nullopt;
    const auto& st = executor_->lastState();
    if (!st) return std::nullopt;
    int left = 0;
    for (const auto& id : round_->participantIds) left += st->heartbeats.count(id) ? 1 : 0;
    if (left * 2 > round_->nodeCount) return std::nullopt;
    return "only " + std::to_string(left) + " of round " + std::to_string(round_->round) + "'s " +
           std::to_string(round_->nodeCount) +
           " nodes are left here, not a majority; this node is cut off from the others (they may have taken "
           "the store over with --store-failover)";
  }

  // The rendezvous store stopped answering and no failover took its place. Says which node served
  // it, what the silence can mean, and (without --store-failover) what would have survived it.
  RendezvousEvent cutOff(const StoreUnreachable& e) {
    std::string server;
    if (round_)
      for (const auto& n : round_->nodes)
        if (n.storeHost) server = "node '" + n.id + "' (" + n.addr + ")";
    if (server.empty()) server = "the node that serves it";
    std::string text = e.what();
    if (e.refused)
      text += "; " + server + " served the rendezvous store: that ctorchrun ended or was killed, and every node "
              "loses the store with it";
    else
      text += ": " + server + ", which serves the rendezvous store, was lost, or this node is cut off from the "
              "others (they have removed it by now)";
    if (!o_.storeFailover)
      text += ". Without --store-failover no other store takes its place: with 3 or more nodes, --store-failover "
              "keeps the nodes that still reach each other training; run the same command again to resume "
              "from the last snapshot";
    return RendezvousEvent{RendezvousEventKind::Failed, text + "; stopping its workers", kLostPeerGrace};
  }

  // Only after success or a failure of the whole job: the other agents still need the store to
  // pass the exit barrier and close, and agents of other jobs (other --rdzv-id on the same
  // endpoint) may still use it. Wait (bounded by close_timeout) until every other agent's
  // connection is gone: each holds one ephemeral key, this agent the last one.
  void waitForPeersToLeave() {
    auto deadline = Clock::now() + o_.settings.closeTimeout;
    while (hostServer_->ephemeralKeyCount() > 1) {
      if (Clock::now() >= deadline) {
        log("rendezvous").warn("{} other agent(s) still connected to the rendezvous store hosted here "
                               "after {}; shutting it down (they lose the store)",
                               hostServer_->ephemeralKeyCount() - 1, secs(o_.settings.closeTimeout));
        return;
      }
      std::this_thread::sleep_for(milliseconds(20));
    }
  }

  [[noreturn]] void translate() {
    try {
      throw;
    } catch (const rc::RendezvousTimeout& e) {
      throw RendezvousTimeout(e.what());
    } catch (const rc::RendezvousGracefulExit& e) {
      throw RendezvousGracefulExit(e.what());
    } catch (const rc::RendezvousError& e) {
      throw RendezvousError(e.what());
    } catch (const rc::RendezvousConfigError& e) {
      throw UsageError(e.what());
    } catch (const StoreUnreachable& e) {
      throw RendezvousError(std::string(e.what()) +
                            ": lost the rendezvous store (its ctorchrun stopped, or this node is cut off)");
    } catch (const store::StoreError& e) {
      throw RendezvousError("rendezvous store at " + o_.endpointHost + ":" + std::to_string(o_.endpointPort) +
                            ": " + e.what());
    }
  }

  void armTimer(bool on) {
    itimerspec spec{};
    if (on) {
      auto ms = o_.tick.count();
      spec.it_interval.tv_sec = ms / 1000;
      spec.it_interval.tv_nsec = (ms % 1000) * 1000000;
      spec.it_value = spec.it_interval;
    }
    if (::timerfd_settime(timerFd_, 0, &spec, nullptr) != 0) throwErrno("timerfd_settime");
  }

  static void drain(int fd) {
    std::uint64_t v = 0;
    [[maybe_unused]] ssize_t n = ::read(fd, &v, sizeof v);
  }

  C10dRendezvousOptions o_;
  std::string nodeId_;
  int timerFd_ = -1, dropFd_ = -1, epollFd_ = -1;
  AgentClock clock_;
  std::unique_ptr<store::TcpStoreServer> hostServer_;
  std::unique_ptr<store::TcpStoreServer> standby_;  // --store-failover, until promoted
  std::atomic<bool> standbyServes_{false};
  std::unique_ptr<StoreLink> link_;
  std::unique_ptr<rc::Executor> executor_;
  std::unique_ptr<store::TcpStoreServer> workerStore_;
  std::optional<rc::RoundResult> round_;
  bool eventSent_ = false;
  std::mutex dropMutex_;
  std::vector<std::string> dropped_;
};

C10dRendezvous::C10dRendezvous(C10dRendezvousOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
C10dRendezvous::~C10dRendezvous() = default;
RendezvousInfo C10dRendezvous::next(const RendezvousRequest& request) { return impl_->next(request); }
int C10dRendezvous::eventFd() const { return impl_->eventFd(); }
std::optional<RendezvousEvent> C10dRendezvous::takeEvent() { return impl_->takeEvent(); }
void C10dRendezvous::reportFailure(const std::string& reason) { impl_->reportFailure(reason); }
std::optional<RendezvousEvent> C10dRendezvous::exitBarrier(milliseconds timeout) {
  return impl_->exitBarrier(timeout);
}
void C10dRendezvous::shutdown(AgentOutcome outcome) { impl_->shutdown(outcome); }
bool C10dRendezvous::hostsStore() const { return impl_->hostsStore(); }

} // namespace ctorch::launcher
