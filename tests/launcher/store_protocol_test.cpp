// The TCPStore wire protocol without sockets: generation detection and request parsing on byte
// sequences built by hand from the PyTorch sources (TCPStore.cpp's SendBuffer: query byte, u64
// lengths, host-order integers; TCPStoreBackend.hpp's query codes), and the engine's semantics.
#include "ctorch_catch.hpp"

#include "ctorch/store/store.hpp"
#include "ctorch/store/store_engine.hpp"
#include "ctorch/store/tcp_store_protocol.hpp"

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

using namespace ctorch::store;
using namespace ctorch::store::protocol;

namespace {

// Hand-built bytes, independent of the library's encoder.
struct B {
  Bytes b;
  B& u8(std::uint8_t v) {
    b.push_back(v);
    return *this;
  }
  B& u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  B& u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
    return *this;
  }
  B& str(const std::string& s) {
    u64(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
};

ParseResult parseAll(Generation& g, const Bytes& b) { return parseRequest(g, b.data(), b.size()); }

std::int64_t asI64(const Bytes& b) {
  REQUIRE(b.size() == 8);
  std::int64_t v;
  std::memcpy(&v, b.data(), 8);
  return v;
}

Bytes asVector(const Bytes& b) {
  REQUIRE(b.size() >= 8);
  std::uint64_t n;
  std::memcpy(&n, b.data(), 8);
  REQUIRE(b.size() == 8 + n);
  return Bytes(b.begin() + 8, b.end());
}

} // namespace

TEST_CASE("store protocol: a 2.x client's first bytes (VALIDATE + magic) select the validated generation") {
  Generation g = Generation::Unknown;
  Bytes hello = B().u8(0).u32(0x3C85F7CE).b;
  REQUIRE(hello == Bytes({0x00, 0xCE, 0xF7, 0x85, 0x3C}));  // little-endian on the wire
  auto r = parseAll(g, hello);
  REQUIRE(r.status == ParseResult::Status::Ok);
  CHECK(r.consumed == 5);
  CHECK(r.request.op == Op::Validate);
  CHECK(g == Generation::Validated);
}

TEST_CASE("store protocol: a 1.13 client's first message (ADD init/ 1) selects the legacy generation") {
  Generation g = Generation::Unknown;
  Bytes add = B().u8(3).str("init/").u64(1).b;  // 03 | u64 5 | "init/" | i64 1 (strace of 1.13)
  auto r = parseAll(g, add);
  REQUIRE(r.status == ParseResult::Status::Ok);
  CHECK(g == Generation::Legacy);
  CHECK(r.request.op == Op::Add);
  CHECK(r.request.key == "init/");
  CHECK(r.request.number == 1);
  CHECK(r.consumed == add.size());
}

TEST_CASE("store protocol: a legacy SET starting with byte 0 is not mistaken for VALIDATE") {
  Generation g = Generation::Unknown;
  Bytes set = B().u8(0).str("/k").str("v").b;
  // With only four bytes the decision must wait (a validated hello needs five).
  auto partial = parseRequest(g, set.data(), 4);
  CHECK(partial.status == ParseResult::Status::NeedMore);
  CHECK(g == Generation::Unknown);
  auto r = parseAll(g, set);
  REQUIRE(r.status == ParseResult::Status::Ok);
  CHECK(g == Generation::Legacy);
  CHECK(r.request.op == Op::Set);
  CHECK(r.request.key == "/k");
  CHECK(toString(r.request.value) == "v");
}

TEST_CASE("store protocol: every 2.x query code parses with its payload") {
  struct Case {
    std::uint8_t code;
    Op op;
    Bytes payload;
  };
  std::vector<Case> cases = {
      {1, Op::Set, B().str("/a").str("xy").b},
      {2, Op::CompareSet, B().str("/a").str("xy").str("z").b},
      {3, Op::Get, B().str("/a").b},
      {4, Op::Add, B().str("/c").u64(static_cast<std::uint64_t>(-5)).b},
      {5, Op::Check, B().u64(2).str("/a").str("/b").b},
      {6, Op::Wait, B().u64(1).str("/a").b},
      {7, Op::GetNumKeys, {}},
      {8, Op::DeleteKey, B().str("/a").b},
      {9, Op::Append, B().str("/a").str("tail").b},
      {10, Op::MultiGet, B().u64(2).str("/a").str("/b").b},
      {11, Op::MultiSet, B().u64(2).str("/a").str("1").str("/b").str("2").b},
      {12, Op::CancelWait, {}},
      {13, Op::Ping, B().u32(4242).b},
      {14, Op::QueuePush, B().str("/q").str("item").b},
      {15, Op::QueuePop, B().str("/q").b},
      {16, Op::QueueLen, B().str("/q").b},
  };
  for (const auto& c : cases) {
    Generation g = Generation::Validated;
    Bytes msg = B().u8(c.code).b;
    msg.insert(msg.end(), c.payload.begin(), c.payload.end());
    INFO("query code " << int(c.code));
    auto r = parseAll(g, msg);
    REQUIRE(r.status == ParseResult::Status::Ok);
    CHECK(r.request.op == c.op);
    CHECK(r.consumed == msg.size());
    // Every strict prefix is incomplete, never an error: TCP delivers arbitrary fragments.
    for (std::size_t n = 1; n < msg.size(); ++n) {
      Generation g2 = Generation::Validated;
      CHECK(parseRequest(g2, msg.data(), n).status == ParseResult::Status::NeedMore);
    }
    // The library's encoder produces the same bytes.
    CHECK(encodeRequest(Generation::Validated, r.request) == msg);
  }
}

TEST_CASE("store protocol: 1.13 query codes map to the same operations") {
  Generation g = Generation::Legacy;
  CHECK(parseAll(g, B().u8(7).str("/w").b).request.op == Op::WatchKey);
  CHECK(parseAll(g, B().u8(8).str("/w").b).request.op == Op::DeleteKey);
  CHECK(parseAll(g, B().u8(6).b).request.op == Op::GetNumKeys);
  CHECK(parseAll(g, B().u8(1).str("/k").str("").str("v").b).request.op == Op::CompareSet);
  // PING does not exist in the legacy numbering.
  CHECK_THROWS(encodeRequest(Generation::Legacy, Request{Op::Ping}));
}

TEST_CASE("store protocol: unknown codes and oversized lengths are errors / not allocations") {
  Generation g = Generation::Validated;
  CHECK(parseAll(g, B().u8(99).b).status == ParseResult::Status::Error);
  Generation g2 = Generation::Validated;
  auto r = parseAll(g2, B().u8(3).u64(1ull << 40).b);  // a 1 TiB key
  CHECK(r.status == ParseResult::Status::Error);
  CHECK(r.error.find("exceeds") != std::string::npos);
  Generation g3 = Generation::Validated;
  CHECK(parseAll(g3, B().u8(6).u64(1ull << 40).b).status == ParseResult::Status::Error);
}

TEST_CASE("store protocol: two pipelined requests are parsed one after the other") {
  Generation g = Generation::Validated;
  Bytes two = B().u8(1).str("/a").str("1").u8(3).str("/a").b;
  auto r1 = parseAll(g, two);
  REQUIRE(r1.status == ParseResult::Status::Ok);
  auto r2 = parseRequest(g, two.data() + r1.consumed, two.size() - r1.consumed);
  REQUIRE(r2.status == ParseResult::Status::Ok);
  CHECK(r2.request.op == Op::Get);
  CHECK(r1.consumed + r2.consumed == two.size());
}

// ---- The engine -------------------------------------------------------------------------------------

namespace {

struct EngineHarness {
  StoreEngine engine;
  std::vector<StoreEngine::Reply> out;
  Generation gen = Generation::Validated;

  std::vector<StoreEngine::Reply> run(StoreEngine::ConnId conn, const Bytes& msg) {
    Generation g = gen;
    auto r = parseRequest(g, msg.data(), msg.size());
    REQUIRE(r.status == ParseResult::Status::Ok);
    out.clear();
    engine.execute(conn, r.request, out);
    return out;
  }
};

} // namespace

TEST_CASE("store engine: set / get / add and their replies") {
  EngineHarness h;
  CHECK(h.run(1, B().u8(1).str("/a").str("hello").b).empty());  // SET has no reply
  auto get = h.run(1, B().u8(3).str("/a").b);
  REQUIRE(get.size() == 1);
  CHECK(toString(asVector(get[0].bytes)) == "hello");
  CHECK(asI64(h.run(1, B().u8(4).str("/n").u64(5).b)[0].bytes) == 5);
  CHECK(asI64(h.run(1, B().u8(4).str("/n").u64(static_cast<std::uint64_t>(-2)).b)[0].bytes) == 3);
  CHECK(toString(*h.engine.peek("/n")) == "3");  // counters are decimal text, as c10d
  CHECK(asI64(h.run(1, B().u8(7).b)[0].bytes) == 2);  // GETNUMKEYS
}

TEST_CASE("store engine: compare_set follows c10d (missing key / match / mismatch)") {
  EngineHarness h;
  // Missing key with an empty expected value: created.
  CHECK(toString(asVector(h.run(1, B().u8(2).str("/k").str("").str("v1").b)[0].bytes)) == "v1");
  // Mismatch: the current value comes back, nothing changes.
  CHECK(toString(asVector(h.run(1, B().u8(2).str("/k").str("zz").str("v2").b)[0].bytes)) == "v1");
  // Match: swapped.
  CHECK(toString(asVector(h.run(1, B().u8(2).str("/k").str("v1").str("v2").b)[0].bytes)) == "v2");
  // Missing key with a non-empty expected value: c10d replies with `expected` and stores nothing.
  CHECK(toString(asVector(h.run(1, B().u8(2).str("/m").str("x").str("y").b)[0].bytes)) == "x");
  CHECK_FALSE(h.engine.peek("/m"));
}

TEST_CASE("store engine: wait blocks until every key exists / then wakes exactly once") {
  EngineHarness h;
  CHECK(h.run(7, B().u8(6).u64(2).str("/a").str("/b").b).empty());  // blocked
  CHECK(h.engine.waitingConnections() == 1);
  CHECK(h.run(1, B().u8(1).str("/a").str("1").b).empty());  // one of two
  auto wake = h.run(1, B().u8(1).str("/b").str("2").b);
  REQUIRE(wake.size() == 1);
  CHECK(wake[0].conn == 7);
  CHECK(wake[0].bytes == Bytes{0});  // STOP_WAITING
  CHECK(h.engine.waitingConnections() == 0);
  // Already present: immediate reply.
  auto now = h.run(7, B().u8(6).u64(1).str("/a").b);
  REQUIRE(now.size() == 1);
  CHECK(now[0].bytes == Bytes{0});
}

TEST_CASE("store engine: cancel_wait (2.x) ends a wait with WAIT_CANCELED and forgets it") {
  EngineHarness h;
  h.run(7, B().u8(6).u64(1).str("/never").b);
  auto c = h.run(7, B().u8(12).b);
  REQUIRE(c.size() == 1);
  CHECK(c[0].bytes == Bytes{1});  // WAIT_CANCELED
  CHECK(h.run(1, B().u8(1).str("/never").str("x").b).empty());  // no late STOP_WAITING
}

TEST_CASE("store engine: a closed connection's waits are forgotten") {
  EngineHarness h;
  h.run(7, B().u8(6).u64(1).str("/k").b);
  h.engine.disconnect(7);
  CHECK(h.engine.waitingConnections() == 0);
  CHECK(h.run(1, B().u8(1).str("/k").str("x").b).empty());
}

TEST_CASE("store engine: check / delete / append / multi_get/multi_set / ping") {
  EngineHarness h;
  CHECK(h.run(1, B().u8(5).u64(1).str("/a").b)[0].bytes == Bytes{1});  // NOT_READY
  h.run(1, B().u8(11).u64(2).str("/a").str("1").str("/b").str("2").b);
  CHECK(h.run(1, B().u8(5).u64(2).str("/a").str("/b").b)[0].bytes == Bytes{0});  // READY
  h.run(1, B().u8(9).str("/a").str("23").b);
  auto mg = h.run(1, B().u8(10).u64(2).str("/a").str("/b").b);
  REQUIRE(mg.size() == 1);
  CHECK(mg[0].bytes == B().str("123").str("2").b);
  CHECK(asI64(h.run(1, B().u8(8).str("/a").b)[0].bytes) == 1);
  CHECK(asI64(h.run(1, B().u8(8).str("/a").b)[0].bytes) == 0);
  CHECK(h.run(1, B().u8(13).u32(0xDEADBEEF).b)[0].bytes == B().u32(0xDEADBEEF).b);  // nonce echo
}

TEST_CASE("store engine: queues (2.x) push / pop with length / len / and wake one blocked popper") {
  EngineHarness h;
  // A blocking pop waits on the queue key first (client: WAIT then QUEUE_POP).
  CHECK(h.run(5, B().u8(6).u64(1).str("/q").b).empty());
  CHECK(h.run(6, B().u8(6).u64(1).str("/q").b).empty());
  auto push = h.run(1, B().u8(14).str("/q").str("one").b);
  REQUIRE(push.size() == 1);  // exactly one waiter wakes per element
  CHECK(push[0].conn == 5);
  CHECK(asI64(h.run(1, B().u8(16).str("/q").b)[0].bytes) == 1);
  auto pop = h.run(5, B().u8(15).str("/q").b);
  CHECK(pop[0].bytes == B().u64(1).str("one").b);  // i64 size before the pop, then the value
  auto empty = h.run(5, B().u8(15).str("/q").b);
  CHECK(empty[0].bytes == B().u64(0).b);
}

TEST_CASE("store engine: legacy watch_key gets registration and change notifications") {
  EngineHarness h;
  h.gen = Generation::Legacy;
  auto reg = h.run(9, B().u8(7).str("/w").b);
  REQUIRE(reg.size() == 1);
  CHECK(reg[0].bytes == Bytes{3});  // KEY_CALLBACK_REGISTERED
  auto created = h.run(1, B().u8(0).str("/w").str("v1").b);
  REQUIRE(created.size() == 1);
  CHECK(created[0].conn == 9);
  CHECK(created[0].bytes == B().u8(1).str("/w").str("").str("v1").b);  // KEY_CREATED old new
  auto updated = h.run(1, B().u8(0).str("/w").str("v2").b);
  CHECK(updated[0].bytes == B().u8(0).str("/w").str("v1").str("v2").b);
  auto deleted = h.run(1, B().u8(8).str("/w").b);
  REQUIRE(deleted.size() == 2);  // the notification, then the reply
  CHECK(deleted[0].bytes == B().u8(2).str("/w").str("v2").str("").b);
}

TEST_CASE("store engine: ADD on a non-integer value drops the request (c10d closes the connection)") {
  EngineHarness h;
  h.run(1, B().u8(1).str("/s").str("text").b);
  Generation g = Generation::Validated;
  Bytes add = B().u8(4).str("/s").u64(1).b;
  auto r = parseRequest(g, add.data(), add.size());
  std::vector<StoreEngine::Reply> out;
  CHECK_THROWS_WITH(h.engine.execute(1, r.request, out), Catch::Contains("not an integer"));
}

// PyTorch 2.1 (torch/csrc/distributed/c10d/TCPStoreBackend.hpp of 2.1): no VALIDATE handshake yet
// (it came in 2.2, PR #107607) but WATCH_KEY already removed (PR #105014), so codes 0..6 are the
// 1.13 ones and 7..11 are DELETE_KEY, APPEND, MULTI_GET, MULTI_SET, CANCEL_WAIT. Nothing on the
// wire tells a 2.1 client from a 1.13 one (docs/launcher.md, "The native TCPStore").
TEST_CASE("store protocol: a PyTorch 2.1 client is served for everything a worker bootstrap sends (codes 0 to 6)") {
  EngineHarness h;
  h.gen = Generation::Legacy;  // what the server decides for a 2.1 client's first bytes
  Generation g = Generation::Unknown;
  Bytes init = B().u8(3).str("/init/").u64(1).b;  // 2.1's TCPStore(..., world_size) sends ADD(3) first
  REQUIRE(parseAll(g, init).status == ParseResult::Status::Ok);
  CHECK(g == Generation::Legacy);
  CHECK(asI64(h.run(1, init)[0].bytes) == 1);                                   // ADD 3
  CHECK(h.run(1, B().u8(0).str("/a").str("v").b).empty());                     // SET 0
  CHECK(toString(asVector(h.run(1, B().u8(2).str("/a").b)[0].bytes)) == "v");  // GET 2
  CHECK(toString(asVector(h.run(1, B().u8(1).str("/a").str("v").str("w").b)[0].bytes)) == "w");  // COMPARE_SET 1
  CHECK(h.run(1, B().u8(4).u64(1).str("/a").b)[0].bytes == Bytes{0});          // CHECK 4: READY
  CHECK(h.run(1, B().u8(5).u64(1).str("/a").b)[0].bytes == Bytes{0});          // WAIT 5: STOP_WAITING
  CHECK(asI64(h.run(1, B().u8(6).b)[0].bytes) == 2);                           // GETNUMKEYS 6
  // The documented limit: 2.1's DELETE_KEY (7) is 1.13's WATCH_KEY here, and answered as such
  // (one registration byte, not the int64 a 2.1 client waits for).
  auto del = h.run(1, B().u8(7).str("/a").b);
  REQUIRE(del.size() == 1);
  CHECK(del[0].bytes == Bytes{static_cast<std::uint8_t>(WatchResponse::CallbackRegistered)});
}

// Issue 12: ADD past INT64_MAX was a signed overflow (UBSan) that wrapped the counter; the same
// for a BARRIER count. Refused like a non-integer value (the server drops that connection), and
// the stored counter keeps its value.
TEST_CASE("store engine: ADD or BARRIER past the 64-bit range is refused and the counter is unchanged") {
  EngineHarness h;
  const auto max = static_cast<std::uint64_t>(INT64_MAX);
  CHECK(asI64(h.run(1, B().u8(4).str("/n").u64(max).b)[0].bytes) == INT64_MAX);
  Generation g = Generation::Validated;
  std::vector<StoreEngine::Reply> out;
  Bytes up = B().u8(4).str("/n").u64(1).b;
  CHECK_THROWS_WITH(h.engine.execute(1, parseRequest(g, up.data(), up.size()).request, out),
                    Catch::Contains("overflows"));
  CHECK(toString(*h.engine.peek("/n")) == std::to_string(INT64_MAX));
  // Downwards too.
  h.run(1, B().u8(1).str("/m").str(std::to_string(INT64_MIN)).b);
  Bytes down = B().u8(4).str("/m").u64(static_cast<std::uint64_t>(-1)).b;
  CHECK_THROWS_WITH(h.engine.execute(1, parseRequest(g, down.data(), down.size()).request, out),
                    Catch::Contains("overflows"));
  // BARRIER counts with +1.
  h.run(1, B().u8(1).str("/b").str(std::to_string(INT64_MAX)).b);
  Bytes barrier = B().u8(18).str("/b").u64(2).b;
  CHECK_THROWS_WITH(h.engine.execute(1, parseRequest(g, barrier.data(), barrier.size()).request, out),
                    Catch::Contains("overflows"));
  CHECK(out.empty());
  CHECK(h.engine.waitingConnections() == 0);
}

// Issue 12: a partial request was re-parsed from its start on every read (quadratic in its size).
// The incremental parser takes whole fields once; a request dripped one byte at a time costs a few
// looks at each length prefix, not a re-scan.
TEST_CASE("store protocol: a request dripped byte by byte is parsed once (work proportional to its size)") {
  B big;
  big.u8(11).u64(300);  // MULTI_SET of 300 keys
  for (int i = 0; i < 300; ++i) big.str("/k" + std::to_string(i)).str(std::string(100, 'v'));
  const Bytes& all = big.b;
  RequestParser parser(Limits{}, Generation::Validated);
  Bytes pending;
  std::optional<ParseResult> done;
  for (std::size_t i = 0; i < all.size(); ++i) {
    pending.push_back(all[i]);
    ParseResult r = parser.feed(pending.data(), pending.size());
    REQUIRE(r.status != ParseResult::Status::Error);
    pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(r.consumed));
    if (r.status == ParseResult::Status::Ok) {
      CHECK(i + 1 == all.size());
      done = std::move(r);
    }
  }
  REQUIRE(done);
  CHECK(pending.empty());
  CHECK(done->request.op == Op::MultiSet);
  REQUIRE(done->request.keys.size() == 300);
  CHECK(done->request.keys[299] == "/k299");
  CHECK(done->request.values[299] == Bytes(100, 'v'));
  // One byte at a time, each call looks at most at an 8-byte length prefix besides the field it
  // completes: at most 9 looks per byte. A re-parse from the start would be ~size^2/2 = 600x here.
  CHECK(parser.bytesExamined() <= 9 * all.size());
  CHECK(parser.partialLength() == 0);
}

TEST_CASE("store protocol: a request larger than maxRequestLength is refused as soon as a length says so") {
  Limits limits;
  limits.maxRequestLength = 1000;
  RequestParser parser(limits, Generation::Validated);
  Bytes head = B().u8(11).u64(2).str("/a").u64(600).b;  // MULTI_SET, 2 keys, the first value 600 bytes
  Bytes value(600, 'x');
  head.insert(head.end(), value.begin(), value.end());
  ParseResult first = parser.feed(head.data(), head.size());
  REQUIRE(first.status == ParseResult::Status::NeedMore);
  CHECK(first.consumed == head.size());
  Bytes second = B().str("/b").u64(600).b;  // 1 + 8 + 10 + 608 + 10 + 8 + 600 > 1000
  ParseResult r = parser.feed(second.data(), second.size());
  REQUIRE(r.status == ParseResult::Status::Error);
  CHECK_THAT(r.error, Catch::Contains("MULTI_SET") && Catch::Contains("limit"));
}
