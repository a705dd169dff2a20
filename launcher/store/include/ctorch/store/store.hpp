// The key-value store interface the launcher's rendezvous code talks to (c10d's Store, reduced to
// what a rendezvous needs), and the store's small exception tree. Implemented over the c10d TCPStore
// wire protocol by TcpStoreClient; tests may implement it in memory.
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch::store {

using Bytes = std::vector<std::uint8_t>;

inline Bytes toBytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string toString(const Bytes& b) { return std::string(b.begin(), b.end()); }

// Any failure of a store operation.
class StoreError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The peer could not be reached, closed the connection, or spoke something else.
class StoreConnectionError : public StoreError {
 public:
  using StoreError::StoreError;
};
// Connecting was refused (ECONNREFUSED): the peer's machine answered that nothing listens on the
// port, e.g. the process that served the store is gone while its machine is up.
class StoreRefused : public StoreConnectionError {
 public:
  using StoreConnectionError::StoreConnectionError;
};
// A bounded wait (wait, get, connect) ran out of time.
class StoreTimeout : public StoreError {
 public:
  using StoreError::StoreError;
};

class Store {
 public:
  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits (up to the store's timeout) until `key` exists, then returns its value.
  virtual Bytes get(const std::string& key) = 0;
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  // Sets `key` to `desired` if its value is `expected` (an empty `expected` matches a missing key)
  // and returns the value now stored (c10d semantics: the caller compares it with `desired`).
  virtual Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;
  // Blocks until every key exists; throws StoreTimeout after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  virtual bool check(const std::vector<std::string>& keys) = 0;
  virtual bool deleteKey(const std::string& key) {
    (void)key;
    throw StoreError("deleteKey is not supported by this store");
  }
  virtual std::int64_t numKeys() { throw StoreError("numKeys is not supported by this store"); }
};

} // namespace ctorch::store
