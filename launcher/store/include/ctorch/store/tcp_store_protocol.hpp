// The c10d TCPStore wire protocol, both generations, as data: query codes, framing, a pure
// incremental request parser and the reply encoders. The server, the client and the tests share
// it; no sockets here. Integers travel in host order (little-endian on every supported machine);
// strings and byte vectors as u64 length + bytes.
//
// Generation "legacy" (LibTorch/PyTorch 1.x up to 2.0): no handshake, query codes 0..12 with
// WATCH_KEY at 7. Generation "validated" (PyTorch >= 2.2): the first message of every connection is
// VALIDATE(0) + u32 0x3C85F7CE, query codes renumbered (VALIDATE first, no WATCH_KEY) and extended
// (PING, queues, ...). The server tells them apart on each connection's first bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::store::protocol {

using Bytes = std::vector<std::uint8_t>;

inline constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;

enum class Generation : std::uint8_t { Unknown, Legacy, Validated };

// LibTorch/PyTorch 1.13 (0..8) and 2.0 (9..12) query codes.
enum class LegacyQuery : std::uint8_t {
  Set = 0, CompareSet = 1, Get = 2, Add = 3, Check = 4, Wait = 5, GetNumKeys = 6, WatchKey = 7,
  DeleteKey = 8, Append = 9, MultiGet = 10, MultiSet = 11, CancelWait = 12,
};

// PyTorch >= 2.2 query codes (torch/csrc/distributed/c10d/TCPStoreBackend.hpp). ListKeys and
// Barrier follow QueueLen in the newest libuv backend's dispatch order.
enum class Query : std::uint8_t {
  Validate = 0, Set = 1, CompareSet = 2, Get = 3, Add = 4, Check = 5, Wait = 6, GetNumKeys = 7,
  DeleteKey = 8, Append = 9, MultiGet = 10, MultiSet = 11, CancelWait = 12, Ping = 13,
  QueuePush = 14, QueuePop = 15, QueueLen = 16, ListKeys = 17, Barrier = 18,
};

enum class CheckResponse : std::uint8_t { Ready = 0, NotReady = 1 };
enum class WaitResponse : std::uint8_t { StopWaiting = 0, WaitCanceled = 1 };
enum class WatchResponse : std::uint8_t {
  KeyUpdated = 0, KeyCreated = 1, KeyDeleted = 2, CallbackRegistered = 3, KeyAppended = 4,
};

// The operation a request asks for, independent of the generation that encoded it.
enum class Op : std::uint8_t {
  Validate, Set, CompareSet, Get, Add, Check, Wait, GetNumKeys, WatchKey, DeleteKey, Append,
  MultiGet, MultiSet, CancelWait, Ping, QueuePush, QueuePop, QueueLen, ListKeys, Barrier,
};

const char* opName(Op op);

struct Request {
  Op op = Op::Get;
  std::string key;                 // single-key ops
  std::vector<std::string> keys;   // Check, Wait, MultiGet, MultiSet
  Bytes value;                     // Set, Append, QueuePush; CompareSet: expected
  Bytes desired;                   // CompareSet
  std::vector<Bytes> values;       // MultiSet
  std::int64_t number = 0;         // Add: delta; Barrier: world size
  std::uint32_t nonce = 0;         // Validate: magic; Ping: nonce
};

// Bounds on what a peer may make the server allocate. The libuv backend (PyTorch >= 2.4's default
// server) caps keys at 8 KiB and payloads at 8 MiB; ours are looser because 1.13 clients had no
// caps at all, but no value c10d, Gloo, NCCL or torchelastic stores comes near 16 MiB (their
// keys hold addresses, unique ids, rendezvous state: bytes to kilobytes).
struct Limits {
  std::size_t maxKeyLength = 1u << 20;           // 1 MiB
  std::size_t maxValueLength = 16u << 20;        // 16 MiB
  std::size_t maxKeyCount = 128u * 1024u;
  // A whole request (MULTI_SET, CHECK, ... add up their keys and values): the largest value with
  // its key and some room, so that one request never holds more than about one maximal value.
  std::size_t maxRequestLength = 18u << 20;      // 18 MiB
};

struct ParseResult {
  enum class Status { NeedMore, Ok, Error } status = Status::NeedMore;
  // Ok: bytes of the request. NeedMore: 0 from parseRequest(); from RequestParser::feed(), the
  // bytes of complete fields it has taken (the caller drops them either way).
  std::size_t consumed = 0;
  Request request;            // Ok only
  std::string error;          // Error only
};

// One connection's incremental parser. It takes whole fields only and keeps the request built so
// far, so a request that arrives a few bytes at a time is never re-parsed from its start: every
// byte is copied once, and an incomplete field costs a look at its length prefix per call. Sizes
// are checked against `Limits` as soon as a length is known, before anything is allocated.
class RequestParser {
 public:
  explicit RequestParser(Limits limits = {}, Generation generation = Generation::Unknown)
      : limits_(limits), generation_(generation) {}

  // Parses from the front of `data` (what arrived after the bytes consumed so far). With
  // generation Unknown the first message decides: VALIDATE + magic makes the connection
  // Validated (and is returned as a Validate request), anything else makes it Legacy. After an
  // Error the parser must not be fed again (the connection is dropped).
  ParseResult feed(const std::uint8_t* data, std::size_t size);

  Generation generation() const { return generation_; }
  // Bytes of the request in progress taken so far (0 between requests).
  std::size_t partialLength() const { return taken_; }
  // Bytes looked at since construction (copied, or inspected and left for later): the parse work,
  // which stays proportional to the bytes fed however they are split.
  std::uint64_t bytesExamined() const { return examined_; }

 private:
  bool takeField(const std::uint8_t* data, std::size_t size, std::size_t& pos, bool& done);
  bool takeLength(const std::uint8_t* data, std::size_t size, std::size_t pos, std::uint64_t max,
                  const char* what, std::uint64_t& n);
  bool takeString(const std::uint8_t* data, std::size_t size, std::size_t& pos, std::string& out);
  bool takeBytes(const std::uint8_t* data, std::size_t size, std::size_t& pos, Bytes& out);
  template <typename T>
  bool takeValue(const std::uint8_t* data, std::size_t size, std::size_t& pos, T& out);

  Limits limits_;
  Generation generation_;
  Generation pendingGeneration_ = Generation::Unknown;  // decided by the request in progress
  bool inRequest_ = false;
  Request request_;
  std::size_t step_ = 0;       // fields of request_ taken so far
  std::uint64_t count_ = 0;    // Check / Wait / MultiGet / MultiSet: number of keys
  std::size_t taken_ = 0;
  std::uint64_t examined_ = 0;
};

// Parses one request from the front of `data`, stateless (a fresh RequestParser fed once):
// NeedMore consumes nothing. `generation` is updated in place once decided.
ParseResult parseRequest(Generation& generation, const std::uint8_t* data, std::size_t size,
                         const Limits& limits = {});

// ---- Encoding (server replies, client requests) -----------------------------------------------
class Writer {
 public:
  Writer& u8(std::uint8_t v) { bytes_.push_back(v); return *this; }
  Writer& u32(std::uint32_t v) { return raw(&v, sizeof v); }
  Writer& u64(std::uint64_t v) { return raw(&v, sizeof v); }
  Writer& i64(std::int64_t v) { return raw(&v, sizeof v); }
  Writer& str(const std::string& s) { u64(s.size()); return raw(s.data(), s.size()); }
  Writer& bytes(const Bytes& b) { u64(b.size()); return raw(b.data(), b.size()); }
  Writer& raw(const void* p, std::size_t n) {
    const auto* c = static_cast<const std::uint8_t*>(p);
    bytes_.insert(bytes_.end(), c, c + n);
    return *this;
  }
  Bytes take() { return std::move(bytes_); }
  const Bytes& bytes() const { return bytes_; }

 private:
  Bytes bytes_;
};

// The query code `op` has in `generation` (nullopt: that generation cannot express it).
std::optional<std::uint8_t> queryCode(Generation generation, Op op);

// Encodes a request as a client of `generation` would send it (without the handshake).
Bytes encodeRequest(Generation generation, const Request& request);

// The handshake a validated client sends first.
Bytes encodeValidate();

} // namespace ctorch::store::protocol
