// In-place recovery's control channel (ctorch/contract/control_auth.hpp, control_protocol.hpp): SHA-256
// and HMAC-SHA256 against their published test vectors, and frames that open once, in order, unchanged.
#include "ctorch_catch.hpp"

#include <ctorch/contract/control_auth.hpp>
#include <ctorch/contract/control_protocol.hpp>

#include <string>

namespace auth = ctorch::contract::auth;
namespace cc = ctorch::contract::control;

TEST_CASE("control auth: SHA-256 and HMAC-SHA256 give the published test vectors", "[contract][auth]") {
  auth::Sha256 s;
  s.update("abc");
  CHECK(auth::toHex(s.finish()) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  s.update("");
  CHECK(auth::toHex(s.finish()) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  std::string million(1000000, 'a');  // FIPS 180-2's long message, fed in odd-sized pieces
  for (std::size_t at = 0; at < million.size(); at += 997) s.update(million.data() + at, std::min<std::size_t>(997, million.size() - at));
  CHECK(auth::toHex(s.finish()) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // RFC 4231, test cases 1, 2 and 6 (a key longer than a block).
  CHECK(auth::toHex(auth::hmacSha256(std::string(20, '\x0b'), "Hi There")) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(auth::toHex(auth::hmacSha256("Jefe", "what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(auth::toHex(auth::hmacSha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST_CASE("control auth: the control key is one per job secret and run id, and hex reads back", "[contract][auth]") {
  const std::string key = auth::deriveControlKey("a secret of sixteen+ chars", "run-1");
  CHECK(key.size() == 32);
  CHECK(key != auth::deriveControlKey("a secret of sixteen+ chars", "run-2"));  // a key per run id
  CHECK(key == auth::deriveControlKey("a secret of sixteen+ chars", "run-1"));  // the same on every node
  CHECK(auth::fromHex(auth::toHex(reinterpret_cast<const std::uint8_t*>(key.data()), key.size())) == key);
  CHECK_FALSE(auth::fromHex("abc"));
  CHECK_FALSE(auth::fromHex("zz"));
}

namespace {
struct Pair {  // both ends of one connection after the handshake
  cc::Channel client, server;
  cc::Nonce launch{};
};
Pair handshake(const std::string& clientKey, const std::string& serverKey) {
  const cc::Nonce c = cc::randomNonce(), s = cc::randomNonce(), launch = cc::randomNonce();
  REQUIRE(cc::parseClientHello(cc::clientHello(c)) == c);
  const std::string answer = cc::serverHello(serverKey, c, s, launch);
  const auto verified = cc::verifyServerHello(clientKey, c, answer);
  REQUIRE(verified);
  CHECK(verified->launch == launch);
  return Pair{cc::Channel(clientKey, c, verified->serverNonce, true), cc::Channel(serverKey, c, s, false), launch};
}
cc::Message sample() {
  cc::Message m;
  m.type = cc::Type::kKill;
  m.rank = 3;
  m.incarnation = 0x1122334455667788ull;
  m.generation = 7;
  m.value = -5;
  m.value2 = 1ll << 40;
  m.text = "why";
  return m;
}
bool same(const cc::Message& a, const cc::Message& b) {
  return a.type == b.type && a.rank == b.rank && a.incarnation == b.incarnation && a.generation == b.generation &&
         a.value == b.value && a.value2 == b.value2 && a.text == b.text;
}
}  // namespace

TEST_CASE("control protocol: messages read back exactly, and cut or padded ones are refused", "[contract][auth]") {
  const cc::Message m = sample();
  CHECK(same(cc::decode(cc::encode(m)), m));
  const std::string bytes = cc::encode(m);
  for (std::size_t n = 0; n < bytes.size(); ++n) CHECK_THROWS_AS(cc::decode(bytes.substr(0, n)), cc::ProtocolError);
  CHECK_THROWS_AS(cc::decode(bytes + "x"), cc::ProtocolError);
  cc::Message long_ = m;
  long_.text.assign(cc::kMaxText + 1, 'a');
  CHECK_THROWS_AS(cc::encode(long_), cc::ProtocolError);
}

TEST_CASE("control protocol: the server proves the key bound to the client's nonce, a stranger's proof fails",
          "[contract][auth]") {
  const std::string key = auth::deriveControlKey("a secret of sixteen+ chars", "run-1");
  const cc::Nonce c = cc::randomNonce(), s = cc::randomNonce(), launch = cc::randomNonce();
  const std::string answer = cc::serverHello(key, c, s, launch);
  CHECK(cc::verifyServerHello(key, c, answer));
  CHECK_FALSE(cc::verifyServerHello(std::string(32, 'x'), c, answer));       // another job's key
  CHECK_FALSE(cc::verifyServerHello(key, cc::randomNonce(), answer));        // replayed to another client
  for (std::size_t i = 0; i < answer.size(); ++i) {
    std::string bad = answer;
    bad[i] = static_cast<char>(bad[i] ^ 1);
    CHECK_FALSE(cc::verifyServerHello(key, c, bad));
  }
  CHECK_THROWS_AS(cc::parseClientHello("GET / HTTP/1.1\r\n\r\n!!"), cc::ProtocolError);
  std::string wrongVersion = cc::clientHello(c);
  wrongVersion[4] = 9;
  CHECK_THROWS_AS(cc::parseClientHello(wrongVersion), cc::ProtocolError);
}

TEST_CASE("control protocol: a frame opens once, in order, on its own connection, unchanged", "[contract][auth]") {
  const std::string key = auth::deriveControlKey("a secret of sixteen+ chars", "run-1");
  Pair p = handshake(key, key);
  const std::string first = p.client.seal(sample());
  std::string wire = first + p.client.seal(cc::message(cc::Type::kJoin));
  std::string partial = wire.substr(0, 5);
  CHECK_FALSE(p.server.open(partial));  // incomplete: waits for more, takes nothing
  CHECK(partial.size() == 5);
  auto a = p.server.open(wire);
  REQUIRE(a);
  CHECK(same(*a, sample()));
  auto b = p.server.open(wire);
  REQUIRE(b);
  CHECK(b->type == cc::Type::kJoin);
  CHECK(wire.empty());
  // Replayed on the same connection: the sequence number moved on.
  std::string replay = first;
  CHECK_THROWS_AS(p.server.open(replay), cc::ProtocolError);
  // Recorded on one connection and played into another (another launch, another handshake).
  Pair other = handshake(key, key);
  std::string recorded = p.client.seal(sample());
  CHECK_THROWS_AS(other.server.open(recorded), cc::ProtocolError);
  // Reflected: the server's own frame sent back to it.
  Pair third = handshake(key, key);
  std::string reflected = third.server.seal(sample());
  CHECK_THROWS_AS(third.server.open(reflected), cc::ProtocolError);
  // Any changed byte.
  Pair fourth = handshake(key, key);
  const std::string good = fourth.client.seal(sample());
  for (std::size_t i = 2; i < good.size(); ++i) {
    Pair fresh = handshake(key, key);
    std::string bad = fresh.client.seal(sample());
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    INFO("byte " << i);
    CHECK_THROWS_AS(fresh.server.open(bad), cc::ProtocolError);
  }
  // A frame that claims more than a frame may hold is refused before it is read.
  std::string huge("\xff\xff", 2);
  CHECK_THROWS_AS(p.server.open(huge), cc::ProtocolError);
}
