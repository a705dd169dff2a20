#include "ctorch/store/tcp_store_protocol.hpp"

#include <algorithm>
#include <stdexcept>

namespace ctorch::store::protocol {

namespace {

// Thrown inside the parser for malformed input; turned into ParseResult::Error.
struct Malformed {
  std::string why;
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

template <typename T>
bool RequestParser::takeValue(const std::uint8_t* data, std::size_t size, std::size_t& pos, T& out) {
  const std::size_t avail = size - pos;
  examined_ += std::min(avail, sizeof(T));
  if (avail < sizeof(T)) return false;
  std::memcpy(&out, data + pos, sizeof(T));
  pos += sizeof(T);
  taken_ += sizeof(T);
  return true;
}

// Reads the u64 length prefix at `pos` without taking it; checks it against `max` and against
// what is left of the request's budget as soon as it is known.
bool RequestParser::takeLength(const std::uint8_t* data, std::size_t size, std::size_t pos,
                               std::uint64_t max, const char* what, std::uint64_t& n) {
  const std::size_t avail = size - pos;
  examined_ += std::min(avail, sizeof n);
  if (avail < sizeof n) return false;
  std::memcpy(&n, data + pos, sizeof n);
  if (n > max)
    throw Malformed{std::string(what) + " of " + std::to_string(n) + " bytes exceeds the limit of " +
                    std::to_string(max) + (std::string(what) == "key" ? " (maxKeyLength)" : " (maxValueLength)")};
  if (n > limits_.maxRequestLength || taken_ + sizeof n + n > limits_.maxRequestLength)
    throw Malformed{"request of more than " + std::to_string(limits_.maxRequestLength) +
                    " bytes (the limit, maxRequestLength)"};
  return true;
}

bool RequestParser::takeString(const std::uint8_t* data, std::size_t size, std::size_t& pos, std::string& out) {
  std::uint64_t n = 0;
  if (!takeLength(data, size, pos, limits_.maxKeyLength, "key", n)) return false;
  if (size - pos - sizeof n < n) return false;
  examined_ += n;
  out.assign(reinterpret_cast<const char*>(data + pos + sizeof n), static_cast<std::size_t>(n));
  pos += sizeof n + static_cast<std::size_t>(n);
  taken_ += sizeof n + static_cast<std::size_t>(n);
  return true;
}

bool RequestParser::takeBytes(const std::uint8_t* data, std::size_t size, std::size_t& pos, Bytes& out) {
  std::uint64_t n = 0;
  if (!takeLength(data, size, pos, limits_.maxValueLength, "value", n)) return false;
  if (size - pos - sizeof n < n) return false;
  examined_ += n;
  const std::uint8_t* from = data + pos + sizeof n;
  out.assign(from, from + n);
  pos += sizeof n + static_cast<std::size_t>(n);
  taken_ += sizeof n + static_cast<std::size_t>(n);
  return true;
}

// Takes the next field of request_ if it is complete; `done` once the request is.
bool RequestParser::takeField(const std::uint8_t* data, std::size_t size, std::size_t& pos, bool& done) {
  Request& q = request_;
  bool took = false;
  switch (q.op) {
    case Op::Validate:
    case Op::Ping:
      took = takeValue(data, size, pos, q.nonce);
      done = took;
      return took;
    case Op::Set:
    case Op::Append:
    case Op::QueuePush:
      took = step_ == 0 ? takeString(data, size, pos, q.key) : takeBytes(data, size, pos, q.value);
      done = took && step_ == 1;
      break;
    case Op::CompareSet:
      took = step_ == 0   ? takeString(data, size, pos, q.key)
             : step_ == 1 ? takeBytes(data, size, pos, q.value)
                          : takeBytes(data, size, pos, q.desired);
      done = took && step_ == 2;
      break;
    case Op::Get:
    case Op::WatchKey:
    case Op::DeleteKey:
    case Op::QueuePop:
    case Op::QueueLen:
      took = takeString(data, size, pos, q.key);
      done = took;
      break;
    case Op::Add:
    case Op::Barrier:
      took = step_ == 0 ? takeString(data, size, pos, q.key) : takeValue(data, size, pos, q.number);
      done = took && step_ == 1;
      break;
    case Op::Check:
    case Op::Wait:
    case Op::MultiGet:
    case Op::MultiSet:
      if (step_ == 0) {
        took = takeValue(data, size, pos, count_);
        if (took && count_ > limits_.maxKeyCount)
          throw Malformed{std::to_string(count_) + " keys in one request exceed the limit of " +
                          std::to_string(limits_.maxKeyCount)};
      } else if (q.op == Op::MultiSet && q.keys.size() > q.values.size()) {
        q.values.emplace_back();
        took = takeBytes(data, size, pos, q.values.back());
        if (!took) q.values.pop_back();
      } else {
        q.keys.emplace_back();
        took = takeString(data, size, pos, q.keys.back());
        if (!took) q.keys.pop_back();
      }
      done = took && q.keys.size() == count_ && (q.op != Op::MultiSet || q.values.size() == count_);
      break;
    case Op::GetNumKeys:
    case Op::CancelWait:
    case Op::ListKeys:
      done = true;
      return true;
  }
  if (took) ++step_;
  return took;
}

ParseResult RequestParser::feed(const std::uint8_t* data, std::size_t size) {
  ParseResult result;
  std::size_t pos = 0;
  if (!inRequest_) {
    if (size == 0) return result;
    Generation gen = generation_;
    if (gen == Generation::Unknown) {
      // A validated client opens with 00 CE F7 85 3C. A legacy client's first byte may also be 0
      // (SET), so wait for five bytes before deciding; a legacy SET is at least nine bytes long.
      if (data[0] == 0) {
        examined_ += std::min<std::size_t>(size, 5);
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
    request_ = Request{};
    request_.op = *op;
    pendingGeneration_ = gen;
    inRequest_ = true;
    step_ = 0;
    count_ = 0;
    taken_ = 1;
    examined_ += 1;
    pos = 1;
  }
  try {
    for (;;) {
      bool done = false;
      if (!takeField(data, size, pos, done)) break;
      if (!done) continue;
      inRequest_ = false;
      taken_ = 0;
      if (request_.op == Op::Validate && request_.nonce != kValidationMagic) {
        result.status = ParseResult::Status::Error;
        result.error = "VALIDATE with a wrong magic number";
        return result;
      }
      generation_ = pendingGeneration_;
      result.status = ParseResult::Status::Ok;
      result.consumed = pos;
      result.request = std::move(request_);
      return result;
    }
  } catch (const Malformed& m) {
    result.status = ParseResult::Status::Error;
    result.error = std::string(opName(request_.op)) + ": " + m.why;
    return result;
  }
  result.consumed = pos;
  return result;
}

ParseResult parseRequest(Generation& generation, const std::uint8_t* data, std::size_t size,
                         const Limits& limits) {
  RequestParser parser(limits, generation);
  ParseResult result = parser.feed(data, size);
  if (result.status == ParseResult::Status::Ok) {
    generation = parser.generation();
  } else if (result.status == ParseResult::Status::NeedMore) {
    result.consumed = 0;
  }
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
