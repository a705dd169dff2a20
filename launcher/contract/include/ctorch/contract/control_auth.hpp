// The job's control key and the primitives that prove it: SHA-256 and HMAC-SHA256, with which
// in-place recovery's control channel authenticates both ends and every frame (control_protocol.hpp).
// ctorchrun gives its workers the key in the environment only (CTORCH_CONTROL_KEY) and never writes
// it to a store or a log. It comes from CTORCH_JOB_SECRET (the same on every node) or, on one node,
// from the kernel's random source. Header-only: the launcher and the library share it as part of
// the contract.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace ctorch::contract::auth {

using Digest = std::array<std::uint8_t, 32>;

// ---- SHA-256 (FIPS 180-4) -----------------------------------------------------------------------
class Sha256 {
 public:
  Sha256() { reset(); }
  void reset() {
    h_ = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au, 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    length_ = 0;
    used_ = 0;
  }
  void update(const void* data, std::size_t size) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    length_ += size;
    while (size > 0) {
      const std::size_t take = std::min<std::size_t>(64 - used_, size);
      std::memcpy(block_.data() + used_, p, take);
      used_ += take;
      p += take;
      size -= take;
      if (used_ == 64) {
        compress(block_.data());
        used_ = 0;
      }
    }
  }
  void update(std::string_view s) { update(s.data(), s.size()); }
  Digest finish() {
    const std::uint64_t bits = length_ * 8;
    const std::uint8_t one = 0x80, zero = 0;
    update(&one, 1);
    while (used_ != 56) update(&zero, 1);
    std::uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
    update(len, 8);
    Digest out{};
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<std::uint8_t>(h_[i] >> (24 - 8 * j));
    reset();
    return out;
  }

 private:
  static std::uint32_t rotr(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
  void compress(const std::uint8_t* b) {
    static constexpr std::uint32_t k[64] = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
        0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
        0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
        0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
        0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
        0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
        0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (std::uint32_t{b[4 * i]} << 24) | (std::uint32_t{b[4 * i + 1]} << 16) |
             (std::uint32_t{b[4 * i + 2]} << 8) | std::uint32_t{b[4 * i + 3]};
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = h_[0], bb = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & bb) ^ (a & c) ^ (bb & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = bb;
      bb = a;
      a = t1 + t2;
    }
    h_[0] += a, h_[1] += bb, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g, h_[7] += h;
  }

  std::array<std::uint32_t, 8> h_{};
  std::array<std::uint8_t, 64> block_{};
  std::uint64_t length_ = 0;
  std::size_t used_ = 0;
};

// ---- HMAC-SHA256 (RFC 2104) ----------------------------------------------------------------------
inline Digest hmacSha256(std::string_view key, std::string_view message) {
  std::array<std::uint8_t, 64> k{};
  if (key.size() > 64) {
    Sha256 s;
    s.update(key);
    const Digest d = s.finish();
    std::memcpy(k.data(), d.data(), d.size());
  } else {
    std::memcpy(k.data(), key.data(), key.size());
  }
  std::array<std::uint8_t, 64> ipad{}, opad{};
  for (int i = 0; i < 64; ++i) {
    ipad[i] = static_cast<std::uint8_t>(k[i] ^ 0x36);
    opad[i] = static_cast<std::uint8_t>(k[i] ^ 0x5c);
  }
  Sha256 inner;
  inner.update(ipad.data(), ipad.size());
  inner.update(message);
  const Digest innerDigest = inner.finish();
  Sha256 outer;
  outer.update(opad.data(), opad.size());
  outer.update(innerDigest.data(), innerDigest.size());
  return outer.finish();
}

inline std::string toHex(const std::uint8_t* data, std::size_t size) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * size);
  for (std::size_t i = 0; i < size; ++i) {
    out.push_back(digits[data[i] >> 4]);
    out.push_back(digits[data[i] & 15]);
  }
  return out;
}
inline std::string toHex(const Digest& d) { return toHex(d.data(), d.size()); }

// The bytes of a hex string, or nullopt when it is not one (odd length, other characters).
inline std::optional<std::string> fromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(hex.size() / 2);
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]), lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

// ---- The job's control key and signed commands ------------------------------------------------------
// The variable the launcher gives its workers (hex of 32 bytes): workers sign and check with it.
inline constexpr const char* kControlKeyEnv = "CTORCH_CONTROL_KEY";
// What the user may give every node's ctorchrun (any text of 16 characters or more, the same
// everywhere): needed for in-place recovery across nodes, whose agents must share the key.
inline constexpr const char* kJobSecretEnv = "CTORCH_JOB_SECRET";
inline constexpr std::size_t kMinSecretLength = 16;

// The control key of run `runId` from the job secret: a different key per run id.
inline std::string deriveControlKey(std::string_view secret, std::string_view runId) {
  const Digest d = hmacSha256(secret, std::string("ctorch control key for run ") + std::string(runId));
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace ctorch::contract::auth
