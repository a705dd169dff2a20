#include "socket_util.hpp"

#include "ctorch/store/store.hpp"

#include <arpa/inet.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace ctorch::store::detail {

void throwErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

void setNonBlocking(int fd) {
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) throwErrno("fcntl(O_NONBLOCK)");
}

void setNoDelay(int fd) {
  int one = 1;
  // Requests are small and latency-bound (c10d sets TCP_NODELAY too); failure is harmless.
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void setDeadPeerDetection(int fd) {
  // Keepalive probes after 2 s of silence, every 1 s, 3 unanswered: ~5 s. A live peer's kernel
  // answers them even when the process is stopped or busy, so only a vanished peer is dropped.
  // TCP_USER_TIMEOUT bounds the same while data is unacknowledged (keepalive is off then).
  int one = 1, idle = 2, interval = 1, count = 3;
  unsigned int userTimeoutMs = 6000;
  (void)::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &userTimeoutMs, sizeof userTimeoutMs);
}

namespace {

int remainingMs(std::chrono::steady_clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                    std::chrono::steady_clock::now());
  if (left.count() <= 0) return 0;
  return left.count() > 1000000000 ? 1000000000 : static_cast<int>(left.count());
}

} // namespace

bool waitReadable(int fd, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, remainingMs(deadline));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) throwErrno("poll");
  }
}

Fd connectTo(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0)
    throw StoreConnectionError("cannot resolve store host '" + host + "': " + ::gai_strerror(rc));
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int lastErr = ECONNREFUSED;
  Fd result;
  for (addrinfo* a = res; a && !result; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!fd) {
      lastErr = errno;
      continue;
    }
    if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        lastErr = errno;
        continue;
      }
      pollfd p{fd.get(), POLLOUT, 0};
      int r;
      do {
        r = ::poll(&p, 1, remainingMs(deadline));
      } while (r < 0 && errno == EINTR);
      if (r <= 0) {
        lastErr = r == 0 ? ETIMEDOUT : errno;
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        lastErr = err;
        continue;
      }
    }
    int flags = ::fcntl(fd.get(), F_GETFL);
    ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    setNoDelay(fd.get());
    result = std::move(fd);
  }
  ::freeaddrinfo(res);
  if (!result) {
    errno = lastErr;
    throwErrno("connect to " + host + ":" + service);
  }
  return result;
}

std::string localAddressOf(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) throwErrno("getsockname");
  char buf[INET6_ADDRSTRLEN] = {0};
  if (ss.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof buf);
    return buf;
  }
  const auto* a6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
    in_addr a4{};
    std::memcpy(&a4, a6->sin6_addr.s6_addr + 12, sizeof a4);
    ::inet_ntop(AF_INET, &a4, buf, sizeof buf);
    return buf;
  }
  ::inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof buf);
  return buf;
}

namespace {

// An address as sock_diag takes it: the family (IPv4-mapped IPv6 given as IPv4), the address in
// network byte order (IPv4 in the first word), the port in host order.
struct Endpoint {
  int family = 0;
  std::array<std::uint32_t, 4> addr{};
  std::uint16_t port = 0;
};

std::optional<Endpoint> endpointOf(const sockaddr_storage& ss) {
  Endpoint e;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    e.family = AF_INET;
    std::memcpy(e.addr.data(), &a->sin_addr, 4);
    e.port = ntohs(a->sin_port);
    return e;
  }
  if (ss.ss_family != AF_INET6) return std::nullopt;
  const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
  e.port = ntohs(a->sin6_port);
  if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr)) {
    e.family = AF_INET;
    std::memcpy(e.addr.data(), a->sin6_addr.s6_addr + 12, 4);
  } else {
    e.family = AF_INET6;
    std::memcpy(e.addr.data(), a->sin6_addr.s6_addr, 16);
  }
  return e;
}

std::string textOf(const Endpoint& e) {
  char buf[INET6_ADDRSTRLEN] = {0};
  ::inet_ntop(e.family, e.addr.data(), buf, sizeof buf);
  return buf;
}

bool loopback(const Endpoint& e) {
  const auto* b = reinterpret_cast<const std::uint8_t*>(e.addr.data());
  if (e.family == AF_INET) return b[0] == 127;
  for (int i = 0; i < 15; ++i)
    if (b[i] != 0) return false;
  return b[15] == 1;
}

// Asks sock_diag for the one socket whose source is `peer` and destination `local`: the peer's
// end of the connection, on this machine.
std::optional<std::uint32_t> ownerOf(int diagFd, const Endpoint& peer, const Endpoint& local) {
  static std::atomic<std::uint32_t> seq{0};
  struct {
    nlmsghdr nlh;
    inet_diag_req_v2 r;
  } req{};
  req.nlh.nlmsg_len = sizeof req;
  req.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.nlh.nlmsg_flags = NLM_F_REQUEST;
  req.nlh.nlmsg_seq = ++seq;
  req.r.sdiag_family = static_cast<std::uint8_t>(peer.family);
  req.r.sdiag_protocol = IPPROTO_TCP;
  req.r.idiag_states = ~0u;
  req.r.id.idiag_sport = htons(peer.port);
  req.r.id.idiag_dport = htons(local.port);
  std::memcpy(req.r.id.idiag_src, peer.addr.data(), 16);
  std::memcpy(req.r.id.idiag_dst, local.addr.data(), 16);
  req.r.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(diagFd, &req, sizeof req, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) < 0)
    return std::nullopt;
  alignas(nlmsghdr) char buf[8192];
  for (int reads = 0; reads < 4; ++reads) {
    const ssize_t got = ::recv(diagFd, buf, sizeof buf, 0);  // SO_RCVTIMEO bounds it
    if (got <= 0) return std::nullopt;
    int left = static_cast<int>(got);
    for (auto* h = reinterpret_cast<nlmsghdr*>(buf); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
      if (h->nlmsg_seq != req.nlh.nlmsg_seq) continue;  // a late answer to an earlier question
      if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(inet_diag_msg)))
        return std::nullopt;  // NLMSG_ERROR (no such socket), NLMSG_DONE, or short
      return static_cast<const inet_diag_msg*>(NLMSG_DATA(h))->idiag_uid;
    }
  }
  return std::nullopt;
}

} // namespace

PeerOf peerOf(int fd, int diagFd) {
  PeerOf out;
  sockaddr_storage peer{}, local{};
  socklen_t pl = sizeof peer, ll = sizeof local;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0)
    return out;
  const auto p = endpointOf(peer), l = endpointOf(local);
  if (!p || !l) return out;
  out.address = textOf(*p);
  // A peer on this machine: a loopback address, or this machine's own address it was reached at.
  out.local = loopback(*p) || (p->family == l->family && p->addr == l->addr);
  if (out.local && diagFd >= 0) out.owner = ownerOf(diagFd, *p, *l);
  return out;
}

Fd openSockDiag() {
  const int fd = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (fd < 0) return Fd();
  timeval tv{0, 100000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return Fd(fd);
}

void sendAll(int fd, const void* data, std::size_t size) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw StoreConnectionError(std::string("store connection lost while sending: ") +
                                 std::strerror(errno));
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

void recvAll(int fd, void* data, std::size_t size, std::chrono::steady_clock::time_point deadline) {
  auto* p = static_cast<std::uint8_t*>(data);
  while (size > 0) {
    if (!waitReadable(fd, deadline)) throw StoreTimeout("store reply timed out");
    ssize_t n = ::recv(fd, p, size, 0);
    if (n == 0) throw StoreConnectionError("store closed the connection");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw StoreConnectionError(std::string("store connection lost while receiving: ") +
                                 std::strerror(errno));
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

} // namespace ctorch::store::detail
