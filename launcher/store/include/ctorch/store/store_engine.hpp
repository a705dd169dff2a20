// The TCPStore server's state and semantics without any I/O: keys, queues, waiters and (legacy)
// watchers. The server feeds it parsed requests and sends the replies it produces; tests drive it
// directly. Where the two c10d backends differ, the libuv backend (PyTorch's default) is followed,
// except that waiters are woken only when a key really appears (see execute()).
#pragma once

#include "ctorch/store/tcp_store_protocol.hpp"

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace ctorch::store {

// What the engine may hold, and what one connection may make it hold or produce (a peer beyond
// them is dropped).
struct StoreEngineLimits {
  // Distinct keys one connection may watch (legacy WATCH_KEY); a repeated registration of the
  // same key is one registration, so a SET is copied at most once per watching connection.
  std::size_t maxWatchesPerConnection = 1024;
  // One reply (MULTI_GET of a large value under many keys, LIST_KEYS); a request asking for
  // more is refused before anything is built.
  std::size_t maxReplyLength = 64u << 20;
  // What every key, value and queued element may take together (storedBytes()): a write that
  // would go past it is refused and changes nothing. Writes that do not grow the store (a
  // heartbeat rewriting its key) always pass, so a full store still serves a running job.
  std::size_t maxStoredBytes = 256u << 20;
};

// Keys under this prefix (at the start of the key or after any "/": c10d's clients and PrefixStores
// put their own prefixes before it, "/worker/attempt_0/...") are stored and served like any other,
// but LIST_KEYS does not name them:
// a client learns such a name only from someone who holds it. The groups re-formed in place keep
// their keys here, under a nonce that travels on the job's authenticated control channel
// (contract::control::groupPrefix), so nobody outside the job can name, overwrite or delete them.
inline constexpr const char* kUnlistedPrefix = "ctorch/unlisted/";

class StoreEngine {
 public:
  // Counted for every key, value and queued element besides its bytes (the hash node, the string
  // and vector headers, the allocator's rounding), so that a flood of empty keys is not free.
  static constexpr std::size_t kEntryOverhead = 64;

  // Keys under `ephemeralPrefix` (when non-empty) belong to the connection that last wrote them
  // and are deleted when it disconnects, like ZooKeeper's ephemeral nodes: the rendezvous uses
  // them to learn at once that an agent's connection dropped (a killed node), instead of waiting
  // for its heartbeat to expire.
  explicit StoreEngine(std::string ephemeralPrefix = "", StoreEngineLimits limits = {})
      : ephemeralPrefix_(std::move(ephemeralPrefix)), limits_(limits) {}

  using ConnId = std::uint64_t;
  struct Reply {
    ConnId conn;
    protocol::Bytes bytes;
  };

  // Runs one request of connection `conn`; replies (to it, or to connections whose wait ends or
  // whose watched key changes) are appended to `out`. Throws std::invalid_argument when the
  // request cannot be served (e.g. ADD on a non-integer value, a reply over the limits, a write
  // past maxStoredBytes), having changed nothing: the server then drops `conn`, as both c10d
  // backends do (the protocol has no error reply).
  void execute(ConnId conn, const protocol::Request& request, std::vector<Reply>& out);

  // Forgets a closed connection's waits and watches and deletes the ephemeral keys it owned
  // (watchers of those are notified through `out`); returns the deleted keys.
  std::vector<std::string> disconnect(ConnId conn, std::vector<Reply>* out = nullptr);

  std::size_t numKeys() const { return data_.size(); }
  // Bytes the keys, values and queued elements take, each counted with kEntryOverhead.
  std::size_t storedBytes() const { return stored_; }
  std::size_t ephemeralKeyCount() const { return owners_.size(); }
  std::optional<protocol::Bytes> peek(const std::string& key) const;
  // Connections blocked in WAIT (or a blocking queue pop / barrier).
  std::size_t waitingConnections() const { return awaiting_.size(); }
  // Gives back what the tables keep after their entries went: a hash table's buckets stay at the
  // most it ever held (about 8 bytes a key, and allocated late, so that they hold the heap's top
  // up). Costs one pass over what is left; the server calls it after large deletions.
  void compact();

 private:
  bool present(const std::string& key) const;
  std::size_t growth(const std::string& key, std::size_t newSize) const;
  void admit(const protocol::Request& q, std::size_t more) const;
  void store(const std::string& key, protocol::Bytes value, std::vector<Reply>& out);
  // The handlers of execute(), one per operation: each appends its replies (and any wake-ups or
  // watch notifications it causes) to `out`.
  void onValidate(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onPing(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onSet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onMultiSet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onCompareSet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onGet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onMultiGet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onAdd(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onCheck(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onWait(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onCancelWait(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onGetNumKeys(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onDeleteKey(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onWatchKey(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onAppend(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onQueuePush(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onQueuePop(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onQueueLen(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onListKeys(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void onBarrier(ConnId conn, const protocol::Request& q, std::vector<Reply>& out);
  void erase(std::unordered_map<std::string, protocol::Bytes>::iterator it);
  void wakeAll(const std::string& key, std::vector<Reply>& out);
  void wakeOne(const std::string& key, std::vector<Reply>& out);
  void clearWait(ConnId conn);
  void noteOwner(ConnId conn, const std::string& key);
  void notifyWatchers(const std::string& key, protocol::WatchResponse kind,
                      const protocol::Bytes& oldValue, const protocol::Bytes& newValue,
                      std::vector<Reply>& out);

  std::unordered_map<std::string, protocol::Bytes> data_;
  std::unordered_map<std::string, std::deque<protocol::Bytes>> queues_;
  std::unordered_map<std::string, std::vector<ConnId>> waiters_;   // key -> waiting connections
  std::unordered_map<ConnId, std::size_t> awaiting_;               // connection -> keys missing
  std::unordered_map<std::string, std::vector<ConnId>> watchers_;  // key -> watching connections
  std::unordered_map<ConnId, std::size_t> watchCount_;             // connection -> keys it watches
  std::string ephemeralPrefix_;
  StoreEngineLimits limits_;
  std::unordered_map<std::string, ConnId> owners_;                 // ephemeral key -> its writer
  std::size_t stored_ = 0;                                         // see storedBytes()
};

} // namespace ctorch::store
