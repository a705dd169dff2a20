// The store server's state (TcpStoreServer::Impl), shared by the files that each hold one of its
// concerns: the epoll shell, accepting and closing (tcp_store_server.cpp), reading and serving requests
// and sending replies (store_serving.cpp), and the flow control that keeps one client from holding the
// others back - backpressure, request deadlines, reply windows (store_flow_control.cpp). Internal.
#pragma once

#include "ctorch/store/tcp_store_server.hpp"

#include "admission.hpp"
#include "ctorch/store/store_engine.hpp"
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
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace ctorch::store {

using detail::Fd;
using detail::throwErrno;
using protocol::Generation;
using protocol::ParseResult;

namespace server_limits {

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

} // namespace server_limits
using namespace server_limits;

class TcpStoreServer::Impl {
 public:
  Impl(TcpStoreServerOptions options, Fd listenFd);
  ~Impl();

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

  void add(int fd, std::uint64_t tag, std::uint32_t events);

  void debug(const std::string& msg) {
    if (options_.debugLog) options_.debugLog(msg);
  }

  // The deadlines' clock (TcpStoreServerOptions::clock). Pausing the listening socket is not a
  // deadline: it runs on the steady clock whatever the deadlines' clock says.
  Clock::time_point clockNow() const { return options_.clock ? options_.clock() : Clock::now(); }

  void run();

  void handle(std::uint64_t id, std::uint32_t ev);

  // ---- accepting: bounded by descriptors and by maxConnections ----------------------------------
  std::size_t connectionCap();

  // Whether a just-accepted connection (descriptor `fd`) leaves the process enough descriptors.
  bool roomFor(int fd);

  // The oldest connection that has sent no complete request yet, or not finished its side-protocol
  // handshake.
  std::optional<std::uint64_t> oldestIdle() const;

  // Who holds a connection, for fairness at the cap (issue 58.2: an outsider who held the cap
  // kept every replacement worker out): a peer on another machine is its address; one on this
  // machine is the Unix user that owns its socket (the kernel says, through sock_diag), whatever
  // loopback address it uses - a second user cannot pass for the job's.
  std::string peerGroup(int fd);

  // No room for a new connection of `peer`: closes the one the admission policy names; false if none.
  bool makeRoom(const std::string& peer);

  void reject(int fd, const std::string& why);

  void armListen(bool on);

  void acceptAll();

  // ---- reading and serving ----------------------------------------------------------------------
  // Reads what is available (up to `budget`) and serves every complete request. False if the
  // connection closed. `drained`, if given, is set when the socket was left empty.
  bool readFrom(std::uint64_t id, std::size_t budget = kReadBudget, bool* drained = nullptr);

  // Feeds the parser what arrived and runs each complete request, until the input is used up or
  // the connection has more unsent output than it may (then it is paused until it reads). The
  // parser takes whole fields and keeps the request built so far, so `in` only ever holds an
  // incomplete field and what follows it: nothing is parsed twice however slowly a request drips.
  bool serve(std::uint64_t id);

  // Keeps the most the store held since memory was last given back; gives it back once the store
  // holds kGiveBackStep less than that, or less than half of it (keys deleted, values overwritten
  // by smaller ones, ephemeral keys gone with their connections). Freed memory stays in the
  // process otherwise: glibc returns a heap's free pages only above its last chunk in use, and the
  // tables' buckets, grown late, sit there (filled to its cap and emptied five times, ctorchrun
  // kept 18 MB, issue 58.5).
  void noteStored();

  // A side-protocol connection's bytes go to the handler as they arrive (it keeps what it needs).
  // Until the handler says the connection is established (its handshake done), the request
  // deadline runs: a stranger who opens side connections and never finishes is dropped like a
  // dripping c10d client.
  bool serveSide(std::uint64_t id, Connection& c);

  void queueSide(std::vector<SideProtocol::Output>& out);

  // A side-protocol connection whose handshake runs holds no bytes here (the handler keeps them),
  // so `buffered_` cannot tell the sweep that its deadline runs: handshakes_ counts them.
  void setHandshaking(Connection& c, bool on);

  static std::size_t pendingInput(const Connection& c) { return c.parser.partialLength() + c.in.size(); }

  // Brings `buffered_` up to date with what `c` holds now.
  void account(Connection& c);

  // Starts a window of the reply clock (replyWindowOver): as output is queued into an empty buffer,
  // for every holder when reading is suspended, and when a window has passed.
  void startReplyClock(Connection& c, Clock::time_point now);

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
  void creditBusyPass(Clock::time_point now);

  void startRequestClock(Connection& c) {
    c.requestStart = clockNow();
    c.awayAtRequestStart = awayTime(c.requestStart);
  }

  // ---- backpressure past maxBufferedBytes -------------------------------------------------------
  // Each holder's reply clock starts again now, counting what it takes from here: a reader is
  // judged by what it takes while the others wait, not by what the socket buffers took before.
  void suspendReading();

  // Stops reading `c` until reading resumes (its requests wait in its socket).
  void holdBack(std::uint64_t id, Connection& c);

  // Reading resumes once the replies held are down to half the cap (not at once below it, so that
  // every connection is not held back and released again for each reply taken).
  void maybeResumeReading();

  // Past maxBufferedBytes with requests alone, drops the connection holding the largest one until
  // under it: a well-behaved client's requests are served as they arrive, so it holds little; the
  // largest holder is the one building the largest request. (Suspending reading would not help:
  // an unfinished request is finished only by reading more of it.)
  void dropLargestRequests();

  Clock::duration allowedFor(const Connection& c) const;
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
  void dropSlowRequests();

  // Whether `c`'s current reply window (replyTimeout long, not counting the server's busy time)
  // has passed; `late` if it took less than its quota meanwhile (minReplyRate x replyTimeout, or
  // all it held when the window began). What a socket's buffers take counts as taken, so a client
  // that never reads passes one window at most, while they fill.
  bool replyWindowOver(const Connection& c, Clock::time_point now, bool& late) const;

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
  void dropSlowReaders();

  // Appends replies to their connections' output (sent by flush/flushTouched). Output pushed to
  // a connection other than the requester (a watch notification, a wake-up) that takes it past
  // maxPendingOutput drops that connection: it does not read what it asked to be told.
  void queue(std::uint64_t requester, std::vector<StoreEngine::Reply>& replies);

  void flushTouched();

  void notePending(std::size_t n) {
    std::lock_guard<std::mutex> lock(statsMutex_);
    stats_.peakPendingOutput = std::max<std::uint64_t>(stats_.peakPendingOutput, n);
  }

  void flush(std::uint64_t id);

  // Paused connections are not read (nor watched for a half-close, which would be reported
  // again and again); hang-ups and errors are reported whatever the interest set.
  void updateInterest(Connection& c, std::uint64_t id);

  void drop(std::uint64_t id, const std::string& why);

  void close(std::uint64_t id);

  void countGeneration(Generation g);

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

} // namespace ctorch::store
