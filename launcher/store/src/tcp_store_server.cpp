#include "ctorch/store/tcp_store_server.hpp"

#include "ctorch/store/store_engine.hpp"
#include "socket_util.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace ctorch::store {

using detail::Fd;
using detail::throwErrno;
using protocol::Generation;
using protocol::ParseResult;

namespace {

constexpr std::uint64_t kListenTag = 0;
constexpr std::uint64_t kWakeTag = 1;
constexpr std::uint64_t kFirstConn = 2;
constexpr std::size_t kReadChunk = 64 * 1024;

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

class TcpStoreServer::Impl {
 public:
  Impl(TcpStoreServerOptions options, Fd listenFd)
      : options_(std::move(options)), listen_(std::move(listenFd)), engine_(options_.ephemeralKeyPrefix) {
    epoll_ = Fd(::epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) throwErrno("epoll_create1");
    wake_ = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!wake_) throwErrno("eventfd");
    add(listen_.get(), kListenTag, EPOLLIN);
    add(wake_.get(), kWakeTag, EPOLLIN);
    thread_ = std::thread([this] { run(); });
  }

  ~Impl() {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof one);
    if (thread_.joinable()) thread_.join();
  }

  TcpStoreServerStats stats() const {
    std::lock_guard<std::mutex> lock(statsMutex_);
    return stats_;
  }
  std::size_t ephemeralKeyCount() const { return ephemeral_.load(); }

 private:
  struct Connection {
    Fd fd;
    Generation generation = Generation::Unknown;
    protocol::Bytes in;
    protocol::Bytes out;
    bool wantWrite = false;
  };

  void add(int fd, std::uint64_t tag, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) throwErrno("epoll_ctl(ADD)");
  }

  void debug(const std::string& msg) {
    if (options_.debugLog) options_.debugLog(msg);
  }

  void run() {
    epoll_event events[64];
    for (;;) {
      int n = ::epoll_wait(epoll_.get(), events, 64, -1);
      if (n < 0) {
        if (errno == EINTR) continue;
        debug(std::string("store: epoll_wait failed: ") + std::strerror(errno));
        return;
      }
      for (int i = 0; i < n; ++i) {
        std::uint64_t tag = events[i].data.u64;
        if (tag == kWakeTag) return;  // shutting down
        if (tag == kListenTag) {
          acceptAll();
          continue;
        }
        auto it = conns_.find(tag);
        if (it == conns_.end()) continue;  // closed earlier in this batch
        std::uint32_t ev = events[i].events;
        if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
          if (!readFrom(tag)) continue;
        }
        if (ev & EPOLLOUT) flush(tag);
      }
    }
  }

  void acceptAll() {
    for (;;) {
      int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
          debug(std::string("store: accept failed: ") + std::strerror(errno));
        return;
      }
      detail::setNoDelay(fd);
      detail::setDeadPeerDetection(fd);
      std::uint64_t id = nextId_++;
      Connection c;
      c.fd = Fd(fd);
      conns_.emplace(id, std::move(c));
      add(fd, id, EPOLLIN | EPOLLRDHUP);
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.connections;
    }
  }

  // Reads what is available and serves every complete request. False if the connection closed.
  bool readFrom(std::uint64_t id) {
    Connection& c = conns_.at(id);
    for (;;) {
      std::size_t old = c.in.size();
      c.in.resize(old + kReadChunk);
      ssize_t n = ::recv(c.fd.get(), c.in.data() + old, kReadChunk, 0);
      if (n > 0) {
        c.in.resize(old + static_cast<std::size_t>(n));
        if (static_cast<std::size_t>(n) < kReadChunk) break;
        continue;
      }
      c.in.resize(old);
      if (n == 0) {
        serve(id);  // requests that arrived just before the close still count (SET then exit)
        close(id);
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      close(id);
      return false;
    }
    return serve(id);
  }

  bool serve(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return false;
    Connection& c = it->second;
    std::size_t offset = 0;
    std::vector<StoreEngine::Reply> replies;
    bool ok = true;
    while (offset < c.in.size()) {
      Generation before = c.generation;
      ParseResult r =
          protocol::parseRequest(c.generation, c.in.data() + offset, c.in.size() - offset, options_.limits);
      if (r.status == ParseResult::Status::NeedMore) break;
      if (r.status == ParseResult::Status::Error) {
        debug("store: dropping a client: " + r.error);
        countError();
        ok = false;
        break;
      }
      if (before == Generation::Unknown) countGeneration(c.generation);
      offset += r.consumed;
      try {
        engine_.execute(id, r.request, replies);
      } catch (const std::exception& e) {
        debug(std::string("store: dropping a client: ") + e.what());
        countError();
        ok = false;
        break;
      }
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.requests;
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(offset));
    ephemeral_.store(engine_.ephemeralKeyCount());
    deliver(replies);
    if (!ok) {
      close(id);
      return false;
    }
    return conns_.count(id) > 0;
  }

  void deliver(std::vector<StoreEngine::Reply>& replies) {
    for (auto& r : replies) {
      auto it = conns_.find(r.conn);
      if (it == conns_.end()) continue;
      Connection& c = it->second;
      c.out.insert(c.out.end(), r.bytes.begin(), r.bytes.end());
    }
    // Flush after queueing everything, once per connection.
    for (auto& r : replies)
      if (conns_.count(r.conn) && !conns_.at(r.conn).out.empty()) flush(r.conn);
  }

  void flush(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Connection& c = it->second;
    std::size_t sent = 0;
    while (sent < c.out.size()) {
      ssize_t n = ::send(c.fd.get(), c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      close(id);
      return;
    }
    c.out.erase(c.out.begin(), c.out.begin() + static_cast<std::ptrdiff_t>(sent));
    bool want = !c.out.empty();
    if (want != c.wantWrite) {
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP | (want ? EPOLLOUT : 0u);
      ev.data.u64 = id;
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
      c.wantWrite = want;
    }
  }

  void close(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, it->second.fd.get(), nullptr);
    conns_.erase(it);
    std::vector<StoreEngine::Reply> replies;
    auto lost = engine_.disconnect(id, &replies);
    ephemeral_.store(engine_.ephemeralKeyCount());
    deliver(replies);
    for (const auto& key : lost) {
      debug("store: ephemeral key '" + key + "' removed: its connection closed");
      if (options_.onEphemeralKeyLost) options_.onEphemeralKeyLost(key);
    }
  }

  void countGeneration(Generation g) {
    std::lock_guard<std::mutex> lock(statsMutex_);
    if (g == Generation::Legacy) ++stats_.legacyConnections;
    if (g == Generation::Validated) ++stats_.validatedConnections;
  }

  void countError() {
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.protocolErrors;
  }

  TcpStoreServerOptions options_;
  Fd listen_;
  Fd epoll_;
  Fd wake_;
  StoreEngine engine_;
  std::atomic<std::size_t> ephemeral_{0};
  std::unordered_map<std::uint64_t, Connection> conns_;
  std::uint64_t nextId_ = kFirstConn;
  mutable std::mutex statsMutex_;
  TcpStoreServerStats stats_;
  std::thread thread_;
};

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options) {
  Fd fd = listenOn(options);
  port_ = boundPort(fd.get());
  impl_ = std::make_unique<Impl>(std::move(options), std::move(fd));
}

TcpStoreServer::~TcpStoreServer() = default;

TcpStoreServerStats TcpStoreServer::stats() const { return impl_->stats(); }

std::size_t TcpStoreServer::ephemeralKeyCount() const { return impl_->ephemeralKeyCount(); }

} // namespace ctorch::store
