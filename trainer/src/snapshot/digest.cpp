#include "snapshot/digest.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

namespace ctorch {
namespace {

// RFC 7693, section 2.6: the SHA-512 initialisation vector.
constexpr std::uint64_t kIv[8] = {0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL,
                                  0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
                                  0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
                                  0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

inline std::uint64_t rotr(std::uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

inline std::uint64_t load64(const std::uint8_t* p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);  // BLAKE2b words are little-endian: one load
  return v;
#else
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#endif
}

// RFC 7693, section 3.1: the mixing function G on four named words.
#define CTORCH_B2_G(a, b, c, d, x, y) \
  do {                                \
    a = a + b + (x);                  \
    d = rotr(d ^ a, 32);              \
    c = c + d;                        \
    b = rotr(b ^ c, 24);              \
    a = a + b + (y);                  \
    d = rotr(d ^ a, 16);              \
    c = c + d;                        \
    b = rotr(b ^ c, 63);              \
  } while (0)

// One round with its message schedule (RFC 7693, section 2.7) spelled out as constants: with the
// schedule read from a table the compiler keeps the message words in memory and indexes them, and
// the whole function ran at half the speed (docs/performance.md, "Figures behind choices in the
// code"; the digest is the snapshot writer's longest pass and the whole cost of verifying a load).
#define CTORCH_B2_ROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
  do {                                                                                       \
    CTORCH_B2_G(v0, v4, v8, v12, m[s0], m[s1]);                                              \
    CTORCH_B2_G(v1, v5, v9, v13, m[s2], m[s3]);                                              \
    CTORCH_B2_G(v2, v6, v10, v14, m[s4], m[s5]);                                             \
    CTORCH_B2_G(v3, v7, v11, v15, m[s6], m[s7]);                                             \
    CTORCH_B2_G(v0, v5, v10, v15, m[s8], m[s9]);                                             \
    CTORCH_B2_G(v1, v6, v11, v12, m[s10], m[s11]);                                           \
    CTORCH_B2_G(v2, v7, v8, v13, m[s12], m[s13]);                                            \
    CTORCH_B2_G(v3, v4, v9, v14, m[s14], m[s15]);                                            \
  } while (0)

} // namespace

Blake2b::Blake2b(std::size_t digestSize) : digestSize_(digestSize) {
  if (digestSize < 1 || digestSize > 64)
    throw std::invalid_argument("Blake2b: digest size must be 1..64 bytes, got " +
                                std::to_string(digestSize));
  for (int i = 0; i < 8; ++i) h_[i] = kIv[i];
  h_[0] ^= 0x01010000ULL ^ static_cast<std::uint64_t>(digestSize);  // no key, fanout 1, depth 1
}

void Blake2b::compress(const std::uint8_t* block, bool last) {
  std::uint64_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load64(block + 8 * i);
  std::uint64_t v0 = h_[0], v1 = h_[1], v2 = h_[2], v3 = h_[3];
  std::uint64_t v4 = h_[4], v5 = h_[5], v6 = h_[6], v7 = h_[7];
  std::uint64_t v8 = kIv[0], v9 = kIv[1], v10 = kIv[2], v11 = kIv[3];
  std::uint64_t v12 = kIv[4] ^ counterLow_, v13 = kIv[5] ^ counterHigh_;
  std::uint64_t v14 = last ? ~kIv[6] : kIv[6], v15 = kIv[7];
  CTORCH_B2_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  CTORCH_B2_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
  CTORCH_B2_ROUND(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
  CTORCH_B2_ROUND(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
  CTORCH_B2_ROUND(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
  CTORCH_B2_ROUND(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
  CTORCH_B2_ROUND(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
  CTORCH_B2_ROUND(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
  CTORCH_B2_ROUND(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
  CTORCH_B2_ROUND(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
  CTORCH_B2_ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);  // rounds 10 and 11
  CTORCH_B2_ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);  // reuse 0 and 1
  h_[0] ^= v0 ^ v8;
  h_[1] ^= v1 ^ v9;
  h_[2] ^= v2 ^ v10;
  h_[3] ^= v3 ^ v11;
  h_[4] ^= v4 ^ v12;
  h_[5] ^= v5 ^ v13;
  h_[6] ^= v6 ^ v14;
  h_[7] ^= v7 ^ v15;
}

#undef CTORCH_B2_ROUND
#undef CTORCH_B2_G

void Blake2b::update(const void* data, std::size_t size) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  auto addCounter = [this](std::uint64_t n) {
    counterLow_ += n;
    if (counterLow_ < n) ++counterHigh_;
  };
  while (size > 0) {
    // The final block must be compressed with the "last" flag, so a full buffer is only
    // compressed once more input is known to follow.
    if (buffered_ == buffer_.size()) {
      addCounter(buffer_.size());
      compress(buffer_.data(), false);
      buffered_ = 0;
    }
    if (buffered_ == 0) {
      while (size > buffer_.size()) {  // whole blocks straight from the input
        addCounter(buffer_.size());
        compress(p, false);
        p += buffer_.size();
        size -= buffer_.size();
      }
    }
    const std::size_t take = std::min(size, buffer_.size() - buffered_);
    std::memcpy(buffer_.data() + buffered_, p, take);
    buffered_ += take;
    p += take;
    size -= take;
  }
}

std::string Blake2b::hexDigest() {
  counterLow_ += buffered_;
  if (counterLow_ < buffered_) ++counterHigh_;
  std::fill(buffer_.begin() + static_cast<std::ptrdiff_t>(buffered_), buffer_.end(), 0);
  compress(buffer_.data(), true);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(2 * digestSize_);
  for (std::size_t i = 0; i < digestSize_; ++i) {
    const auto byte = static_cast<std::uint8_t>(h_[i / 8] >> (8 * (i % 8)));
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 15]);
  }
  return out;
}

// ---- Canonical encoding (docs/snapshot.md, "Content digest") -------------------------------------
namespace {

// Python's dtype name without the "torch." prefix.
std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kByte: return "uint8";
    case at::kChar: return "int8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    default: return std::string("other:") + c10::toString(t);
  }
}

class Encoder {
 public:
  explicit Encoder(Blake2b& hash) : hash_(hash) {}

  void encode(const c10::IValue& v, const std::string& where) {
    if (v.isNone()) {
      tag('N');
    } else if (v.isBool()) {
      tag('B');
      const std::uint8_t b = v.toBool() ? 1 : 0;
      hash_.update(&b, 1);
    } else if (v.isInt()) {
      tag('I');
      u64(static_cast<std::uint64_t>(v.toInt()));
    } else if (v.isDouble()) {
      tag('F');
      const double d = v.toDouble();
      std::uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      u64(bits);
    } else if (v.isString()) {
      tag('S');
      str(v.toStringRef());
    } else if (v.isTensor()) {
      tensor(v.toTensor());
    } else if (v.isList()) {
      const auto list = v.toListRef();
      tag('L');
      u64(list.size());
      for (std::size_t i = 0; i < list.size(); ++i)
        encode(list[i], where + "[" + std::to_string(i) + "]");
    } else if (v.isTuple()) {
      const auto& elements = v.toTupleRef().elements();
      tag('U');
      u64(elements.size());
      for (std::size_t i = 0; i < elements.size(); ++i)
        encode(elements[i], where + "[" + std::to_string(i) + "]");
    } else if (v.isGenericDict()) {
      dict(v.toGenericDict(), where);
    } else {
      throw std::invalid_argument(where + " has type " + v.tagKind() +
                                  ", which a snapshot cannot hold (allowed: None, bool, int, "
                                  "float, str, Tensor, list, tuple, dict)");
    }
  }

 private:
  void tag(char c) { hash_.update(&c, 1); }
  void u64(std::uint64_t x) {
    std::uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(x >> (8 * i));
    hash_.update(b, 8);
  }
  void str(const std::string& s) {
    u64(s.size());
    hash_.update(s.data(), s.size());
  }

  void tensor(const at::Tensor& t) {
    tag('T');
    str(dtypeName(t.scalar_type()));
    u64(static_cast<std::uint64_t>(t.dim()));
    for (auto size : t.sizes()) u64(static_cast<std::uint64_t>(size));
    at::Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
    const std::size_t bytes = static_cast<std::size_t>(c.numel()) * c.element_size();
    u64(bytes);
    if (bytes > 0) hash_.update(c.data_ptr(), bytes);
  }

  // Entries in the byte order of their encoded keys: independent of insertion order, and easy to
  // reproduce in Python (sorted by the encoded key).
  void dict(const c10::impl::GenericDict& d, const std::string& where) {
    std::vector<std::pair<std::string, c10::IValue>> entries;
    entries.reserve(d.size());
    for (const auto& entry : d) {
      KeyEncoder keyEncoder;
      keyEncoder.encode(entry.key(), where);
      entries.emplace_back(std::move(keyEncoder.bytes), entry.value());
    }
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    tag('D');
    u64(entries.size());
    for (const auto& [key, value] : entries) {
      hash_.update(key);
      encode(value, where + "[" + keyLabel(key) + "]");
    }
  }

  // Dict keys are str, int or bool (what Python's state dicts use); their encodings are short.
  struct KeyEncoder {
    std::string bytes;
    void encode(const c10::IValue& k, const std::string& where) {
      if (k.isString()) {
        bytes.push_back('S');
        put(k.toStringRef().size());
        bytes += k.toStringRef();
      } else if (k.isInt()) {
        bytes.push_back('I');
        put(static_cast<std::uint64_t>(k.toInt()));
      } else if (k.isBool()) {
        bytes.push_back('B');
        bytes.push_back(k.toBool() ? 1 : 0);
      } else {
        throw std::invalid_argument(where + " has a dict key of type " + k.tagKind() +
                                    " (allowed: str, int, bool)");
      }
    }
    void put(std::uint64_t x) {
      for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(x >> (8 * i)));
    }
  };

  static std::string keyLabel(const std::string& encodedKey) {
    if (!encodedKey.empty() && encodedKey[0] == 'S') return "'" + encodedKey.substr(9) + "'";
    if (!encodedKey.empty() && encodedKey[0] == 'I') {
      std::uint64_t x = 0;
      for (int i = 7; i >= 0; --i) x = (x << 8) | static_cast<std::uint8_t>(encodedKey[1 + i]);
      return std::to_string(static_cast<std::int64_t>(x));
    }
    return encodedKey.size() > 1 && encodedKey[1] ? "True" : "False";
  }

  Blake2b& hash_;
};

} // namespace

std::string contentDigest(const c10::IValue& value, const std::string& where) {
  Blake2b hash(32);
  Encoder(hash).encode(value, where);
  return std::string(kDigestAlgorithm) + ":" + hash.hexDigest();
}

} // namespace ctorch
