#include "ctorch/store/tcp_store_client.hpp"

#include "socket_util.hpp"

#include "ctorch/text/text.hpp"

#include <unistd.h>

#include <cerrno>
#include <thread>

namespace ctorch::store {

using protocol::Generation;
using protocol::Op;
using protocol::Request;

namespace {

} // namespace

TcpStoreClient::TcpStoreClient(std::string host, std::uint16_t port, TcpStoreClientOptions options)
    : host_(std::move(host)), port_(port), options_(std::move(options)) {
  if (options_.generation == Generation::Unknown) options_.generation = Generation::Validated;
  // The server may not be listening yet (another agent starting it): retry until the timeout.
  auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  auto delay = std::chrono::milliseconds(5);
  for (int attempts = 1;; ++attempts) {
    try {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      fd_ = detail::connectTo(host_, port_, std::max(left, std::chrono::milliseconds(1))).release();
      break;
    } catch (const std::system_error& e) {
      if (!options_.retryConnect || std::chrono::steady_clock::now() + delay >= deadline) {
        const std::string what = "cannot reach the store at " + host_ + ":" + std::to_string(port_) + " within " +
                                 std::to_string(options_.timeout.count()) + " ms (" + std::to_string(attempts) +
                                 (attempts == 1 ? " connection attempt): " : " connection attempts): ") + e.what();
        if (e.code().value() == ECONNREFUSED) throw StoreRefused(what);
        throw StoreConnectionError(what);
      }
      if (options_.debugLog)
        options_.debugLog("store client: connection attempt " + std::to_string(attempts) + " to " + host_ + ":" +
                          std::to_string(port_) + " failed (" + e.what() + "); retrying in " +
                          std::to_string(delay.count()) + " ms");
      std::this_thread::sleep_for(delay);
      delay = std::min(delay * 2, std::chrono::milliseconds(200));
    }
  }
  if (options_.generation == Generation::Validated) {
    auto hello = protocol::encodeValidate();
    detail::sendAll(fd_, hello.data(), hello.size());
    ping();  // proves the peer speaks the validated protocol
  }
}

TcpStoreClient::~TcpStoreClient() {
  if (fd_ >= 0) ::close(fd_);
}

std::string TcpStoreClient::localAddress() const {
  return detail::localAddressOf(fd_);
}

void TcpStoreClient::setOperationTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  options_.operationTimeout = timeout;
}

bool TcpStoreClient::usable() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !broken_;
}

void TcpStoreClient::ensureUsable() const {
  if (broken_)
    throw StoreConnectionError("store connection to " + host_ + ":" + std::to_string(port_) +
                               " is unusable after an earlier timeout or error");
}

void TcpStoreClient::requireValidated(const char* what) const {
  if (options_.generation != Generation::Validated)
    throw StoreError(std::string(what) + " needs the validated (PyTorch >= 2.2) protocol");
}

void TcpStoreClient::send(const Request& q) {
  ensureUsable();
  auto bytes = protocol::encodeRequest(options_.generation, q);
  try {
    detail::sendAll(fd_, bytes.data(), bytes.size());
  } catch (...) {
    broken_ = true;
    throw;
  }
}

void TcpStoreClient::recvRaw(void* data, std::size_t size) {
  const bool operation = options_.operationTimeout.count() > 0;
  auto bound = operation ? options_.operationTimeout : options_.timeout;
  try {
    detail::recvAll(fd_, data, size, std::chrono::steady_clock::now() + bound);
  } catch (const StoreTimeout&) {
    broken_ = true;
    // Named, with the bound that fired: the operation timeout and the store's timeout differ.
    throw StoreTimeout("no reply from the store at " + host_ + ":" + std::to_string(port_) + " within " +
                       std::to_string(bound.count()) + " ms (" + (operation ? "operationTimeout" : "timeout") + ")");
  } catch (...) {
    broken_ = true;
    throw;
  }
}

Bytes TcpStoreClient::recvBytes() {
  auto n = recvValue<std::uint64_t>();
  Bytes b(static_cast<std::size_t>(n));
  if (n) recvRaw(b.data(), b.size());
  return b;
}

void TcpStoreClient::ping() {
  std::lock_guard<std::mutex> lock(mutex_);
  requireValidated("PING");
  Request q;
  q.op = Op::Ping;
  q.nonce = static_cast<std::uint32_t>(::getpid());
  send(q);
  auto echoed = recvValue<std::uint32_t>();
  if (echoed != q.nonce) {
    broken_ = true;
    throw StoreConnectionError("store at " + host_ + ":" + std::to_string(port_) +
                               " answered PING with a wrong nonce");
  }
}

void TcpStoreClient::set(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::Set;
  q.key = k(key);
  q.value = value;
  send(q);
}

void TcpStoreClient::doWait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  Request q;
  q.op = Op::Wait;
  q.keys = keys;
  send(q);
  if (detail::waitReadable(fd_, std::chrono::steady_clock::now() + timeout)) {
    auto r = recvValue<std::uint8_t>();
    if (r != static_cast<std::uint8_t>(protocol::WaitResponse::StopWaiting)) {
      broken_ = true;
      throw StoreConnectionError("unexpected reply to WAIT");
    }
    return;
  }
  std::string what = "timed out after " + std::to_string(timeout.count()) +
                     " ms waiting for store key(s) " + text::join(keys, ", ");
  if (options_.generation == Generation::Legacy) {
    // 1.13 has no CANCEL_WAIT: the late STOP_WAITING would desynchronise the connection.
    broken_ = true;
    throw StoreTimeout(what);
  }
  Request cancel;
  cancel.op = Op::CancelWait;
  send(cancel);
  auto r = recvValue<std::uint8_t>();
  if (r == static_cast<std::uint8_t>(protocol::WaitResponse::StopWaiting))
    r = recvValue<std::uint8_t>();  // the wait ended just before the cancel arrived
  if (r != static_cast<std::uint8_t>(protocol::WaitResponse::WaitCanceled)) {
    broken_ = true;
    throw StoreConnectionError("unexpected reply to CANCEL_WAIT");
  }
  throw StoreTimeout(what);
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> prefixed;
  for (const auto& key : keys) prefixed.push_back(k(key));
  doWait(prefixed, timeout);
}

Bytes TcpStoreClient::get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  doWait({k(key)}, options_.timeout);
  Request q;
  q.op = Op::Get;
  q.key = k(key);
  send(q);
  return recvBytes();
}

std::int64_t TcpStoreClient::add(const std::string& key, std::int64_t delta) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::Add;
  q.key = k(key);
  q.number = delta;
  send(q);
  return recvValue<std::int64_t>();
}

Bytes TcpStoreClient::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::CompareSet;
  q.key = k(key);
  q.value = expected;
  q.desired = desired;
  send(q);
  return recvBytes();
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::Check;
  for (const auto& key : keys) q.keys.push_back(k(key));
  send(q);
  return recvValue<std::uint8_t>() == static_cast<std::uint8_t>(protocol::CheckResponse::Ready);
}

bool TcpStoreClient::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::DeleteKey;
  q.key = k(key);
  send(q);
  return recvValue<std::int64_t>() == 1;
}

std::int64_t TcpStoreClient::numKeys() {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::GetNumKeys;
  send(q);
  return recvValue<std::int64_t>();
}

void TcpStoreClient::append(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::Append;
  q.key = k(key);
  q.value = value;
  send(q);
}

std::vector<Bytes> TcpStoreClient::multiGet(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::MultiGet;
  for (const auto& key : keys) q.keys.push_back(k(key));
  doWait(q.keys, options_.timeout);
  send(q);
  std::vector<Bytes> out;
  for (std::size_t i = 0; i < keys.size(); ++i) out.push_back(recvBytes());
  return out;
}

void TcpStoreClient::multiSet(const std::vector<std::string>& keys, const std::vector<Bytes>& values) {
  if (keys.size() != values.size())
    throw std::invalid_argument("multiSet: " + std::to_string(keys.size()) + " keys but " +
                                std::to_string(values.size()) + " values");
  std::lock_guard<std::mutex> lock(mutex_);
  Request q;
  q.op = Op::MultiSet;
  for (const auto& key : keys) q.keys.push_back(k(key));
  q.values = values;
  send(q);
}

void TcpStoreClient::queuePush(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireValidated("queuePush");
  Request q;
  q.op = Op::QueuePush;
  q.key = k(key);
  q.value = value;
  send(q);
}

std::optional<Bytes> TcpStoreClient::queuePop(const std::string& key, bool block) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireValidated("queuePop");
  if (block) doWait({k(key)}, options_.timeout);
  Request q;
  q.op = Op::QueuePop;
  q.key = k(key);
  send(q);
  auto n = recvValue<std::int64_t>();
  if (n <= 0) return std::nullopt;
  return recvBytes();
}

std::int64_t TcpStoreClient::queueLen(const std::string& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  requireValidated("queueLen");
  Request q;
  q.op = Op::QueueLen;
  q.key = k(key);
  send(q);
  return recvValue<std::int64_t>();
}

} // namespace ctorch::store
