// The store server's epoll shell: the listening socket, the event loop, accepting (bounded by descriptors and
// by the admission policy, admission.hpp) and closing connections; the rest of TcpStoreServer::Impl is in
// store_serving.cpp and store_flow_control.cpp (tcp_store_server_impl.hpp).
#include "tcp_store_server_impl.hpp"

namespace ctorch::store {

using Clock = std::chrono::steady_clock;

namespace {

std::string describeBind(const TcpStoreServerOptions& o) {
  return (o.host.empty() ? std::string("*") : o.host) + ":" + std::to_string(o.port);
}

// Creates, binds and listens; throws StoreBindError.
Fd listenOn(const TcpStoreServerOptions& o) {
  auto fail = [&](const std::string& step, int err) -> StoreBindError {
    return StoreBindError("cannot " + step + " the store on " + describeBind(o) + ": " +
                              std::strerror(err),
                          err);
  };
  auto setup = [&](int family, const sockaddr* addr, socklen_t len, bool dualStack) -> Fd {
    Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) throw fail("create a socket for", errno);
    int one = 1;
    // SO_REUSEADDR (as c10d): rebinding over TIME_WAIT is fine, a live listener still conflicts.
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (dualStack) {
      int zero = 0;
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    }
    if (::bind(fd.get(), addr, len) != 0) throw fail("bind", errno);
    if (::listen(fd.get(), SOMAXCONN) != 0) throw fail("listen on", errno);
    return fd;
  };

  if (o.host.empty()) {
    sockaddr_in6 a6{};
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = htons(o.port);
    Fd probe(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe) {
      probe = Fd();
      return setup(AF_INET6, reinterpret_cast<sockaddr*>(&a6), sizeof a6, true);
    }
    sockaddr_in a4{};
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    a4.sin_port = htons(o.port);
    return setup(AF_INET, reinterpret_cast<sockaddr*>(&a4), sizeof a4, false);
  }

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string service = std::to_string(o.port);
  int rc = ::getaddrinfo(o.host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0)
    throw StoreBindError("cannot resolve store address '" + o.host + "': " + ::gai_strerror(rc),
                         EINVAL);
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
  std::exception_ptr last;
  for (addrinfo* a = res; a; a = a->ai_next) {
    try {
      return setup(a->ai_family, a->ai_addr, a->ai_addrlen, false);
    } catch (...) {
      last = std::current_exception();
    }
  }
  std::rethrow_exception(last);
}

std::uint16_t boundPort(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) throwErrno("getsockname");
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

} // namespace

TcpStoreServer::Impl::Impl(TcpStoreServerOptions options, Fd listenFd)
    : options_(std::move(options)),
      listen_(std::move(listenFd)),
      engine_(options_.ephemeralKeyPrefix, options_.engineLimits) {
  epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
  if (!epoll_) throwErrno("epoll_create1");
  wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake_) throwErrno("eventfd");
  // Kept to be closed when accept4 fails for want of descriptors: the pending connection can
  // then be accepted and closed (else it stays pending and epoll reports it again at once).
  reserve_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  diag_ = detail::openSockDiag();
  add(listen_.get(), kListenTag, EPOLLIN);
  add(wake_.get(), kWakeTag, EPOLLIN);
  thread_ = std::thread([this] { run(); });
}

TcpStoreServer::Impl::~Impl() {
  std::uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

void TcpStoreServer::Impl::add(int fd, std::uint64_t tag, std::uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = tag;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) throwErrno("epoll_ctl(ADD)");
}

void TcpStoreServer::Impl::run() {
  epoll_event events[64];
  for (;;) {
    creditBusyPass(clockNow());
    int timeout = -1;
    if (listenDisarmed_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(rearmAt_ - Clock::now()).count();
      if (left <= 0) {
        armListen(true);
      } else {
        timeout = static_cast<int>(left);
      }
    }
    if ((options_.requestTimeout.count() > 0 && (buffered_ > 0 || handshakes_ > 0)) || suspended_) {
      const auto now = clockNow();
      if (now >= nextSweep_) {
        try {
          if (suspended_) dropSlowReaders();
          else if (options_.requestTimeout.count() > 0) dropSlowRequests();
        } catch (const std::exception& e) {
          debug(std::string("store: the deadline sweep failed: ") + e.what());
        }
        nextSweep_ = now + kSweepInterval;
        std::lock_guard<std::mutex> lock(statsMutex_);
        ++stats_.deadlineSweeps;
        stats_.lastSweep = now;
      }
      // (A clock a test holds still: a sweep is tried again every kSweepInterval of real time.)
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(nextSweep_ - now).count();
      timeout = timeout < 0 ? static_cast<int>(left) : std::min(timeout, static_cast<int>(left));
    }
    maybeResumeReading();
    if (!resumed_.empty()) timeout = 0;
    int n = ::epoll_wait(epoll_.get(), events, 64, timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      debug(std::string("store: epoll_wait failed: ") + std::strerror(errno));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.loopPasses;
    }
    wokeAt_ = clockNow();
    suspendedAtWake_ = suspendedTime(wokeAt_);
    for (int i = 0; i < n; ++i) {
      std::uint64_t tag = events[i].data.u64;
      if (tag == kWakeTag) return;  // shutting down
      // Nothing a peer sends may end this thread (std::bad_alloc included): whatever goes
      // wrong while serving one connection drops that connection.
      try {
        if (tag == kListenTag) {
          acceptAll();
        } else {
          handle(tag, events[i].events);
        }
      } catch (const std::exception& e) {
        if (tag == kListenTag)
          debug(std::string("store: accepting failed: ") + e.what());
        else
          drop(tag, std::string("store: dropping a client after an internal error: ") + e.what());
      }
    }
    maybeResumeReading();
    std::vector<std::uint64_t> resumed;
    resumed.swap(resumed_);
    for (std::uint64_t id : resumed) {
      try {
        serve(id);
      } catch (const std::exception& e) {
        drop(id, std::string("store: dropping a client after an internal error: ") + e.what());
      }
    }
  }
}

void TcpStoreServer::Impl::handle(std::uint64_t id, std::uint32_t ev) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;  // closed earlier in this batch
  Connection& c = it->second;
  if ((c.paused || c.waiting) && (ev & (EPOLLHUP | EPOLLERR)) && !(ev & EPOLLOUT)) {
    close(id);
    return;
  }
  if (!c.paused && !c.waiting && (ev & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
    if (suspended_) {
      holdBack(id, c);
    } else if (!readFrom(id)) {
      return;
    }
  }
  if (ev & EPOLLOUT) flush(id);
}

std::size_t TcpStoreServer::Impl::connectionCap() {
  if (options_.maxConnections) return options_.maxConnections;
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  return static_cast<std::size_t>(rl.rlim_cur);
}

bool TcpStoreServer::Impl::roomFor(int fd) {
  if (options_.maxConnections) return conns_.size() < options_.maxConnections;
  std::size_t limit = connectionCap();
  if (limit == SIZE_MAX) return true;
  std::size_t reserve = std::max<std::size_t>(32, limit / 8);
  // Descriptors are allocated lowest first: the number of the new one says how full the table is.
  return static_cast<std::size_t>(fd) + reserve < limit;
}

std::optional<std::uint64_t> TcpStoreServer::Impl::oldestIdle() const {
  std::uint64_t oldest = 0;
  for (const auto& [id, c] : conns_)
    if ((!c.identified || c.handshaking) && (oldest == 0 || id < oldest)) oldest = id;
  if (oldest == 0) return std::nullopt;
  return oldest;
}

std::string TcpStoreServer::Impl::peerGroup(int fd) {
  const detail::PeerOf p = detail::peerOf(fd, diag_.get());
  if (!p.local) return p.address;
  if (!p.owner) {
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.unnamedLocalPeers;
  }
  return p.owner ? "uid " + std::to_string(*p.owner) + " on this machine" : "an unknown user on this machine";
}

bool TcpStoreServer::Impl::makeRoom(const std::string& peer) {
  const auto room = admission_.makeRoom(peer, oldestIdle());
  if (!room) return false;
  if (room->fairness) debug("store: at the connection cap: " + room->why);
  close(room->victim);
  std::lock_guard<std::mutex> lock(statsMutex_);
  ++stats_.evictedConnections;
  if (room->fairness) ++stats_.fairnessEvictions;
  return true;
}

void TcpStoreServer::Impl::reject(int fd, const std::string& why) {
  ::close(fd);
  if (!rejecting_) debug("store: rejecting new connections: " + why + " (logged once per burst)");
  rejecting_ = true;
  std::lock_guard<std::mutex> lock(statsMutex_);
  ++stats_.rejectedConnections;
}

void TcpStoreServer::Impl::armListen(bool on) {
  epoll_event ev{};
  ev.events = on ? EPOLLIN : 0u;
  ev.data.u64 = kListenTag;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listen_.get(), &ev);
  listenDisarmed_ = !on;
  if (!on) rearmAt_ = Clock::now() + std::chrono::milliseconds(100);
}

void TcpStoreServer::Impl::acceptAll() {
  for (int accepted = 0; accepted < 256; ++accepted) {
    int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      const int err = errno;
      if ((err == EMFILE || err == ENFILE) && reserve_) {
        // Out of descriptors: take the pending connection with the reserve and close it, so
        // that the listening socket stops being readable for it.
        reserve_ = Fd();
        int victim = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (victim >= 0) reject(victim, std::string("accept: ") + std::strerror(err));
        reserve_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
        if (victim >= 0) continue;
      }
      // Nothing to make room with: stop listening for a moment instead of spinning.
      if (!rejecting_) debug(std::string("store: accept failed: ") + std::strerror(err) +
                             "; pausing new connections for 100 ms (logged once per burst)");
      rejecting_ = true;
      armListen(false);
      return;
    }
    std::string group = peerGroup(fd);
    if (!roomFor(fd)) {
      if (!makeRoom(group)) {
        reject(fd, "too many connections (" + std::to_string(conns_.size()) + " open, descriptor limit " +
                       std::to_string(connectionCap()) + ")");
        continue;
      }
      // Move the new connection down to the descriptor just freed, so that the table does
      // not fill up from above.
      int lower = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      ::close(fd);
      if (lower < 0) continue;
      fd = lower;
    }
    if (rejecting_) {
      std::lock_guard<std::mutex> lock(statsMutex_);
      debug("store: accepting connections again (" + std::to_string(stats_.rejectedConnections) +
            " rejected so far)");
    }
    rejecting_ = false;
    detail::setNoDelay(fd);
    detail::setDeadPeerDetection(fd);
    std::uint64_t id = nextId_++;
    Connection c{Fd(fd), protocol::RequestParser(options_.limits), {}, {}, EPOLLIN | EPOLLRDHUP, false, false, false};
    conns_.emplace(id, std::move(c));
    admission_.opened(id, group);
    add(fd, id, EPOLLIN | EPOLLRDHUP);
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.connections;
  }
}

void TcpStoreServer::Impl::drop(std::uint64_t id, const std::string& why) {
  if (!conns_.count(id)) return;
  debug(why);
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.protocolErrors;
    ++stats_.droppedConnections;
  }
  close(id);
}

void TcpStoreServer::Impl::close(std::uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second.fd.get(), nullptr);
  // Closed on return, once the stats say what the peer will then see.
  Fd fd = std::move(it->second.fd);
  bufferedIn_ -= it->second.heldIn;
  bufferedOut_ -= it->second.heldOut;
  buffered_ = bufferedIn_ + bufferedOut_;
  setHandshaking(it->second, false);
  admission_.closed(id);
  const bool side = it->second.side;
  conns_.erase(it);
  if (side) {
    std::vector<SideProtocol::Output> out;
    options_.side->closed(id, out);
    queueSide(out);
  } else {
    std::vector<StoreEngine::Reply> replies;
    auto lost = engine_.disconnect(id, &replies);
    ephemeral_.store(engine_.ephemeralKeyCount());
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      stats_.storedBytes = engine_.storedBytes();
      stats_.bufferedBytes = buffered_;
    }
    noteStored();
    queue(0, replies);
    for (const auto& key : lost) {
      debug("store: ephemeral key '" + key + "' removed: its connection closed");
      if (options_.onEphemeralKeyLost) options_.onEphemeralKeyLost(key);
    }
    flushTouched();
  }
  // Last: a test that sees the count knows what the close did (keys lost, the side told).
  std::lock_guard<std::mutex> lock(statsMutex_);
  ++stats_.closedConnections;
}


TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options) {
  // Without it a client that never reads would hold every other client's requests back for ever.
  if (options.replyTimeout.count() <= 0)
    throw std::invalid_argument("TcpStoreServerOptions::replyTimeout must be positive, not " +
                                std::to_string(options.replyTimeout.count()) + " ms");
  Fd fd = listenOn(options);
  port_ = boundPort(fd.get());
  impl_ = std::make_unique<Impl>(std::move(options), std::move(fd));
}

TcpStoreServer::~TcpStoreServer() = default;

TcpStoreServerStats TcpStoreServer::stats() const { return impl_->stats(); }

std::size_t TcpStoreServer::ephemeralKeyCount() const { return impl_->ephemeralKeyCount(); }

} // namespace ctorch::store
