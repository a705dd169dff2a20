// The c10d rendezvous' store link (store_link.hpp): bounded requests over one TcpStoreClient,
// reconnects, and StoreUnreachable once the store is silent or refuses for too long.
#include "store_link.hpp"

#include "agent_clock.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"

#include <poll.h>

#include <algorithm>
#include <thread>

namespace ctorch::launcher {

StoreLink::StoreLink(std::string host, int port, milliseconds opTimeout, milliseconds unreachableLimit,
                     std::string aliveKey)
    : host_(std::move(host)),
      port_(port),
      opTimeout_(opTimeout),
      limit_(unreachableLimit),
      aliveKey_(std::move(aliveKey)) {}

void StoreLink::connect() {
  client_.reset();
  store::TcpStoreClientOptions o;
  o.timeout = opTimeout_;
  o.operationTimeout = opTimeout_;
  o.retryConnect = false;  // the callers retry on their own schedule
  auto c = std::make_unique<store::TcpStoreClient>(host_, static_cast<std::uint16_t>(port_), o);
  c->set(aliveKey_, store::toBytes("1"));
  client_ = std::move(c);
  if (!everConnected_) lastSuccess_ = Clock::now();
  everConnected_ = true;
}

template <typename F>
auto StoreLink::call(F&& f) -> decltype(f()) {
  const auto started = Clock::now();
  for (;;) {
    try {
      if (!client_ || !client_->usable()) connect();
      auto result = f();
      lastSuccess_ = Clock::now();
      refusedSince_.reset();
      return result;
    } catch (const store::StoreError& e) {
      client_.reset();
      lastError_ = e.what();
      if (!dynamic_cast<const store::StoreRefused*>(&e))
        refusedSince_.reset();
      else if (!refusedSince_)
        refusedSince_ = Clock::now();
      if (refusedLimit_ && refusedSince_ && since(*refusedSince_) >= *refusedLimit_)
        throw StoreUnreachable("the rendezvous store at " + where() + " has refused connections for " +
                               measuredSeconds(since(*refusedSince_)) + ": its ctorchrun is gone (" + lastError_ + ")",
                               true);
      if (silentFor() > limit_ || since(started) > limit_)
        throw StoreUnreachable("no answer from the rendezvous store at " + where() + " for " +
                               measuredSeconds(std::max(silentFor(), since(started))) + " (" + lastError_ + ")",
                               false);
      if (!patient_) throw;
    }
    pause(milliseconds(50));
  }
}

void StoreLink::pause(milliseconds d) {
  if (!request_ || request_->cancelFd < 0) {
    std::this_thread::sleep_for(d);
    return;
  }
  if (request_->stopNow()) throw RendezvousInterrupted("interrupted while retrying the rendezvous store at " + where());
  pollfd p{request_->cancelFd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(d.count())) > 0 && request_->stopNow())
    throw RendezvousInterrupted("interrupted while retrying the rendezvous store at " + where());
}

void StoreLink::connectFirst(Clock::time_point deadline, const RendezvousRequest& request) {
  std::string lastError;
  for (;;) {
    if (request.stopNow())
      throw RendezvousInterrupted("interrupted while connecting to the rendezvous store at " + where());
    try {
      connect();
      return;
    } catch (const store::StoreError& e) {
      lastError = e.what();
    }
    if (Clock::now() >= deadline)
      throw RendezvousTimeout("the rendezvous store at " + where() + " did not answer within the join timeout: " +
                              lastError + " (is the agent hosting it, the one whose address matches "
                              "--rdzv-endpoint, running? is the port reachable?)");
    std::this_thread::sleep_for(milliseconds(50));
  }
}

void StoreLink::retarget(std::string host, int port) {
  client_.reset();
  host_ = std::move(host);
  port_ = port;
  lastSuccess_ = Clock::now();
  everConnected_ = false;
  refusedSince_.reset();
}

StoreLink::milliseconds StoreLink::silentFor() const { return since(lastSuccess_); }

std::string StoreLink::localAddress() {
  return call([&] { return client_->localAddress(); });
}

std::string StoreLink::compareSet(const std::string& key, const std::string& expected, const std::string& desired) {
  return call([&] {
    return store::toString(client_->compareSet(key, store::toBytes(expected), store::toBytes(desired)));
  });
}

std::string StoreLink::get(const std::string& key) {
  return call([&] {
    if (!client_->check({key}))
      throw rdzv::c10d::RendezvousStateError("the rendezvous state key '" + key + "' is gone from the store at " +
                                             where() + " (deleted by another client, or the store restarted "
                                             "empty): this rendezvous cannot continue");
    return store::toString(client_->get(key));
  });
}

std::int64_t StoreLink::add(const std::string& key, std::int64_t delta) {
  return call([&] { return client_->add(key, delta); });
}

void StoreLink::set(const std::string& key, const std::string& value) {
  call([&] {
    client_->set(key, store::toBytes(value));
    return 0;
  });
}

bool StoreLink::check(const std::vector<std::string>& keys) {
  return call([&] { return client_->check(keys); });
}

void StoreLink::deleteKey(const std::string& key) {
  call([&] { return client_->deleteKey(key); });
}

std::vector<std::string> StoreLink::getMany(const std::vector<std::string>& keys) {
  return call([&] {
    std::vector<std::string> out;
    for (const auto& value : client_->multiGet(keys)) out.push_back(store::toString(value));
    return out;
  });
}

void StoreLink::dropAliveKey() {
  call([&] { return client_->deleteKey(aliveKey_); });
}

} // namespace ctorch::launcher
