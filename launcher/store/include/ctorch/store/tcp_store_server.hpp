// A c10d-compatible TCPStore server: what ctorchrun hosts for its workers
// (TORCHELASTIC_USE_AGENT_STORE=True) and what the multi-node rendezvous meets in. Serves LibTorch/
// PyTorch 1.x clients and PyTorch >= 2.2 clients at once (the protocol generation is detected per
// connection). One background thread, epoll, non-blocking sockets; no LibTorch.
#pragma once

#include "ctorch/store/side_protocol.hpp"
#include "ctorch/store/store.hpp"
#include "ctorch/store/store_engine.hpp"
#include "ctorch/store/tcp_store_protocol.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace ctorch::store {

// The listening socket could not be set up (most often: the port is taken).
class StoreBindError : public StoreError {
 public:
  StoreBindError(const std::string& what, int error) : StoreError(what), errno_(error) {}
  int error() const { return errno_; }

 private:
  int errno_;
};

struct TcpStoreServerOptions {
  // Address to listen on; empty means every interface (IPv6 dual-stack where available, as c10d).
  std::string host;
  // 0 picks a free port (read it back with port()).
  std::uint16_t port = 0;
  protocol::Limits limits;
  StoreEngineLimits engineLimits;
  // Unsent replies one connection may accumulate. Past it, that connection's further requests
  // wait until it reads (backpressure: a client that pipelines and never reads stalls only
  // itself), and output pushed to it by others (watch notifications, wake-ups) drops it.
  std::size_t maxPendingOutput = 64u << 20;
  // Connections served at once; 0: as many as the file-descriptor limit allows while leaving a
  // reserve (1/8 of RLIMIT_NOFILE, at least 32) to the rest of the process (a restart's new
  // store, the workers' pipes). At the cap the oldest connection that has not sent a complete
  // request yet (or not finished the side protocol's handshake) makes room for the new one;
  // without such a connection, the newest connection of the peer holding the most does, when it
  // holds more than twice what the new one's peer would (a peer: a remote address, or for a
  // connection from this machine the Unix user owning its socket); else the new one is closed.
  std::size_t maxConnections = 0;
  // Bytes of requests received but not served yet (incomplete ones, mostly) and of replies not
  // sent yet, over all connections. Past it the server stops reading requests (backpressure)
  // until the replies it holds are taken (down to half the cap): a round's worth of large reads
  // (every node of a 1,000-node rendezvous reading the state) waits instead of being dropped.
  // Requests alone past it (half-sent large values from many connections) drop the connection
  // holding the largest one: only more bytes or a drop can finish them.
  std::size_t maxBufferedBytes = 128u << 20;
  // A request must arrive whole within requestTimeout of its first byte plus one second per
  // minRequestRate bytes of it received so far; a slower one (a client dripping bytes, or one
  // stopped mid-request) drops its connection. A large value over a slow link still gets
  // through. The clock runs only while the server listens: time it spent handling others (the
  // part of a pass over its events beyond 100 ms) or with reading suspended is not counted, and
  // a request is judged only once what its socket holds has been read. Zero: no deadline.
  std::chrono::milliseconds requestTimeout{std::chrono::seconds(5)};
  std::size_t minRequestRate = 64u << 10;  // bytes per second
  // While reading is suspended (maxBufferedBytes), a connection holding unsent replies must take
  // minReplyRate x replyTimeout bytes of them (or all it holds) in every replyTimeout (the
  // server's own busy time not counted); a slower reader is dropped, after one or two such windows
  // (the first may pass while the socket buffers fill), and one that has taken nothing for
  // replyTimeout (it never reads: its socket filled, before the suspension or since) at the next
  // sweep, so that no client holds the others' requests back for longer. Every client waits
  // meanwhile: keep it well inside their request timeouts. Must be positive.
  std::chrono::milliseconds replyTimeout{std::chrono::seconds(5)};
  std::size_t minReplyRate = 64u << 10;  // bytes per second
  // Optional sink for diagnostics (protocol errors, dropped connections); called on the server
  // thread. Kept as a callback so that this library stays free of any logging framework.
  std::function<void(const std::string&)> debugLog;
  // Keys under this prefix (as sent on the wire, e.g. "/ctorchrun.alive/") are ephemeral: deleted
  // when the connection that wrote them closes, and then reported to `onEphemeralKeyLost` (called
  // on the server thread). Empty: no ephemeral keys. A ctorchrun extension of c10d's semantics
  // that plain c10d clients never notice (they do not use the prefix).
  std::string ephemeralKeyPrefix;
  std::function<void(const std::string& key)> onEphemeralKeyLost;
  // Connections that open with side->magic() are served by `side` instead of the store
  // (side_protocol.hpp); null: every connection speaks c10d's protocol.
  std::shared_ptr<SideProtocol> side;
  // The time the request and reply deadlines (and the server's own busy time) are measured on;
  // null: std::chrono::steady_clock. Tests give a clock they move by hand, so that a deadline
  // passes when the test says and never because the machine was slow. Called on the server
  // thread; it must never go back, nor return the epoch.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

struct TcpStoreServerStats {
  std::uint64_t connections = 0;          // accepted so far
  std::uint64_t legacyConnections = 0;    // detected as LibTorch/PyTorch 1.x - 2.0
  std::uint64_t validatedConnections = 0; // detected as PyTorch >= 2.2
  std::uint64_t requests = 0;
  std::uint64_t protocolErrors = 0;
  std::uint64_t bytesReceived = 0;        // request bytes read from clients
  std::uint64_t bytesParsed = 0;          // the parser's work: bytes it copied or looked at
  std::uint64_t peakPendingOutput = 0;    // the most unsent output one connection has had
  std::uint64_t droppedConnections = 0;   // closed by the server (limits, protocol errors)
  std::uint64_t rejectedConnections = 0;  // accepted and closed at once: no room (cap, no fds)
  std::uint64_t evictedConnections = 0;   // connections closed for a new one at the cap (idle or fairness)
  // Of those, closed because their peer held far more than the new one's (TcpStoreServerOptions::maxConnections).
  std::uint64_t fairnessEvictions = 0;
  // Connections from this machine whose Unix user the kernel could not name (no sock_diag): they
  // count as one peer at the cap, whichever user holds them.
  std::uint64_t unnamedLocalPeers = 0;
  std::uint64_t sideConnections = 0;      // handed to the side protocol (its magic came first)
  std::uint64_t storedBytes = 0;          // now: keys, values and queues held (StoreEngine::storedBytes)
  std::uint64_t bufferedBytes = 0;        // now: requests not served yet + replies not sent yet
  std::uint64_t peakBufferedBytes = 0;
  std::uint64_t timedOutConnections = 0;  // dropped for a request slower than the deadline
  std::uint64_t readSuspensions = 0;      // times reading stopped: maxBufferedBytes reached
  std::uint64_t slowReaders = 0;          // dropped for taking replies too slowly while suspended
  std::uint64_t closedConnections = 0;    // accepted ones closed by either side, counted once the close
                                          // is done (ephemeral keys gone, the side protocol told)
  std::uint64_t deadlineSweeps = 0;       // checks of every connection against its request or reply deadline
  std::chrono::steady_clock::time_point lastSweep{};  // when the last one ran, on the deadlines' clock
  std::uint64_t loopPasses = 0;           // returns from epoll_wait: an idle server makes few (a spin, millions)
  std::uint64_t memoryGivenBack = 0;      // times the store gave freed memory back to the system (large deletions)
};

class TcpStoreServer {
 public:
  // Binds and listens before returning (so a taken port is reported here, as StoreBindError),
  // then serves on a background thread until destruction.
  explicit TcpStoreServer(TcpStoreServerOptions options);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  std::uint16_t port() const { return port_; }
  TcpStoreServerStats stats() const;
  // Ephemeral keys held right now (one per connected agent that set its key).
  std::size_t ephemeralKeyCount() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::uint16_t port_ = 0;
};

} // namespace ctorch::store
