// A client of the c10d TCPStore protocol (this library's server, or PyTorch's own), speaking
// either generation: validated (PyTorch >= 2.2, the default) or legacy (LibTorch/PyTorch 1.13).
// Blocking calls, one connection, thread-safe. Keys get c10d::TCPStore's "/" prefix by default so
// that a key set here is the key a Python or LibTorch client sees under the same name.
#pragma once

#include "ctorch/store/store.hpp"
#include "ctorch/store/tcp_store_protocol.hpp"

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::store {

struct TcpStoreClientOptions {
  // Bound on connecting (retrying while the server is not up yet), on get() and on wait() without
  // an explicit timeout; c10d's default is 300 s.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Bound on waiting for the reply to a query that does not wait for keys (SET, COMPARE_SET, ADD,
  // the GET after its key exists, ...); zero means `timeout`. A timed-out reply leaves the
  // connection unusable (StoreTimeout, then StoreConnectionError on later calls): reconnect.
  std::chrono::milliseconds operationTimeout{0};
  // Keep trying to connect until `timeout` while the server refuses (not up yet); false: one
  // attempt (bounded by `timeout`), for callers that retry on their own schedule.
  bool retryConnect = true;
  protocol::Generation generation = protocol::Generation::Validated;
  std::string keyPrefix = "/";
  // Optional sink for diagnostics: one line per refused or failed connection attempt that is
  // retried. Kept as a callback so that this library stays free of any logging framework.
  std::function<void(const std::string&)> debugLog;
};

class TcpStoreClient : public Store {
 public:
  TcpStoreClient(std::string host, std::uint16_t port, TcpStoreClientOptions options = {});
  ~TcpStoreClient() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  void wait(const std::vector<std::string>& keys) { wait(keys, options_.timeout); }
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  std::int64_t numKeys() override;

  void append(const std::string& key, const Bytes& value);
  std::vector<Bytes> multiGet(const std::vector<std::string>& keys);
  void multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values);

  // Validated protocol only.
  void ping();
  void queuePush(const std::string& key, const Bytes& value);
  // Pops the front of a queue; with `block` waits for an element (up to the timeout), else returns
  // nullopt when the queue is empty.
  std::optional<Bytes> queuePop(const std::string& key, bool block);
  std::int64_t queueLen(const std::string& key);

  const std::string& host() const { return host_; }
  std::uint16_t port() const { return port_; }
  // The local address of the connection ("10.0.0.2"): the address of this machine on the route
  // to the store, i.e. how the store host's peers can reach it too.
  std::string localAddress() const;
  // Changes operationTimeout for the following calls (the rendezvous shortens it in its
  // heartbeats so that an unreachable store cannot block the agent's event loop for long).
  void setOperationTimeout(std::chrono::milliseconds timeout);
  // False after a timeout or a connection error: the connection must be replaced.
  bool usable() const;

 private:
  std::string k(const std::string& key) const { return options_.keyPrefix + key; }
  void send(const protocol::Request& request);
  void recvRaw(void* data, std::size_t size);
  template <typename T>
  T recvValue() {
    T v{};
    recvRaw(&v, sizeof v);
    return v;
  }
  Bytes recvBytes();
  void doWait(const std::vector<std::string>& prefixedKeys, std::chrono::milliseconds timeout);
  void requireValidated(const char* what) const;
  void ensureUsable() const;

  std::string host_;
  std::uint16_t port_;
  TcpStoreClientOptions options_;
  int fd_ = -1;
  bool broken_ = false;
  mutable std::mutex mutex_;
};

} // namespace ctorch::store
