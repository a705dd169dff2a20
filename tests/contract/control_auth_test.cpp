// The signature of in-place recovery's commands (ctorch/contract/control_auth.hpp): SHA-256 and
// HMAC-SHA256 against their published test vectors, and signed values that do not survive any change.
#include "ctorch_catch.hpp"

#include <ctorch/contract/control_auth.hpp>

#include <string>

namespace auth = ctorch::contract::auth;

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

TEST_CASE("control auth: a signed command verifies only with its key, under its store key, unchanged", "[contract][auth]") {
  const std::string key = auth::deriveControlKey("a secret of sixteen+ chars", "run-1");
  CHECK(key.size() == 32);
  CHECK(key != auth::deriveControlKey("a secret of sixteen+ chars", "run-2"));  // a key per run id
  CHECK(key == auth::deriveControlKey("a secret of sixteen+ chars", "run-1"));  // the same on every node
  const std::string value = auth::signCommand(key, "ctorch/inplace/evict/rank1", "pid=42\ngeneration=0");
  REQUIRE(auth::verifyCommand(key, "ctorch/inplace/evict/rank1", value) == std::optional<std::string>("pid=42\ngeneration=0"));
  CHECK_FALSE(auth::verifyCommand(key, "ctorch/inplace/evict/rank2", value));                     // another key
  CHECK_FALSE(auth::verifyCommand(std::string(32, 'x'), "ctorch/inplace/evict/rank1", value));     // another job
  CHECK_FALSE(auth::verifyCommand("", "ctorch/inplace/evict/rank1", value));                       // no key: nothing
  CHECK_FALSE(auth::verifyCommand(key, "ctorch/inplace/evict/rank1", "42"));                        // unsigned (old form)
  for (std::size_t i = 0; i < value.size(); ++i) {  // every single changed byte is refused
    std::string bad = value;
    bad[i] = static_cast<char>(bad[i] ^ 1);
    INFO("byte " << i);
    CHECK_FALSE(auth::verifyCommand(key, "ctorch/inplace/evict/rank1", bad));
  }
  CHECK_FALSE(auth::verifyCommand(key, "ctorch/inplace/evict/rank1", value.substr(0, value.size() - 1)));
  CHECK(auth::fromHex(auth::toHex(reinterpret_cast<const std::uint8_t*>(key.data()), key.size())) == key);
  CHECK_FALSE(auth::fromHex("abc"));
  CHECK_FALSE(auth::fromHex("zz"));
}
