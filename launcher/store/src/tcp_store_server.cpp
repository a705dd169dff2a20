#include "ctorch/store/tcp_store_server.hpp"

#include "ctorch/store/store_engine.hpp"
#include "admission.hpp"
#include "socket_util.hpp"

#include <arpa/inet.h>
#include <malloc.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>
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
// Bytes read from one connection per readiness event before the others get their turn (the
// epoll interest is level-triggered: the rest is read at the next round).
constexpr std::size_t kReadBudget = 4 * kReadChunk;
// How often connections are checked against the request deadline while some request is in
// progress (a slow client is dropped at most this late).
constexpr std::chrono::milliseconds kSweepInterval{100};
// A pass over one batch of events that takes longer than this is the server being busy, not its
// clients being slow: the excess does not count against their request deadlines.
constexpr std::chrono::milliseconds kAttentivePass = kSweepInterval;
// Bytes read from a connection whose request looks late before judging it: all its socket holds,
// up to this much (a client with more than this waiting is sending fast, not late).
constexpr std::size_t kDrainBudget = 64 * kReadChunk;
// The store gives memory back (noteStored) once what it holds has fallen this far below the most
// it held since it last did (one pass over what is left per this many bytes deleted), or by more
// than half and at least an eighth of this (the store emptied: what went after the last pass too).
constexpr std::size_t kGiveBackStep = 8u << 20;

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
  using Clock = std::chrono::steady_clock;

  struct Connection {
    Fd fd;
    protocol::RequestParser parser;
    protocol::Bytes in;         // bytes not taken by the parser yet (at most one incomplete field)
    protocol::Bytes out;
    std::uint32_t events = 0;   // the epoll interest set now
    bool paused = false;        // not read nor served: too much unsent output
    bool identified = false;    // has sent a complete request
    bool side = false;          // served by options_.side (its first bytes were the side magic)
    bool handshaking = false;   // side magic begun or handshake not done: counted in handshakes_
    bool waiting = false;       // not read while reading is suspended (in `waiting_`)
    std::size_t heldIn = 0;     // request bytes not served yet (in `bufferedIn_`)
    std::size_t heldOut = 0;    // reply bytes not sent (in `bufferedOut_`)
    // When the request in progress began (its first byte, or the end of the one before it in
    // the same read); the epoch when none is in progress. With the server's away time then.
    std::chrono::steady_clock::time_point requestStart{};
    std::chrono::steady_clock::duration awayAtRequestStart{};
    // The reply clock's current window (replyWindowOver): when it began (output queued into an empty
    // buffer, reading suspended, or the previous window passed); the epoch when nothing is held.
    // With the server's busy time then, the bytes taken since, and what it must take in it.
    std::chrono::steady_clock::time_point replyStart{};
    std::chrono::steady_clock::duration busyAtReplyStart{};
    std::size_t replyTaken = 0;
    std::size_t replyQuota = 0;
    // When it last took reply bytes (or its output began, into an empty buffer), with the server's
    // busy time then: one that takes none for a whole replyTimeout while reading is suspended is
    // dropped at once, not after a window that began only when the suspension did (stalledReader).
    std::chrono::steady_clock::time_point lastTaken{};
    std::chrono::steady_clock::duration busyAtLastTaken{};
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

  // The deadlines' clock (TcpStoreServerOptions::clock). Pausing the listening socket is not a
  // deadline: it runs on the steady clock whatever the deadlines' clock says.
  Clock::time_point clockNow() const { return options_.clock ? options_.clock() : Clock::now(); }

  void run() {
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

  void handle(std::uint64_t id, std::uint32_t ev) {
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

  // ---- accepting: bounded by descriptors and by maxConnections ----------------------------------
  std::size_t connectionCap() {
    if (options_.maxConnections) return options_.maxConnections;
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
    return static_cast<std::size_t>(rl.rlim_cur);
  }

  // Whether a just-accepted connection (descriptor `fd`) leaves the process enough descriptors.
  bool roomFor(int fd) {
    if (options_.maxConnections) return conns_.size() < options_.maxConnections;
    std::size_t limit = connectionCap();
    if (limit == SIZE_MAX) return true;
    std::size_t reserve = std::max<std::size_t>(32, limit / 8);
    // Descriptors are allocated lowest first: the number of the new one says how full the table is.
    return static_cast<std::size_t>(fd) + reserve < limit;
  }

  // The oldest connection that has sent no complete request yet, or not finished its side-protocol
  // handshake.
  std::optional<std::uint64_t> oldestIdle() const {
    std::uint64_t oldest = 0;
    for (const auto& [id, c] : conns_)
      if ((!c.identified || c.handshaking) && (oldest == 0 || id < oldest)) oldest = id;
    if (oldest == 0) return std::nullopt;
    return oldest;
  }

  // Who holds a connection, for fairness at the cap (issue 58.2: an outsider who held the cap
  // kept every replacement worker out): a peer on another machine is its address; one on this
  // machine is the Unix user that owns its socket (the kernel says, through sock_diag), whatever
  // loopback address it uses - a second user cannot pass for the job's.
  std::string peerGroup(int fd) {
    const detail::PeerOf p = detail::peerOf(fd, diag_.get());
    if (!p.local) return p.address;
    if (!p.owner) {
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.unnamedLocalPeers;
    }
    return p.owner ? "uid " + std::to_string(*p.owner) + " on this machine" : "an unknown user on this machine";
  }

  // No room for a new connection of `peer`: closes the one the admission policy names; false if none.
  bool makeRoom(const std::string& peer) {
    const auto room = admission_.makeRoom(peer, oldestIdle());
    if (!room) return false;
    if (room->fairness) debug("store: at the connection cap: " + room->why);
    close(room->victim);
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.evictedConnections;
    if (room->fairness) ++stats_.fairnessEvictions;
    return true;
  }

  void reject(int fd, const std::string& why) {
    ::close(fd);
    if (!rejecting_) debug("store: rejecting new connections: " + why + " (logged once per burst)");
    rejecting_ = true;
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.rejectedConnections;
  }

  void armListen(bool on) {
    epoll_event ev{};
    ev.events = on ? EPOLLIN : 0u;
    ev.data.u64 = kListenTag;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, listen_.get(), &ev);
    listenDisarmed_ = !on;
    if (!on) rearmAt_ = Clock::now() + std::chrono::milliseconds(100);
  }

  void acceptAll() {
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

  // ---- reading and serving ----------------------------------------------------------------------
  // Reads what is available (up to `budget`) and serves every complete request. False if the
  // connection closed. `drained`, if given, is set when the socket was left empty.
  bool readFrom(std::uint64_t id, std::size_t budget = kReadBudget, bool* drained = nullptr) {
    Connection& c = conns_.at(id);
    std::size_t got = 0;
    while (got < budget) {
      // Into the one scratch buffer, then only what arrived is appended: growing `in` by a chunk
      // per read zero-filled 64 KiB for every byte a dripping client sent (most of the server's
      // time under 900 such clients).
      ssize_t n = ::recv(c.fd.get(), scratch_.data(), scratch_.size(), 0);
      if (n > 0) {
        c.in.insert(c.in.end(), scratch_.data(), scratch_.data() + n);
        got += static_cast<std::size_t>(n);
        if (static_cast<std::size_t>(n) < scratch_.size()) {
          if (drained) *drained = true;
          break;
        }
        continue;
      }
      if (n == 0) {
        serve(id);  // requests that arrived just before the close still count (SET then exit)
        close(id);
        return false;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (drained) *drained = true;
        break;
      }
      close(id);
      return false;
    }
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      stats_.bytesReceived += got;
    }
    return serve(id);
  }

  // Feeds the parser what arrived and runs each complete request, until the input is used up or
  // the connection has more unsent output than it may (then it is paused until it reads). The
  // parser takes whole fields and keeps the request built so far, so `in` only ever holds an
  // incomplete field and what follows it: nothing is parsed twice however slowly a request drips.
  bool serve(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return false;
    Connection& c = it->second;
    if (options_.side && !c.identified) {
      // The side protocol's magic, whole or begun, before any c10d request: its connection.
      const std::string_view magic = options_.side->magic();
      const std::size_t n = std::min(c.in.size(), magic.size());
      if (n > 0 && std::memcmp(c.in.data(), magic.data(), n) == 0) {
        if (n < magic.size()) {  // the rest of the magic is still on its way, under the request deadline
          if (c.requestStart == Clock::time_point{}) startRequestClock(c);
          setHandshaking(c, true);
          return true;
        }
        c.side = c.identified = true;
        std::lock_guard<std::mutex> lock(statsMutex_);
        ++stats_.sideConnections;
      } else {
        setHandshaking(c, false);  // a begun magic that turned out to be a c10d request
      }
    }
    if (c.side) return serveSide(id, c);
    std::size_t offset = 0;
    std::string failure;
    const std::uint64_t examinedBefore = c.parser.bytesExamined();
    std::uint64_t served = 0;
    while (offset < c.in.size()) {
      if (c.out.size() >= options_.maxPendingOutput) {
        c.paused = true;
        break;
      }
      // Past the cap no request is served (its reply would add to what is held) until the
      // replies are taken: checked per request, so one batch goes past by one reply at most.
      if (suspended_ || buffered_ > options_.maxBufferedBytes) {
        suspendReading();
        holdBack(id, c);
        break;
      }
      Generation before = c.parser.generation();
      ParseResult r = c.parser.feed(c.in.data() + offset, c.in.size() - offset);
      offset += r.consumed;
      if (r.status == ParseResult::Status::NeedMore) break;
      if (r.status == ParseResult::Status::Error) {
        failure = r.error;
        break;
      }
      if (before == Generation::Unknown) countGeneration(c.parser.generation());
      c.identified = true;
      std::vector<StoreEngine::Reply> replies;
      try {
        engine_.execute(id, r.request, replies);
      } catch (const std::exception& e) {
        failure = e.what();
        break;
      }
      ++served;
      queue(id, replies);
    }
    c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(offset));
    // A large field, once taken, leaves its capacity behind: give it back, or every connection
    // that ever sent a large value would keep holding that much.
    if (c.in.capacity() > 2 * c.in.size() + kReadBudget) c.in = protocol::Bytes(c.in.begin(), c.in.end());
    if (pendingInput(c) == 0) {
      c.requestStart = {};
    } else if (served > 0 || c.requestStart == Clock::time_point{}) {
      startRequestClock(c);
    }
    account(c);
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      stats_.requests += served;
      stats_.bytesParsed += c.parser.bytesExamined() - examinedBefore;
      stats_.storedBytes = engine_.storedBytes();
    }
    noteStored();
    ephemeral_.store(engine_.ephemeralKeyCount());
    if (!failure.empty()) {
      drop(id, "store: dropping a client: " + failure);
    } else {
      flush(id);
    }
    flushTouched();
    if (bufferedIn_ > options_.maxBufferedBytes) dropLargestRequests();
    return conns_.count(id) > 0;
  }

  // Keeps the most the store held since memory was last given back; gives it back once the store
  // holds kGiveBackStep less than that, or less than half of it (keys deleted, values overwritten
  // by smaller ones, ephemeral keys gone with their connections). Freed memory stays in the
  // process otherwise: glibc returns a heap's free pages only above its last chunk in use, and the
  // tables' buckets, grown late, sit there (filled to its cap and emptied five times, ctorchrun
  // kept 18 MB, issue 58.5).
  void noteStored() {
    const std::size_t now = engine_.storedBytes();
    if (now > storedPeak_) storedPeak_ = now;
    const std::size_t freed = storedPeak_ - now;
    if (freed < kGiveBackStep && !(freed >= kGiveBackStep / 8 && now < freed)) return;
    storedPeak_ = now;
    engine_.compact();
    ::malloc_trim(0);
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.memoryGivenBack;
  }

  // A side-protocol connection's bytes go to the handler as they arrive (it keeps what it needs).
  // Until the handler says the connection is established (its handshake done), the request
  // deadline runs: a stranger who opens side connections and never finishes is dropped like a
  // dripping c10d client.
  bool serveSide(std::uint64_t id, Connection& c) {
    std::vector<SideProtocol::Output> out;
    const std::string_view bytes(reinterpret_cast<const char*>(c.in.data()), c.in.size());
    bool established = false;
    try {
      established = options_.side->received(id, bytes, out);
    } catch (const std::exception& e) {
      c.in.clear();
      queueSide(out);
      drop(id, std::string("store: dropping a side-protocol client: ") + e.what());
      return false;
    }
    c.in.clear();
    if (established) c.requestStart = {};
    else if (c.requestStart == Clock::time_point{}) startRequestClock(c);
    setHandshaking(c, !established);
    account(c);
    queueSide(out);
    return conns_.count(id) > 0;
  }

  void queueSide(std::vector<SideProtocol::Output>& out) {
    std::vector<std::uint64_t> closing;
    for (auto& o : out) {
      auto it = conns_.find(o.conn);
      if (it == conns_.end() || !it->second.side) continue;
      Connection& c = it->second;
      if (c.out.size() + o.bytes.size() > options_.maxPendingOutput) {
        overflowing_.push_back(o.conn);
        continue;
      }
      const bool first = c.out.empty();
      c.out.insert(c.out.end(), o.bytes.begin(), o.bytes.end());
      if (first) {
        startReplyClock(c, clockNow());
        noteTaken(c, c.replyStart);
      }
      notePending(c.out.size());
      account(c);
      touched_.push_back(o.conn);
      if (o.close) closing.push_back(o.conn);
    }
    flushTouched();
    for (std::uint64_t id : closing) close(id);
  }

  // A side-protocol connection whose handshake runs holds no bytes here (the handler keeps them),
  // so `buffered_` cannot tell the sweep that its deadline runs: handshakes_ counts them.
  void setHandshaking(Connection& c, bool on) {
    if (c.handshaking == on) return;
    c.handshaking = on;
    if (on) ++handshakes_;
    else --handshakes_;
  }

  static std::size_t pendingInput(const Connection& c) { return c.parser.partialLength() + c.in.size(); }

  // Brings `buffered_` up to date with what `c` holds now.
  void account(Connection& c) {
    const std::size_t in = pendingInput(c), out = c.out.size();
    bufferedIn_ = bufferedIn_ - c.heldIn + in;
    bufferedOut_ = bufferedOut_ - c.heldOut + out;
    c.heldIn = in;
    c.heldOut = out;
    buffered_ = bufferedIn_ + bufferedOut_;
    std::lock_guard<std::mutex> lock(statsMutex_);
    stats_.bufferedBytes = buffered_;
    stats_.peakBufferedBytes = std::max<std::uint64_t>(stats_.peakBufferedBytes, buffered_);
  }

  // Starts a window of the reply clock (replyWindowOver): as output is queued into an empty buffer,
  // for every holder when reading is suspended, and when a window has passed.
  void startReplyClock(Connection& c, Clock::time_point now) {
    c.replyStart = now;
    c.busyAtReplyStart = busyTime_;
    c.replyTaken = 0;
    const double perWindow = static_cast<double>(options_.minReplyRate) *
                             std::chrono::duration<double>(options_.replyTimeout).count();
    c.replyQuota = std::max<std::size_t>(1, std::min(c.out.size(), static_cast<std::size_t>(perWindow)));
  }

  // ---- the server's own time: not charged to its clients ---------------------------------------
  // Time spent with reading suspended, up to `now`.
  Clock::duration suspendedTime(Clock::time_point now) const {
    return suspendedTotal_ + (suspended_ ? now - suspendedSince_ : Clock::duration::zero());
  }
  // Time the server was not listening to its clients: suspended, or busy beyond kAttentivePass
  // in one pass over its events. A client's request deadline does not run meanwhile.
  Clock::duration awayTime(Clock::time_point now) const { return busyTime_ + suspendedTime(now); }

  // Called once per loop, before the next epoll_wait: the pass that began at wokeAt_ took
  // `now - wokeAt_`; what it took beyond kAttentivePass (not already counted as suspended) was
  // the server's delay, not its clients'.
  void creditBusyPass(Clock::time_point now) {
    if (wokeAt_ == Clock::time_point{}) return;
    const auto busy = (now - wokeAt_) - (suspendedTime(now) - suspendedAtWake_);
    if (busy > kAttentivePass) busyTime_ += busy - std::chrono::duration_cast<Clock::duration>(kAttentivePass);
    wokeAt_ = {};
  }

  void startRequestClock(Connection& c) {
    c.requestStart = clockNow();
    c.awayAtRequestStart = awayTime(c.requestStart);
  }

  // ---- backpressure past maxBufferedBytes -------------------------------------------------------
  // Each holder's reply clock starts again now, counting what it takes from here: a reader is
  // judged by what it takes while the others wait, not by what the socket buffers took before.
  void suspendReading() {
    if (suspended_) return;
    suspended_ = true;
    suspendedSince_ = clockNow();
    for (auto& entry : conns_)
      if (!entry.second.out.empty()) startReplyClock(entry.second, suspendedSince_);
    debug("store: reading suspended: the server holds " + std::to_string(buffered_) + " bytes (" +
          std::to_string(bufferedOut_) + " of replies not taken yet), more than maxBufferedBytes (" +
          std::to_string(options_.maxBufferedBytes) + ")");
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.readSuspensions;
  }

  // Stops reading `c` until reading resumes (its requests wait in its socket).
  void holdBack(std::uint64_t id, Connection& c) {
    if (c.waiting) return;
    c.waiting = true;
    waiting_.push_back(id);
    updateInterest(c, id);
  }

  // Reading resumes once the replies held are down to half the cap (not at once below it, so that
  // every connection is not held back and released again for each reply taken).
  void maybeResumeReading() {
    if (!suspended_ || bufferedOut_ > options_.maxBufferedBytes / 2 || buffered_ > options_.maxBufferedBytes) return;
    const auto now = clockNow();
    suspendedTotal_ += now - suspendedSince_;
    suspended_ = false;
    std::vector<std::uint64_t> waiting;
    waiting.swap(waiting_);
    for (std::uint64_t id : waiting) {
      auto it = conns_.find(id);
      if (it == conns_.end() || !it->second.waiting) continue;
      it->second.waiting = false;
      updateInterest(it->second, id);
      if (!it->second.in.empty()) resumed_.push_back(id);
    }
  }

  // Past maxBufferedBytes with requests alone, drops the connection holding the largest one until
  // under it: a well-behaved client's requests are served as they arrive, so it holds little; the
  // largest holder is the one building the largest request. (Suspending reading would not help:
  // an unfinished request is finished only by reading more of it.)
  void dropLargestRequests() {
    while (bufferedIn_ > options_.maxBufferedBytes) {
      auto largest = std::max_element(conns_.begin(), conns_.end(),
                                      [](const auto& a, const auto& b) { return a.second.heldIn < b.second.heldIn; });
      if (largest == conns_.end() || largest->second.heldIn == 0) return;
      drop(largest->first, "store: dropping a client holding " + std::to_string(largest->second.heldIn) +
                               " bytes of unfinished requests: the server holds " + std::to_string(bufferedIn_) +
                               " bytes of requests over all connections, more than maxBufferedBytes (" +
                               std::to_string(options_.maxBufferedBytes) + ")");
    }
  }

  Clock::duration allowedFor(const Connection& c) const {
    auto allowed = std::chrono::duration_cast<Clock::duration>(options_.requestTimeout);
    if (options_.minRequestRate > 0)
      allowed += std::chrono::milliseconds(pendingInput(c) * 1000 / options_.minRequestRate);
    return allowed;
  }
  bool requestLate(const Connection& c, Clock::time_point now) const {
    if (c.requestStart == Clock::time_point{} || c.paused || c.waiting) return false;
    return (now - c.requestStart) - (awayTime(now) - c.awayAtRequestStart) > allowedFor(c);
  }

  // Drops the connections whose request in progress has taken longer than requestTimeout plus one
  // second per minRequestRate bytes of it received (a client dripping bytes, or stopped
  // mid-request). Paused connections are not read, so their clock does not run; nor does anyone's
  // while reading is suspended or the server is busy (awayTime). A request that looks late is
  // judged only after its socket has been read: what arrived while the server was not looking
  // counts (a request complete in the socket is served, not dropped).
  void dropSlowRequests() {
    auto now = clockNow();
    std::vector<std::uint64_t> late;
    for (const auto& [id, c] : conns_)
      if (requestLate(c, now)) late.push_back(id);
    if (late.empty()) return;
    std::vector<std::uint64_t> slow;
    for (std::uint64_t id : late) {
      if (suspended_) break;  // reading stopped meanwhile: clocks stopped too, judged after it resumes
      if (!conns_.count(id)) continue;
      bool drained = false;
      if (!readFrom(id, kDrainBudget, &drained)) continue;
      auto it = conns_.find(id);
      if (it == conns_.end() || !drained) continue;  // not drained: bytes still pouring in
      if (requestLate(it->second, clockNow())) slow.push_back(id);
    }
    if (slow.empty()) return;
    debug("store: dropping " + std::to_string(slow.size()) + " client(s) whose request took longer than requestTimeout (" +
          std::to_string(options_.requestTimeout.count()) + " ms) plus 1 s per minRequestRate (" +
          std::to_string(options_.minRequestRate) + ") bytes received");
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      stats_.timedOutConnections += slow.size();
      stats_.droppedConnections += slow.size();
    }
    for (std::uint64_t id : slow) close(id);
  }

  // Whether `c`'s current reply window (replyTimeout long, not counting the server's busy time)
  // has passed; `late` if it took less than its quota meanwhile (minReplyRate x replyTimeout, or
  // all it held when the window began). What a socket's buffers take counts as taken, so a client
  // that never reads passes one window at most, while they fill.
  bool replyWindowOver(const Connection& c, Clock::time_point now, bool& late) const {
    late = false;
    if (c.out.empty()) return false;
    if ((now - c.replyStart) - (busyTime_ - c.busyAtReplyStart) < options_.replyTimeout) return false;
    late = c.replyTaken < c.replyQuota;
    return true;
  }

  void noteTaken(Connection& c, Clock::time_point now) {
    c.lastTaken = now;
    c.busyAtLastTaken = busyTime_;
  }

  // Whether `c` holds replies and has taken none of them for replyTimeout (the server's busy time
  // not counted), however long ago that began: its socket is full and it does not read.
  bool stalledReader(const Connection& c, Clock::time_point now) const {
    return !c.out.empty() && (now - c.lastTaken) - (busyTime_ - c.busyAtLastTaken) >= options_.replyTimeout;
  }

  // While reading is suspended, drops the connections that take their replies slower than
  // minReplyRate over a window of replyTimeout, or none at all for replyTimeout (one that never
  // reads, whose socket filled before the suspension began: it goes at the first sweep, not a
  // window or two later, issue 58.1): the suspension lasts until the replies are taken, and every
  // client waits meanwhile. A connection that reads, however much it holds, is never dropped for
  // it. Each is tried once more before (the server may not have written to it for a while).
  void dropSlowReaders() {
    const auto now = clockNow();
    std::vector<std::uint64_t> late;
    for (auto& [id, c] : conns_) {
      bool slow = false;
      if (stalledReader(c, now)) {
        late.push_back(id);
        continue;
      }
      if (!replyWindowOver(c, now, slow)) continue;
      if (slow) late.push_back(id);
      else startReplyClock(c, now);
    }
    for (std::uint64_t id : late) {
      flush(id);
      auto it = conns_.find(id);
      if (it == conns_.end() || it->second.out.empty()) continue;
      const auto then = clockNow();
      const bool stalled = stalledReader(it->second, then);
      bool slow = false;
      if (!stalled && !(replyWindowOver(it->second, then, slow) && slow)) continue;
      {
        std::lock_guard<std::mutex> lock(statsMutex_);
        ++stats_.slowReaders;
      }
      drop(id, "store: dropping a client that takes its replies slower than minReplyRate (" +
                   std::to_string(options_.minReplyRate) + " bytes/s) over replyTimeout (" +
                   std::to_string(options_.replyTimeout.count()) + " ms) while reading is suspended (" +
                   std::to_string(it->second.out.size()) + " bytes unsent" +
                   (stalled ? ", none taken for replyTimeout" : "") + "; the server holds " +
                   std::to_string(buffered_) + ", more than maxBufferedBytes (" +
                   std::to_string(options_.maxBufferedBytes) + "))");
    }
  }

  // Appends replies to their connections' output (sent by flush/flushTouched). Output pushed to
  // a connection other than the requester (a watch notification, a wake-up) that takes it past
  // maxPendingOutput drops that connection: it does not read what it asked to be told.
  void queue(std::uint64_t requester, std::vector<StoreEngine::Reply>& replies) {
    for (auto& r : replies) {
      auto it = conns_.find(r.conn);
      if (it == conns_.end()) continue;
      Connection& c = it->second;
      if (r.conn != requester && c.out.size() + r.bytes.size() > options_.maxPendingOutput) {
        overflowing_.push_back(r.conn);
        continue;
      }
      if (c.out.empty()) {
        c.out = std::move(r.bytes);
        startReplyClock(c, clockNow());
        noteTaken(c, c.replyStart);
      } else {
        c.out.insert(c.out.end(), r.bytes.begin(), r.bytes.end());
      }
      account(c);
      notePending(c.out.size());
      if (r.conn != requester) touched_.push_back(r.conn);
    }
  }

  void flushTouched() {
    std::vector<std::uint64_t> overflowing;
    overflowing.swap(overflowing_);
    for (std::uint64_t id : overflowing)
      drop(id, "store: dropping a client that does not read its notifications (over " +
                   std::to_string(options_.maxPendingOutput) + " bytes unsent)");
    std::vector<std::uint64_t> touched;
    touched.swap(touched_);
    for (std::uint64_t id : touched) flush(id);
  }

  void notePending(std::size_t n) {
    std::lock_guard<std::mutex> lock(statsMutex_);
    stats_.peakPendingOutput = std::max<std::uint64_t>(stats_.peakPendingOutput, n);
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
    if (sent > 0) {
      c.replyTaken += sent;
      noteTaken(c, clockNow());
      if (c.out.empty()) {
        c.replyStart = {};
        // A large reply, once sent, leaves its capacity behind (as a large request does in `in`).
        if (c.out.capacity() > kReadBudget) protocol::Bytes().swap(c.out);
      }
      account(c);
    }
    if (c.paused && c.out.size() <= options_.maxPendingOutput / 2) {
      // Drained enough: read again, and serve what it sent meanwhile (after this round of events,
      // not from here: serving may fill the output and flush again). Its request clock restarts.
      c.paused = false;
      if (c.requestStart != Clock::time_point{}) startRequestClock(c);
      if (!c.in.empty()) resumed_.push_back(id);
    }
    updateInterest(c, id);
  }

  // Paused connections are not read (nor watched for a half-close, which would be reported
  // again and again); hang-ups and errors are reported whatever the interest set.
  void updateInterest(Connection& c, std::uint64_t id) {
    std::uint32_t want = (c.paused || c.waiting ? 0u : (EPOLLIN | EPOLLRDHUP)) | (c.out.empty() ? 0u : EPOLLOUT);
    if (want == c.events) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = id;
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
    c.events = want;
  }

  void drop(std::uint64_t id, const std::string& why) {
    if (!conns_.count(id)) return;
    debug(why);
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.protocolErrors;
      ++stats_.droppedConnections;
    }
    close(id);
  }

  void close(std::uint64_t id) {
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

  void countGeneration(Generation g) {
    std::lock_guard<std::mutex> lock(statsMutex_);
    if (g == Generation::Legacy) ++stats_.legacyConnections;
    if (g == Generation::Validated) ++stats_.validatedConnections;
  }

  TcpStoreServerOptions options_;
  Fd listen_;
  Fd epoll_;
  Fd wake_;
  Fd reserve_;
  Fd diag_;  // sock_diag: who owns a local peer's socket (invalid: nobody to ask)
  detail::Admission admission_;  // who holds the connections; who makes room at the cap
  bool rejecting_ = false;       // in a burst of refused connections (logged once)
  bool listenDisarmed_ = false;  // accept4 failed with nothing to make room: retry at rearmAt_
  Clock::time_point rearmAt_{};
  Clock::time_point nextSweep_{};  // for requests slower than requestTimeout
  Clock::time_point wokeAt_{};     // when the current pass over events began (epoch: none)
  Clock::duration suspendedAtWake_{};
  Clock::duration busyTime_{};     // passes' time beyond kAttentivePass, summed
  bool suspended_ = false;         // reading stopped: past maxBufferedBytes
  Clock::time_point suspendedSince_{};
  Clock::duration suspendedTotal_{};  // of the suspensions that ended
  StoreEngine engine_;
  std::size_t storedPeak_ = 0;     // the most the engine held since memory was last given back
  std::atomic<std::size_t> ephemeral_{0};
  std::size_t buffered_ = 0;     // bufferedIn_ + bufferedOut_
  std::size_t bufferedIn_ = 0;   // the sum of every connection's `heldIn`
  std::size_t bufferedOut_ = 0;  // the sum of every connection's `heldOut`
  std::size_t handshakes_ = 0;  // connections whose `handshaking` is set
  protocol::Bytes scratch_ = protocol::Bytes(kReadChunk);  // what one recv may bring
  std::unordered_map<std::uint64_t, Connection> conns_;
  std::vector<std::uint64_t> touched_;      // connections given output by another's request
  std::vector<std::uint64_t> overflowing_;  // connections to drop once the current step is done
  std::vector<std::uint64_t> resumed_;      // unpaused connections with requests still buffered
  std::vector<std::uint64_t> waiting_;      // connections held back while reading is suspended
  std::uint64_t nextId_ = kFirstConn;
  mutable std::mutex statsMutex_;
  TcpStoreServerStats stats_;
  std::thread thread_;
};

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
