// The c10d rendezvous' link to its store: one TcpStoreClient, replaced when a request fails, every
// request bounded, and "the store is gone" (StoreUnreachable) told apart from one failed request.
#pragma once

#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"
#include "ctorch/store/tcp_store_client.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher {

// Raised by StoreLink when the store has not answered for longer than the heartbeat expiry: the
// peers have removed this node by now, so waiting longer is pointless.
struct StoreUnreachable : store::StoreConnectionError {
  StoreUnreachable(const std::string& what, bool refusedConnections)
      : store::StoreConnectionError(what), refused(refusedConnections) {}
  bool refused;  // the host answers and refuses: the store's ctorchrun is gone (not a cut link)
};

// The rendezvous' connection to the store. In "patient" mode a failed request is retried
// (reconnecting) until the store has been silent for `unreachableLimit`, or this one request has
// been tried for that long (a reconnect is no answer to it); otherwise one attempt is made and its
// error passes through (the event loop tries again at its next tick). While a stop request is set
// (the agent waits in next()), a retry also ends when the agent is asked to stop.
class StoreLink final : public rdzv::c10d::CasStore {
 public:
  using Clock = std::chrono::steady_clock;
  using milliseconds = std::chrono::milliseconds;

  StoreLink(std::string host, int port, milliseconds opTimeout, milliseconds unreachableLimit,
            std::string aliveKey);

  // First contact: the store host may start later than this agent, so keep trying until
  // `deadline` (short tries, so that a stop request is noticed).
  void connectFirst(Clock::time_point deadline, const RendezvousRequest& request);
  // Store failover: from now on the store is at host:port (an empty one until its node seeds it).
  void retarget(std::string host, int port);

  void setPatient(bool patient) { patient_ = patient; }
  // Store failover: connections refused (nothing listens on the store's port, its machine answers)
  // for this long mean the store's ctorchrun is gone: no need to wait for the whole expiry.
  void setRefusedLimit(milliseconds limit) { refusedLimit_ = limit; }
  void setRequest(const RendezvousRequest* request) { request_ = request; }
  milliseconds silentFor() const;
  std::string where() const { return host_ + ":" + std::to_string(port_); }
  std::string localAddress();

  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override;
  // c10d's get waits for a missing key; the state key exists from the executor's first
  // compare-and-set on, so a missing one was deleted (by a hostile or confused client, or the
  // store restarted empty): waiting for it would hang the agent. Check first, fail clearly.
  std::string get(const std::string& key) override;
  bool supportsAnnouncements() const override { return true; }
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  void set(const std::string& key, const std::string& value) override;
  bool check(const std::string& key) override { return check(std::vector<std::string>{key}); }
  bool check(const std::vector<std::string>& keys);
  void deleteKey(const std::string& key) override;
  bool checkAll(const std::vector<std::string>& keys) override { return check(keys); }
  std::vector<std::string> getMany(const std::vector<std::string>& keys) override;
  void dropAliveKey();
  void disconnect() { client_.reset(); }

 private:
  void connect();
  template <typename F>
  auto call(F&& f) -> decltype(f());
  // Sleeps between retries; ends early (throwing) when the agent is asked to stop.
  void pause(milliseconds d);

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

} // namespace ctorch::launcher
