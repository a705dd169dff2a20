#include "ctorch/store/tcp_store_protocol.hpp"

#include <stdexcept>

namespace ctorch::store::protocol {

namespace {

// Thrown inside the parser for malformed input; turned into ParseResult::Error.
struct Malformed {
  std::string why;
};

// Reads from a byte range; every read returns false when the range is too short (need more).
class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size, const Limits& limits)
      : data_(data), size_(size), limits_(limits) {}

  std::size_t pos() const { return pos_; }

  template <typename T>
  bool value(T& out) {
    if (size_ - pos_ < sizeof(T)) return false;
    std::memcpy(&out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }

  bool str(std::string& out) {
    std::uint64_t n = 0;
    if (!value(n)) return false;
    if (n > limits_.maxKeyLength)
      throw Malformed{"key of " + std::to_string(n) + " bytes exceeds the limit of " +
                      std::to_string(limits_.maxKeyLength)};
    if (size_ - pos_ < n) return false;
    out.assign(reinterpret_cast<const char*>(data_ + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return true;
  }

  bool bytes(Bytes& out) {
    std::uint64_t n = 0;
    if (!value(n)) return false;
    if (n > limits_.maxValueLength)
      throw Malformed{"value of " + std::to_string(n) + " bytes exceeds the limit of " +
                      std::to_string(limits_.maxValueLength)};
    if (size_ - pos_ < n) return false;
    out.assign(data_ + pos_, data_ + pos_ + n);
    pos_ += static_cast<std::size_t>(n);
    return true;
  }

  bool count(std::uint64_t& n) {
    if (!value(n)) return false;
    if (n > limits_.maxKeyCount)
      throw Malformed{std::to_string(n) + " keys in one request exceed the limit of " +
                      std::to_string(limits_.maxKeyCount)};
    return true;
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  const Limits& limits_;
};

std::optional<Op> legacyOp(std::uint8_t code) {
  switch (static_cast<LegacyQuery>(code)) {
    case LegacyQuery::Set: return Op::Set;
    case LegacyQuery::CompareSet: return Op::CompareSet;
    case LegacyQuery::Get: return Op::Get;
    case LegacyQuery::Add: return Op::Add;
    case LegacyQuery::Check: return Op::Check;
    case LegacyQuery::Wait: return Op::Wait;
    case LegacyQuery::GetNumKeys: return Op::GetNumKeys;
    case LegacyQuery::WatchKey: return Op::WatchKey;
    case LegacyQuery::DeleteKey: return Op::DeleteKey;
    case LegacyQuery::Append: return Op::Append;
    case LegacyQuery::MultiGet: return Op::MultiGet;
    case LegacyQuery::MultiSet: return Op::MultiSet;
    case LegacyQuery::CancelWait: return Op::CancelWait;
  }
  return std::nullopt;
}

std::optional<Op> validatedOp(std::uint8_t code) {
  switch (static_cast<Query>(code)) {
    case Query::Validate: return Op::Validate;
    case Query::Set: return Op::Set;
    case Query::CompareSet: return Op::CompareSet;
    case Query::Get: return Op::Get;
    case Query::Add: return Op::Add;
    case Query::Check: return Op::Check;
    case Query::Wait: return Op::Wait;
    case Query::GetNumKeys: return Op::GetNumKeys;
    case Query::DeleteKey: return Op::DeleteKey;
    case Query::Append: return Op::Append;
    case Query::MultiGet: return Op::MultiGet;
    case Query::MultiSet: return Op::MultiSet;
    case Query::CancelWait: return Op::CancelWait;
    case Query::Ping: return Op::Ping;
    case Query::QueuePush: return Op::QueuePush;
    case Query::QueuePop: return Op::QueuePop;
    case Query::QueueLen: return Op::QueueLen;
    case Query::ListKeys: return Op::ListKeys;
    case Query::Barrier: return Op::Barrier;
  }
  return std::nullopt;
}

// Reads the payload of `op`; false when more bytes are needed.
bool readPayload(Reader& r, Request& q) {
  switch (q.op) {
    case Op::Validate:
    case Op::Ping:
      return r.value(q.nonce);
    case Op::Set:
    case Op::Append:
    case Op::QueuePush:
      return r.str(q.key) && r.bytes(q.value);
    case Op::CompareSet:
      return r.str(q.key) && r.bytes(q.value) && r.bytes(q.desired);
    case Op::Get:
    case Op::WatchKey:
    case Op::DeleteKey:
    case Op::QueuePop:
    case Op::QueueLen:
      return r.str(q.key);
    case Op::Add:
    case Op::Barrier:
      return r.str(q.key) && r.value(q.number);
    case Op::Check:
    case Op::Wait:
    case Op::MultiGet: {
      std::uint64_t n = 0;
      if (!r.count(n)) return false;
      q.keys.resize(static_cast<std::size_t>(n));
      for (auto& k : q.keys)
        if (!r.str(k)) return false;
      return true;
    }
    case Op::MultiSet: {
      std::uint64_t n = 0;
      if (!r.count(n)) return false;
      q.keys.resize(static_cast<std::size_t>(n));
      q.values.resize(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < n; ++i)
        if (!r.str(q.keys[i]) || !r.bytes(q.values[i])) return false;
      return true;
    }
    case Op::GetNumKeys:
    case Op::CancelWait:
    case Op::ListKeys:
      return true;
  }
  return true;
}

} // namespace

const char* opName(Op op) {
  switch (op) {
    case Op::Validate: return "VALIDATE";
    case Op::Set: return "SET";
    case Op::CompareSet: return "COMPARE_SET";
    case Op::Get: return "GET";
    case Op::Add: return "ADD";
    case Op::Check: return "CHECK";
    case Op::Wait: return "WAIT";
    case Op::GetNumKeys: return "GETNUMKEYS";
    case Op::WatchKey: return "WATCH_KEY";
    case Op::DeleteKey: return "DELETE_KEY";
    case Op::Append: return "APPEND";
    case Op::MultiGet: return "MULTI_GET";
    case Op::MultiSet: return "MULTI_SET";
    case Op::CancelWait: return "CANCEL_WAIT";
    case Op::Ping: return "PING";
    case Op::QueuePush: return "QUEUE_PUSH";
    case Op::QueuePop: return "QUEUE_POP";
    case Op::QueueLen: return "QUEUE_LEN";
    case Op::ListKeys: return "LIST_KEYS";
    case Op::Barrier: return "BARRIER";
  }
  return "?";
}

ParseResult parseRequest(Generation& generation, const std::uint8_t* data, std::size_t size,
                         const Limits& limits) {
  ParseResult result;
  if (size == 0) return result;

  Generation gen = generation;
  if (gen == Generation::Unknown) {
    // A validated client opens with 00 CE F7 85 3C. A legacy client's first byte may also be 0
    // (SET), so wait for five bytes before deciding; a legacy SET is at least nine bytes long.
    if (data[0] == 0) {
      if (size < 5) return result;
      std::uint32_t magic = 0;
      std::memcpy(&magic, data + 1, sizeof magic);
      gen = magic == kValidationMagic ? Generation::Validated : Generation::Legacy;
    } else {
      gen = Generation::Legacy;
    }
  }

  const std::uint8_t code = data[0];
  std::optional<Op> op = gen == Generation::Legacy ? legacyOp(code) : validatedOp(code);
  if (!op) {
    result.status = ParseResult::Status::Error;
    result.error = "unknown query code " + std::to_string(code) + " (" +
                   (gen == Generation::Legacy ? "legacy" : "validated") + " protocol)";
    return result;
  }
  Reader reader(data + 1, size - 1, limits);
  result.request.op = *op;
  try {
    if (!readPayload(reader, result.request)) return result;  // NeedMore
  } catch (const Malformed& m) {
    result.status = ParseResult::Status::Error;
    result.error = std::string(opName(*op)) + ": " + m.why;
    return result;
  }
  if (*op == Op::Validate && result.request.nonce != kValidationMagic) {
    result.status = ParseResult::Status::Error;
    result.error = "VALIDATE with a wrong magic number";
    return result;
  }
  generation = gen;
  result.status = ParseResult::Status::Ok;
  result.consumed = 1 + reader.pos();
  return result;
}

std::optional<std::uint8_t> queryCode(Generation generation, Op op) {
  for (int code = 0; code < 256; ++code) {
    auto c = static_cast<std::uint8_t>(code);
    auto mapped = generation == Generation::Legacy ? legacyOp(c) : validatedOp(c);
    if (mapped && *mapped == op) return c;
  }
  return std::nullopt;
}

Bytes encodeRequest(Generation generation, const Request& q) {
  auto code = queryCode(generation, q.op);
  if (!code)
    throw std::invalid_argument(std::string("the ") +
                                (generation == Generation::Legacy ? "legacy" : "validated") +
                                " TCPStore protocol has no " + opName(q.op) + " query");
  Writer w;
  w.u8(*code);
  switch (q.op) {
    case Op::Validate:
    case Op::Ping:
      w.u32(q.nonce);
      break;
    case Op::Set:
    case Op::Append:
    case Op::QueuePush:
      w.str(q.key).bytes(q.value);
      break;
    case Op::CompareSet:
      w.str(q.key).bytes(q.value).bytes(q.desired);
      break;
    case Op::Get:
    case Op::WatchKey:
    case Op::DeleteKey:
    case Op::QueuePop:
    case Op::QueueLen:
      w.str(q.key);
      break;
    case Op::Add:
    case Op::Barrier:
      w.str(q.key).i64(q.number);
      break;
    case Op::Check:
    case Op::Wait:
    case Op::MultiGet:
      w.u64(q.keys.size());
      for (const auto& k : q.keys) w.str(k);
      break;
    case Op::MultiSet:
      w.u64(q.keys.size());
      for (std::size_t i = 0; i < q.keys.size(); ++i) w.str(q.keys[i]).bytes(q.values.at(i));
      break;
    case Op::GetNumKeys:
    case Op::CancelWait:
    case Op::ListKeys:
      break;
  }
  return w.take();
}

Bytes encodeValidate() {
  Request q;
  q.op = Op::Validate;
  q.nonce = kValidationMagic;
  return encodeRequest(Generation::Validated, q);
}

} // namespace ctorch::store::protocol
