// The moved-store beacon (moved_beacon.hpp).
#include "moved_beacon.hpp"

#include "ctorch/store/tcp_store_client.hpp"
#include "log.hpp"

#include <memory>

namespace ctorch::launcher {

MovedBeacon::MovedBeacon(Options options) : o_(std::move(options)) { thread_ = std::thread([this] { run(); }); }

MovedBeacon::~MovedBeacon() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void MovedBeacon::run() {
  const store::Bytes value(o_.value.begin(), o_.value.end());
  const std::string where = o_.host + ":" + std::to_string(o_.port);
  std::unique_ptr<store::TcpStoreClient> client;
  bool told = false;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      if (!client) {
        store::TcpStoreClientOptions co;
        co.timeout = o_.requestBound;
        co.operationTimeout = o_.requestBound;
        co.retryConnect = false;
        client = std::make_unique<store::TcpStoreClient>(o_.host, static_cast<std::uint16_t>(o_.port), co);
      }
      // Written every time, not once: the store there may have restarted empty, or someone may
      // have overwritten the key.
      client->set(o_.key, value);
      if (!told)
        log("rendezvous").info("store failover: a store answers at the job's original endpoint {} again: told it "
                               "where the rendezvous store is now, for nodes started with that endpoint", where);
      told = true;
    } catch (const std::exception& e) {
      if (told) log("rendezvous").debug("store failover: the original endpoint {}: {}", where, e.what());
      client.reset();
      told = false;
    }
    lock.lock();
    wake_.wait_for(lock, o_.interval, [this] { return stop_; });
  }
}

} // namespace ctorch::launcher
