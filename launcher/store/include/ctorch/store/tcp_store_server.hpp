// A c10d-compatible TCPStore server: what ctorchrun hosts for its workers
// (TORCHELASTIC_USE_AGENT_STORE=True) and what the multi-node rendezvous meets in. Serves LibTorch/
// PyTorch 1.x clients and PyTorch >= 2.2 clients at once (the protocol generation is detected per
// connection). One background thread, epoll, non-blocking sockets; no LibTorch.
#pragma once

#include "ctorch/store/store.hpp"
#include "ctorch/store/tcp_store_protocol.hpp"

#include <atomic>
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
  // Optional sink for diagnostics (protocol errors, dropped connections); called on the server
  // thread. Kept as a callback so that this library stays free of any logging framework.
  std::function<void(const std::string&)> debugLog;
  // Keys under this prefix (as sent on the wire, e.g. "/ctorchrun.alive/") are ephemeral: deleted
  // when the connection that wrote them closes, and then reported to `onEphemeralKeyLost` (called
  // on the server thread). Empty: no ephemeral keys. A ctorchrun extension of c10d's semantics
  // that plain c10d clients never notice (they do not use the prefix).
  std::string ephemeralKeyPrefix;
  std::function<void(const std::string& key)> onEphemeralKeyLost;
};

struct TcpStoreServerStats {
  std::uint64_t connections = 0;          // accepted so far
  std::uint64_t legacyConnections = 0;    // detected as LibTorch/PyTorch 1.x - 2.0
  std::uint64_t validatedConnections = 0; // detected as PyTorch >= 2.2
  std::uint64_t requests = 0;
  std::uint64_t protocolErrors = 0;
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
