// Content digests for snapshots: BLAKE2b (RFC 7693; Python's hashlib.blake2b) over a canonical
// encoding of an IValue tree, so the same content has the same digest in C++ and in Python no
// matter how the archive around it was written. docs/snapshot.md specifies the encoding.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace c10 {
struct IValue;
}

namespace ctorch {

// Incremental BLAKE2b without a key; digestSize 1..64 bytes (32 gives "blake2b-256").
class Blake2b {
 public:
  explicit Blake2b(std::size_t digestSize = 32);
  void update(const void* data, std::size_t size);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // Finishes the hash; the object must not be updated afterwards.
  std::string hexDigest();

 private:
  void compress(const std::uint8_t* block, bool last);

  std::array<std::uint64_t, 8> h_{};
  std::array<std::uint8_t, 128> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t counterLow_ = 0, counterHigh_ = 0;
  std::size_t digestSize_;
};

// "blake2b-256:<64 hex digits>" of the canonical encoding of `value`. Supported: None, bool, int,
// double, string, tensor (any dtype, any device: the bytes of its contiguous CPU copy), list,
// tuple, dict. Anything else throws std::invalid_argument naming where it sits (`where` prefixes
// that path, e.g. "USER_STATE").
std::string contentDigest(const c10::IValue& value, const std::string& where = "value");

inline constexpr const char* kDigestAlgorithm = "blake2b-256";

} // namespace ctorch
