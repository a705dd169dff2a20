// The c10d rendezvous handler in the agent: sets up (or joins) the store, forms rounds with the
// executor, turns its assessments into events for the agent; failover and the end of a job are beside it.
#include "ctorch/launcher/c10d_rendezvous.hpp"

#include "c10d_rendezvous_impl.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/store_host.hpp"
#include "log.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>
#include <thread>

namespace ctorch::launcher {

namespace {

using std::chrono::milliseconds;

// How often an agent that lost the bind of the rendezvous port to no listener tries hosting again.
constexpr int kHostAttempts = 50;
// Store failovers one re-forming may go through (the store's host, then its successor, ...).
constexpr int kMaxFailoversPerRound = 3;

// How long a store this agent serves waits on a client that does not take its replies once they
// have filled the server (TcpStoreServerOptions::replyTimeout): everyone's requests wait meanwhile,
// and such a client is dropped one window after it stopped taking them (a slow one after one or two
// windows). A quarter of the agents' request bound (operationTimeout: an agent whose request goes
// unanswered that long drops its connection, and its peers take the closed connection for its
// death) and at most a sixth of the heartbeat expiry (after which the agents give up on the store):
// 250 ms at the defaults. With the server's 5 s window (5-10 s of waiting) connections that asked
// for a large value and never read made both agents of a job give up after 3.25 s (issue 58.1).
milliseconds replyWindow(const C10dRendezvousOptions& o) {
  return std::clamp(std::min(o.operationTimeout / 4, o.settings.heartbeatExpiry() / 6), milliseconds(100),
                    milliseconds(5000));
}

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

C10dRendezvous::Impl::Impl(C10dRendezvousOptions options) : o_(std::move(options)) {
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
  nodeId_ = rdzv::c10d::makeNodeId(o_.hostname.empty() ? "node" : o_.hostname, static_cast<long>(::getpid()), 0);
}

C10dRendezvous::Impl::~Impl() {
  // The servers call back into this object from their threads: stop them first.
  beacon_.reset();
  hostServer_.reset();
  redirect_.reset();
  standby_.reset();
  workerStore_.reset();
  ::close(epollFd_);
  ::close(dropFd_);
  ::close(timerFd_);
}

RendezvousInfo C10dRendezvous::Impl::next(const RendezvousRequest& request) {
  armTimer(false);
  try {
    if (!link_) setUp(request);
    if (!executor_) makeExecutor(request);
  } catch (const store::StoreError&) {
    translate();
  } catch (const rdzv::c10d::RendezvousError&) {
    translate();
  } catch (const rdzv::c10d::RendezvousConfigError&) {
    translate();
  }
  eventSent_ = false;

  // A fresh workers' store for every round: the round's workers never see keys of an earlier
  // one (restarted or re-formed), whatever their TORCHELASTIC_RESTART_COUNT.
  workerStore_.reset();
  store::TcpStoreServerOptions wo;
  wo.port = 0;
  wo.host = loopbackBind(announcedAddr_);
  wo.replyTimeout = replyWindow(o_);  // the workers' own timeouts are seconds too
  wo.debugLog = [](const std::string& m) { log("store").debug("{}", m); };
  if (o_.controlPlane) wo.side = o_.controlPlane();
  workerStore_ = std::make_unique<store::TcpStoreServer>(wo);
  executor_->setStorePort(workerStore_->port());

  const rdzv::c10d::RoundResult r = formRound(request);
  if (o_.storeFailover && round_) {
    // The other side of a partition may have failed over and trains on: two groups writing the
    // same snapshots must never happen, so only a majority of the last round may go on.
    if (auto why = rdzv::c10d::minorityRoundReason(*round_, r)) {
      round_.reset();
      throw RendezvousError(*why);
    }
  }
  round_ = r;
  if (r.nodeRank != 0) workerStore_.reset();  // only node rank 0's is used

  const rdzv::c10d::NodeSlot& head = r.nodes.at(0);
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

rdzv::c10d::RoundResult C10dRendezvous::Impl::formRound(const RendezvousRequest& request) {
  link_->setPatient(true);
  clock_.setRequest(&request);
  link_->setRequest(&request);
  rdzv::c10d::RoundResult r;
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
  return r;
}

std::optional<RendezvousEvent> C10dRendezvous::Impl::takeEvent() {
  drain(timerFd_);
  drain(dropFd_);
  if (!round_ || !executor_) return std::nullopt;
  link_->setPatient(false);
  std::optional<RendezvousEvent> event;
  try {
    removeDropped();
    const rdzv::c10d::RoundAssessment a = executor_->keepAlive();
    event = minority(a);
    if (!event) event = eventFor(a);
  } catch (const StoreUnreachable& e) {
    // With failover, the next ticks see the re-created state (the lost store host's nodes
    // removed: PeerLost, a new round at the new store).
    if (!failOver(e.what())) event = cutOff(e);
  } catch (const store::StoreError& e) {
    // One request failed; the next tick tries again (the limit above ends this).
    log("rendezvous").debug("heartbeat: {}", e.what());
  } catch (const rdzv::c10d::RendezvousTimeout& e) {
    log("rendezvous").warn("heartbeat: {}", e.what());
  } catch (const rdzv::c10d::RendezvousError& e) {
    event = RendezvousEvent{RendezvousEventKind::Failed, e.what(), kLostPeerGrace};
  }
  if (!event || eventSent_) return std::nullopt;
  eventSent_ = true;
  return event;
}

void C10dRendezvous::Impl::reportFailure(const std::string& reason) {
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

void C10dRendezvous::Impl::setUp(const RendezvousRequest& request) {
  auto& l = log("rendezvous");
  const auto& s = o_.settings;
  auto decision = rdzv::c10d::decideStoreHost(o_.endpointHost, o_.isHost, rdzv::c10d::discoverLocalIdentity(),
                                      rdzv::c10d::resolveHost(o_.endpointHost));
  if (decision.isHost) {
    store::TcpStoreServerOptions so = hostOptions();
    so.host = loopbackBind(o_.endpointHost);
    so.port = static_cast<std::uint16_t>(o_.endpointPort);
    for (int attempt = 1;; ++attempt) {
      try {
        hostServer_ = std::make_unique<store::TcpStoreServer>(so);
        l.info("hosting the rendezvous store on port {} ({}; listening on {})", hostServer_->port(), decision.reason,
               so.host.empty() ? std::string("every interface") : so.host);
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
  link_ = std::make_unique<StoreLink>(o_.endpointHost, o_.endpointPort, o_.operationTimeout,
                                      s.heartbeatExpiry(), aliveKey(nodeId_));
  // Two ticks of refusals (at least 0.5 s): a store that is merely slow never refuses.
  if (o_.storeFailover) link_->setRefusedLimit(std::max(milliseconds(500), o_.tick * 2));
  link_->connectFirst(Clock::now() + s.joinTimeout, request);
  // How the others reach this node (its workers' store, its standby): as given, else the endpoint
  // itself when the store is here, else the address of this machine on the route to the store.
  if (!o_.localAddr.empty())
    announcedAddr_ = o_.localAddr;
  else if (hostServer_)
    announcedAddr_ = o_.endpointHost;
  else
    announcedAddr_ = link_->localAddress();
  // A store at a stale endpoint (the job's store moved in a failover) sends this node to the live
  // one, or it refuses: it never forms a second round under the job's run id there.
  if (o_.storeFailover) checkStaleEndpoint(request);
  if (o_.storeFailover && !hostServer_) {
    // Ready before this node joins (its port goes into its participant entry), idle until the
    // store's host is lost and this node is the next in line.
    store::TcpStoreServerOptions so = hostOptions();
    so.host = loopbackBind(announcedAddr_);
    so.port = 0;
    // Connections that come and go before it serves (the others waiting for it) mean nothing.
    so.onEphemeralKeyLost = [this](const std::string& key) {
      if (standbyServes_.load()) onAliveKeyLost(key);
    };
    standby_ = std::make_unique<store::TcpStoreServer>(so);
    l.info("store failover: standby rendezvous store on port {}", standby_->port());
  }
}

std::string C10dRendezvous::Impl::loopbackBind(const std::string& announced) const {
  return rdzv::c10d::loopbackEndpoint(o_.endpointHost) ? announced : std::string();
}

store::TcpStoreServerOptions C10dRendezvous::Impl::hostOptions() {
  store::TcpStoreServerOptions so;
  so.ephemeralKeyPrefix = std::string("/") + kAliveKeyPrefix;
  so.onEphemeralKeyLost = [this](const std::string& key) {
    if (!redirecting_.load()) onAliveKeyLost(key);
  };
  so.debugLog = [](const std::string& m) { log("store").debug("{}", m); };
  so.replyTimeout = replyWindow(o_);
  return so;
}

void C10dRendezvous::Impl::makeExecutor(const RendezvousRequest& request) {
  rdzv::c10d::NodeInfo self;
  self.id = nodeId_;
  self.host = o_.hostname;
  self.nproc = request.localNproc;
  self.requestedRank = o_.requestedRank;
  self.addr = announcedAddr_;  // for the workers' store, if this node becomes node rank 0
  if (standby_) self.standbyPort = standby_->port();
  self.storeHost = hostServer_ != nullptr;
  rdzv::c10d::ExecutorOptions eo;
  eo.log = [](const std::string& line) { log("rendezvous").info("{}", line); };
  executor_ = std::make_unique<rdzv::c10d::Executor>(*link_, o_.settings, self, clock_, eo);
  log("rendezvous").info("node '{}' joins rendezvous '{}' at {} (nnodes {}:{}, heartbeat every {}, dead after {})",
                         self.id, o_.settings.runId, link_->where(), o_.settings.minNodes,
                         o_.settings.maxNodes, measuredSeconds(o_.settings.keepAliveInterval),
                         measuredSeconds(o_.settings.heartbeatExpiry()));
}

std::string C10dRendezvous::Impl::aliveKey(const std::string& node) const {
  return std::string(kAliveKeyPrefix) + o_.settings.runId + "/" + node;
}

void C10dRendezvous::Impl::onAliveKeyLost(const std::string& key) {
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

void C10dRendezvous::Impl::removeDropped() {
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

std::optional<RendezvousEvent> C10dRendezvous::Impl::eventFor(const rdzv::c10d::RoundAssessment& a) {
  switch (a.status) {
    case rdzv::c10d::RoundStatus::Healthy:
      return std::nullopt;
    case rdzv::c10d::RoundStatus::Closed:
      // Only a node whose job ended (it failed for good, or gave up waiting for this one at
      // its exit barrier) closes the rendezvous while others still run.
      return RendezvousEvent{RendezvousEventKind::Failed,
                             "the rendezvous was closed by another node while this node's workers ran: "
                             "the job ended there",
                             kLostPeerGrace};
    case rdzv::c10d::RoundStatus::NodesWaiting:
      // Scale up at the workers' next step boundary: SIGTERM and the full grace period.
      return RendezvousEvent{RendezvousEventKind::MembershipChanged, a.reason + ": re-forming the round",
                             std::nullopt};
    case rdzv::c10d::RoundStatus::PeerFailed:
      return RendezvousEvent{RendezvousEventKind::RemoteFailure, a.reason, std::nullopt};
    case rdzv::c10d::RoundStatus::PeerLost:
    case rdzv::c10d::RoundStatus::Removed:
    case rdzv::c10d::RoundStatus::Superseded:
      return RendezvousEvent{RendezvousEventKind::MembershipChanged, a.reason, kLostPeerGrace};
  }
  return std::nullopt;
}

[[noreturn]] void C10dRendezvous::Impl::translate() {
  try {
    throw;
  } catch (const rdzv::c10d::RendezvousTimeout& e) {
    throw RendezvousTimeout(e.what());
  } catch (const rdzv::c10d::RendezvousGracefulExit& e) {
    throw RendezvousGracefulExit(e.what());
  } catch (const rdzv::c10d::RendezvousError& e) {
    throw RendezvousError(e.what());
  } catch (const rdzv::c10d::RendezvousConfigError& e) {
    throw UsageError(e.what());
  } catch (const StoreUnreachable& e) {
    throw RendezvousError(std::string(e.what()) +
                          ": lost the rendezvous store (its ctorchrun stopped, or this node is cut off)");
  } catch (const store::StoreError& e) {
    throw RendezvousError("rendezvous store at " + o_.endpointHost + ":" + std::to_string(o_.endpointPort) +
                          ": " + e.what());
  }
}

void C10dRendezvous::Impl::armTimer(bool on) {
  itimerspec spec{};
  if (on) {
    auto ms = o_.tick.count();
    spec.it_interval.tv_sec = ms / 1000;
    spec.it_interval.tv_nsec = (ms % 1000) * 1000000;
    spec.it_value = spec.it_interval;
  }
  if (::timerfd_settime(timerFd_, 0, &spec, nullptr) != 0) throwErrno("timerfd_settime");
}

void C10dRendezvous::Impl::drain(int fd) {
  std::uint64_t v = 0;
  [[maybe_unused]] ssize_t n = ::read(fd, &v, sizeof v);
}

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
