#include "ctorch/store/store_engine.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string_view>

namespace ctorch::store {

using protocol::Bytes;
using protocol::CheckResponse;
using protocol::Op;
using protocol::WaitResponse;
using protocol::WatchResponse;
using protocol::Writer;

namespace {

// c10d stores counters as decimal text and parses them with std::stoll.
std::int64_t parseCounter(const std::string& key, const Bytes& value) {
  std::string text(value.begin(), value.end());
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || errno == ERANGE)
    throw std::invalid_argument("ADD on key '" + key + "' whose value '" + text +
                                "' is not an integer");
  return static_cast<std::int64_t>(v);
}

// Counter arithmetic must not wrap (signed overflow is undefined; a wrapped barrier count or rank
// counter would be silently wrong): refused like a non-integer value, so the server drops the
// connection that asked for it (c10d has no error reply for ADD).
std::int64_t checkedAdd(const std::string& key, std::int64_t current, std::int64_t delta) {
  std::int64_t sum = 0;
  if (__builtin_add_overflow(current, delta, &sum))
    throw std::invalid_argument("ADD of " + std::to_string(delta) + " to key '" + key + "' holding " +
                                std::to_string(current) + " overflows a 64-bit counter");
  return sum;
}

Bytes counterBytes(std::int64_t v) {
  std::string s = std::to_string(v);
  return Bytes(s.begin(), s.end());
}

Bytes u8Reply(std::uint8_t v) { return Writer().u8(v).take(); }

// A key as quoted in an error: keys may be up to a MiB long.
std::string shortKey(const std::string& key) {
  return key.size() <= 80 ? key : key.substr(0, 80) + "...";
}

} // namespace

std::optional<Bytes> StoreEngine::peek(const std::string& key) const {
  auto it = data_.find(key);
  if (it == data_.end()) return std::nullopt;
  return it->second;
}

bool StoreEngine::present(const std::string& key) const {
  if (data_.count(key)) return true;
  auto q = queues_.find(key);
  return q != queues_.end() && !q->second.empty();
}

// What writing a value of `newSize` bytes under `key` adds to storedBytes() (0: it does not grow).
std::size_t StoreEngine::growth(const std::string& key, std::size_t newSize) const {
  auto it = data_.find(key);
  if (it == data_.end()) return key.size() + newSize + kEntryOverhead;
  return newSize > it->second.size() ? newSize - it->second.size() : 0;
}

// Refuses (throws) a write of `more` bytes past maxStoredBytes, before anything changes.
void StoreEngine::admit(const protocol::Request& q, std::size_t more) const {
  if (more == 0 || stored_ + more <= limits_.maxStoredBytes) return;
  const std::string& key = q.keys.empty() ? q.key : q.keys.front();
  throw std::invalid_argument(std::string(protocol::opName(q.op)) + " of key '" + shortKey(key) +
                              "' would take the store past its limit of " + std::to_string(limits_.maxStoredBytes) +
                              " bytes (maxStoredBytes; " + std::to_string(stored_) + " held, " +
                              std::to_string(more) + " more asked)");
}

void StoreEngine::wakeAll(const std::string& key, std::vector<Reply>& out) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  for (ConnId c : it->second) {
    auto a = awaiting_.find(c);
    if (a == awaiting_.end()) continue;
    if (--a->second == 0) {
      awaiting_.erase(a);
      out.push_back({c, u8Reply(static_cast<std::uint8_t>(WaitResponse::StopWaiting))});
    }
  }
  waiters_.erase(it);
}

void StoreEngine::wakeOne(const std::string& key, std::vector<Reply>& out) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  while (!it->second.empty()) {
    ConnId c = it->second.front();
    it->second.erase(it->second.begin());
    auto a = awaiting_.find(c);
    if (a == awaiting_.end()) continue;  // stale entry
    if (--a->second == 0) {
      awaiting_.erase(a);
      out.push_back({c, u8Reply(static_cast<std::uint8_t>(WaitResponse::StopWaiting))});
    }
    break;
  }
  if (it->second.empty()) waiters_.erase(it);
}

void StoreEngine::clearWait(ConnId conn) {
  if (!awaiting_.erase(conn)) return;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    auto& v = it->second;
    v.erase(std::remove(v.begin(), v.end(), conn), v.end());
    it = v.empty() ? waiters_.erase(it) : std::next(it);
  }
}

std::vector<std::string> StoreEngine::disconnect(ConnId conn, std::vector<Reply>* out) {
  clearWait(conn);
  if (watchCount_.erase(conn)) {
    for (auto it = watchers_.begin(); it != watchers_.end();) {
      auto& v = it->second;
      v.erase(std::remove(v.begin(), v.end(), conn), v.end());
      it = v.empty() ? watchers_.erase(it) : std::next(it);
    }
  }
  std::vector<std::string> removed;
  for (auto it = owners_.begin(); it != owners_.end();) {
    if (it->second != conn) {
      ++it;
      continue;
    }
    auto d = data_.find(it->first);
    if (d != data_.end()) {
      std::vector<Reply> scratch;
      if (watchers_.count(it->first))
        notifyWatchers(it->first, WatchResponse::KeyDeleted, d->second, {}, out ? *out : scratch);
      erase(d);
      removed.push_back(it->first);
    }
    it = owners_.erase(it);
  }
  return removed;
}

void StoreEngine::noteOwner(ConnId conn, const std::string& key) {
  if (ephemeralPrefix_.empty() || key.compare(0, ephemeralPrefix_.size(), ephemeralPrefix_) != 0) return;
  if (data_.count(key))
    owners_[key] = conn;
  else
    owners_.erase(key);
}

void StoreEngine::notifyWatchers(const std::string& key, WatchResponse kind, const Bytes& oldValue,
                                 const Bytes& newValue, std::vector<Reply>& out) {
  auto it = watchers_.find(key);
  if (it == watchers_.end()) return;
  for (ConnId c : it->second) {
    Writer w;
    w.u8(static_cast<std::uint8_t>(kind)).str(key).bytes(oldValue).bytes(newValue);
    out.push_back({c, w.take()});
  }
}

void StoreEngine::store(const std::string& key, Bytes value, std::vector<Reply>& out) {
  auto it = data_.find(key);
  if (it == data_.end()) {
    if (watchers_.count(key)) notifyWatchers(key, WatchResponse::KeyCreated, {}, value, out);
    stored_ += key.size() + value.size() + kEntryOverhead;
    data_.emplace(key, std::move(value));
  } else {
    if (watchers_.count(key)) notifyWatchers(key, WatchResponse::KeyUpdated, it->second, value, out);
    stored_ = stored_ - it->second.size() + value.size();
    it->second = std::move(value);
  }
  wakeAll(key, out);
}

namespace {
// rehash(0) sizes a table for what it holds now (libstdc++ shrinks as well as grows); only a table
// with four times the buckets it needs is rehashed, so that a compaction costs a pass over a table
// only when that gives much back.
template <typename Table>
void shrink(Table& t) {
  if (t.bucket_count() > 4 * t.size() + 64) t.rehash(0);
}
} // namespace

void StoreEngine::compact() {
  shrink(data_);
  shrink(queues_);
  shrink(waiters_);
  shrink(awaiting_);
  shrink(watchers_);
  shrink(watchCount_);
  shrink(owners_);
}

void StoreEngine::erase(std::unordered_map<std::string, Bytes>::iterator it) {
  stored_ -= it->first.size() + it->second.size() + kEntryOverhead;
  data_.erase(it);
}

// One handler per operation (below); this is only the dispatch.
void StoreEngine::execute(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  switch (q.op) {
    case Op::Validate:
      return onValidate(conn, q, out);
    case Op::Ping:
      return onPing(conn, q, out);
    case Op::Set:
      return onSet(conn, q, out);
    case Op::MultiSet:
      return onMultiSet(conn, q, out);
    case Op::CompareSet:
      return onCompareSet(conn, q, out);
    case Op::Get:
      return onGet(conn, q, out);
    case Op::MultiGet:
      return onMultiGet(conn, q, out);
    case Op::Add:
      return onAdd(conn, q, out);
    case Op::Check:
      return onCheck(conn, q, out);
    case Op::Wait:
      return onWait(conn, q, out);
    case Op::CancelWait:
      return onCancelWait(conn, q, out);
    case Op::GetNumKeys:
      return onGetNumKeys(conn, q, out);
    case Op::DeleteKey:
      return onDeleteKey(conn, q, out);
    case Op::WatchKey:
      return onWatchKey(conn, q, out);
    case Op::Append:
      return onAppend(conn, q, out);
    case Op::QueuePush:
      return onQueuePush(conn, q, out);
    case Op::QueuePop:
      return onQueuePop(conn, q, out);
    case Op::QueueLen:
      return onQueueLen(conn, q, out);
    case Op::ListKeys:
      return onListKeys(conn, q, out);
    case Op::Barrier:
      return onBarrier(conn, q, out);
  }
}

void StoreEngine::onValidate(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  return;  // the handshake carries no reply
}

void StoreEngine::onPing(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  out.push_back({conn, Writer().u32(q.nonce).take()});
}

void StoreEngine::onSet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  admit(q, growth(q.key, q.value.size()));
  store(q.key, q.value, out);
  noteOwner(conn, q.key);
}

void StoreEngine::onMultiSet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  // Counted as if every key were new: an upper bound, so that no part is written if the
  // whole would not fit.
  std::size_t total = 0;
  for (std::size_t i = 0; i < q.keys.size(); ++i) total += q.keys[i].size() + q.values[i].size() + kEntryOverhead;
  admit(q, total);
  for (std::size_t i = 0; i < q.keys.size(); ++i) {
    store(q.keys[i], q.values[i], out);
    noteOwner(conn, q.keys[i]);
  }
}

void StoreEngine::onCompareSet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  // c10d: a missing key matches an empty `expected`; otherwise the reply is `expected` itself
  // ("lying" to the caller, as upstream notes). Waiters wake only if the key now exists.
  auto it = data_.find(q.key);
  if (it == data_.end()) {
    if (q.value.empty()) {
      admit(q, growth(q.key, q.desired.size()));
      store(q.key, q.desired, out);
      noteOwner(conn, q.key);
      out.push_back({conn, Writer().bytes(q.desired).take()});
    } else {
      out.push_back({conn, Writer().bytes(q.value).take()});
    }
  } else {
    if (it->second == q.value) {
      admit(q, growth(q.key, q.desired.size()));
      store(q.key, q.desired, out);
      noteOwner(conn, q.key);
    }
    out.push_back({conn, Writer().bytes(data_.at(q.key)).take()});
  }
}

void StoreEngine::onGet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  auto it = data_.find(q.key);
  out.push_back({conn, Writer().bytes(it == data_.end() ? Bytes{} : it->second).take()});
}

void StoreEngine::onMultiGet(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  std::size_t length = 0;
  for (const auto& k : q.keys) {
    auto it = data_.find(k);
    length += 8 + (it == data_.end() ? 0 : it->second.size());
  }
  if (length > limits_.maxReplyLength)
    throw std::invalid_argument("MULTI_GET of " + std::to_string(q.keys.size()) + " keys would make a reply of " +
                                std::to_string(length) + " bytes, over the limit of " +
                                std::to_string(limits_.maxReplyLength));
  Writer w;
  for (const auto& k : q.keys) {
    auto it = data_.find(k);
    w.bytes(it == data_.end() ? Bytes{} : it->second);
  }
  out.push_back({conn, w.take()});
}

void StoreEngine::onAdd(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  std::int64_t v = q.number;
  auto it = data_.find(q.key);
  if (it != data_.end()) v = checkedAdd(q.key, parseCounter(q.key, it->second), q.number);
  Bytes value = counterBytes(v);
  admit(q, growth(q.key, value.size()));
  // The reply goes out before any wake-ups it causes, as in c10d.
  out.push_back({conn, Writer().i64(v).take()});
  store(q.key, std::move(value), out);
}

void StoreEngine::onCheck(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  bool ready = std::all_of(q.keys.begin(), q.keys.end(),
                           [this](const std::string& k) { return present(k); });
  out.push_back({conn, u8Reply(static_cast<std::uint8_t>(ready ? CheckResponse::Ready
                                                                 : CheckResponse::NotReady))});
}

void StoreEngine::onWait(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  clearWait(conn);  // one outstanding wait per connection
  std::size_t missing = 0;
  for (const auto& k : q.keys) {
    if (!present(k)) {
      waiters_[k].push_back(conn);
      ++missing;
    }
  }
  if (missing == 0) {
    out.push_back({conn, u8Reply(static_cast<std::uint8_t>(WaitResponse::StopWaiting))});
  } else {
    awaiting_[conn] = missing;
  }
}

void StoreEngine::onCancelWait(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  clearWait(conn);
  out.push_back({conn, u8Reply(static_cast<std::uint8_t>(WaitResponse::WaitCanceled))});
}

void StoreEngine::onGetNumKeys(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  out.push_back({conn, Writer().i64(static_cast<std::int64_t>(data_.size())).take()});
}

void StoreEngine::onDeleteKey(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  auto it = data_.find(q.key);
  std::int64_t n = 0;
  if (it != data_.end()) {
    if (watchers_.count(q.key)) notifyWatchers(q.key, WatchResponse::KeyDeleted, it->second, {}, out);
    erase(it);
    owners_.erase(q.key);
    n = 1;
  }
  out.push_back({conn, Writer().i64(n).take()});
}

void StoreEngine::onWatchKey(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  auto& watching = watchers_[q.key];
  if (std::find(watching.begin(), watching.end(), conn) == watching.end()) {
    std::size_t& n = watchCount_[conn];
    if (n >= limits_.maxWatchesPerConnection) {
      if (watching.empty()) watchers_.erase(q.key);
      throw std::invalid_argument("WATCH_KEY: more than " + std::to_string(limits_.maxWatchesPerConnection) +
                                  " watched keys on one connection");
    }
    ++n;
    watching.push_back(conn);
  }
  out.push_back({conn, u8Reply(static_cast<std::uint8_t>(WatchResponse::CallbackRegistered))});
}

void StoreEngine::onAppend(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  auto it = data_.find(q.key);
  bool created = it == data_.end();
  admit(q, growth(q.key, (created ? 0 : it->second.size()) + q.value.size()));
  if (created) {
    stored_ += q.key.size() + kEntryOverhead;
    data_.emplace(q.key, q.value);
  } else {
    it->second.insert(it->second.end(), q.value.begin(), q.value.end());
  }
  stored_ += q.value.size();
  if (watchers_.count(q.key))
    notifyWatchers(q.key, created ? WatchResponse::KeyCreated : WatchResponse::KeyAppended, {},
                   q.value, out);
  wakeAll(q.key, out);
}

void StoreEngine::onQueuePush(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  admit(q, q.value.size() + kEntryOverhead + (queues_.count(q.key) ? 0 : q.key.size() + kEntryOverhead));
  auto [it, created] = queues_.try_emplace(q.key);
  if (created) stored_ += q.key.size() + kEntryOverhead;
  it->second.push_back(q.value);
  stored_ += q.value.size() + kEntryOverhead;
  wakeOne(q.key, out);
}

void StoreEngine::onQueuePop(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  auto it = queues_.find(q.key);
  Writer w;
  w.i64(it == queues_.end() ? 0 : static_cast<std::int64_t>(it->second.size()));
  if (it != queues_.end()) {
    auto& queue = it->second;
    w.bytes(queue.front());
    stored_ -= queue.front().size() + kEntryOverhead;
    queue.pop_front();
    if (queue.empty()) {
      stored_ -= q.key.size() + kEntryOverhead;
      queues_.erase(it);
    }
  }
  out.push_back({conn, w.take()});
}

void StoreEngine::onQueueLen(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  auto it = queues_.find(q.key);
  std::int64_t n = it == queues_.end() ? 0 : static_cast<std::int64_t>(it->second.size());
  out.push_back({conn, Writer().i64(n).take()});
}

void StoreEngine::onListKeys(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  // c10d's clients and PrefixStores put their own prefixes before it ("/", "/worker/attempt_0/"):
  // it counts at the start of the key or after any "/".
  const std::string_view unlisted(kUnlistedPrefix);
  const std::string inPath = "/" + std::string(unlisted);
  auto listed = [&](const std::string& key) {
    return key.compare(0, unlisted.size(), unlisted) != 0 && key.find(inPath) == std::string::npos;
  };
  std::size_t length = 8, count = 0;
  for (const auto& kv : data_)
    if (listed(kv.first)) length += 8 + kv.first.size(), ++count;
  if (length > limits_.maxReplyLength)
    throw std::invalid_argument("LIST_KEYS would make a reply of " + std::to_string(length) +
                                " bytes, over the limit of " + std::to_string(limits_.maxReplyLength));
  Writer w;
  w.i64(static_cast<std::int64_t>(count));
  for (const auto& kv : data_)
    if (listed(kv.first)) w.str(kv.first);
  out.push_back({conn, w.take()});
}

void StoreEngine::onBarrier(ConnId conn, const protocol::Request& q, std::vector<Reply>& out) {
  std::int64_t count = 1;
  auto it = data_.find(q.key);
  if (it != data_.end()) count = checkedAdd(q.key, parseCounter(q.key, it->second), 1);
  Bytes value = counterBytes(count);
  admit(q, growth(q.key, value.size()));
  if (it == data_.end()) {
    stored_ += q.key.size() + value.size() + kEntryOverhead;
    data_.emplace(q.key, std::move(value));
  } else {
    stored_ = stored_ - it->second.size() + value.size();
    it->second = std::move(value);
  }
  if (count >= q.number) {
    wakeAll(q.key, out);
    out.push_back({conn, u8Reply(static_cast<std::uint8_t>(WaitResponse::StopWaiting))});
  } else {
    clearWait(conn);
    waiters_[q.key].push_back(conn);
    awaiting_[conn] = 1;
  }
}

} // namespace ctorch::store
