// libFuzzer target for the store's request parser and engine (issue 12): arbitrary bytes, split
// into arbitrary pieces, go through RequestParser exactly as the server feeds it, and every
// request parsed runs on a StoreEngine shared by a few connections. Checks: no crash or UB
// (ASan/UBSan), the incremental parse agrees with the one-shot parseRequest(), the parse work
// stays linear, and the engine only ever throws std::invalid_argument (the server's "drop this
// connection"). Built and run by scripts/fuzz.sh, never by the normal build.
#include "ctorch/store/store_engine.hpp"
#include "ctorch/store/tcp_store_protocol.hpp"

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <vector>

using namespace ctorch::store;
using namespace ctorch::store::protocol;

namespace {

Limits smallLimits() {
  Limits l;  // small, so that the fuzzer reaches the limit checks and allocations stay cheap
  l.maxKeyLength = 256;
  l.maxValueLength = 4096;
  l.maxKeyCount = 64;
  l.maxRequestLength = 16384;
  return l;
}

void check(bool ok) {
  if (!ok) std::abort();
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  // Byte 0: piece size for the drip (1..256) and which connection of three the bytes belong to.
  const std::size_t piece = static_cast<std::size_t>(data[0]) + 1;
  const StoreEngine::ConnId conn = 2 + data[1] % 3;
  data += 2;
  size -= 2;
  const Limits limits = smallLimits();
  StoreEngineLimits engineLimits;
  engineLimits.maxWatchesPerConnection = 8;
  engineLimits.maxReplyLength = 1u << 16;
  StoreEngine engine("/ctorchrun.alive/", engineLimits);
  RequestParser parser(limits);
  Generation oneShotGeneration = Generation::Unknown;
  std::size_t oneShotAt = 0;  // where the one-shot parser expects the next request

  std::vector<std::uint8_t> buffer;
  std::size_t fed = 0, consumedTotal = 0;
  while (fed < size) {
    std::size_t n = std::min(piece, size - fed);
    buffer.insert(buffer.end(), data + fed, data + fed + n);
    fed += n;
    for (;;) {
      ParseResult r = parser.feed(buffer.data(), buffer.size());
      check(r.consumed <= buffer.size());
      buffer.erase(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(r.consumed));
      consumedTotal += r.consumed;
      if (r.status == ParseResult::Status::Error) return 0;
      if (r.status == ParseResult::Status::NeedMore) break;
      // The same request, parsed in one go from where it started, must come out the same.
      ParseResult whole = parseRequest(oneShotGeneration, data + oneShotAt, consumedTotal - oneShotAt, limits);
      check(whole.status == ParseResult::Status::Ok);
      check(whole.consumed == consumedTotal - oneShotAt);
      check(whole.request.op == r.request.op && whole.request.key == r.request.key &&
            whole.request.keys == r.request.keys && whole.request.values == r.request.values &&
            whole.request.value == r.request.value && whole.request.desired == r.request.desired &&
            whole.request.number == r.request.number && whole.request.nonce == r.request.nonce);
      check(oneShotGeneration == parser.generation());
      oneShotAt = consumedTotal;
      std::vector<StoreEngine::Reply> out;
      try {
        engine.execute(conn, r.request, out);
      } catch (const std::invalid_argument&) {
        return 0;  // the server drops the connection
      }
      for (const auto& reply : out) check(reply.bytes.size() <= engineLimits.maxReplyLength + 4096);
      if (r.request.op == Op::Set && (size & 1)) engine.disconnect(conn);
    }
    // Linear work: each byte copied once, plus at most a length prefix per feed.
    check(parser.bytesExamined() <= 9 * fed + 16);
  }
  return 0;
}
