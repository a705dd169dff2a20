#include "snapshot/zip_check.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>

namespace ctorch::detail {
namespace {

constexpr std::uint32_t kLocalHeaderSig = 0x04034b50;    // PK\3\4
constexpr std::uint32_t kCentralHeaderSig = 0x02014b50;  // PK\1\2
constexpr std::uint32_t kEndSig = 0x06054b50;            // PK\5\6
constexpr std::uint32_t kEnd64Sig = 0x06064b50;          // PK\6\6
constexpr std::uint32_t kEnd64LocatorSig = 0x07064b50;   // PK\6\7
constexpr std::size_t kEndSize = 22, kEnd64LocatorSize = 20, kEnd64Size = 56;
constexpr std::size_t kCentralHeaderSize = 46, kLocalHeaderSize = 30;

struct Reader {
  const unsigned char* data;
  std::size_t size;
  bool has(std::uint64_t offset, std::uint64_t length) const {
    return offset <= size && length <= size - offset;
  }
  std::uint64_t le(std::uint64_t offset, int bytes) const {
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | data[offset + static_cast<std::size_t>(i)];
    return v;
  }
  std::uint16_t u16(std::uint64_t o) const { return static_cast<std::uint16_t>(le(o, 2)); }
  std::uint32_t u32(std::uint64_t o) const { return static_cast<std::uint32_t>(le(o, 4)); }
  std::uint64_t u64(std::uint64_t o) const { return le(o, 8); }
};

std::uint32_t crcOf(const unsigned char* p, std::uint64_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<std::uint64_t>(n, 1u << 30));
    crc = crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

std::string hex8(std::uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

} // namespace

ZipCheckResult checkZipArchive(const char* bytes, std::size_t size) {
  ZipCheckResult result;
  auto fail = [&](ZipProblem::Kind kind, std::string detail) {
    result.problems.push_back({kind, std::move(detail)});
    return result;
  };
  const Reader r{reinterpret_cast<const unsigned char*>(bytes), size};
  if (!r.has(0, 4) || r.u32(0) != kLocalHeaderSig)
    return fail(ZipProblem::Kind::NotZip, "does not start with a zip local file header");

  // The end-of-central-directory record sits at the very end (after an optional comment). If it
  // is not there the file was cut short: a complete torch.save archive always ends with it.
  std::optional<std::uint64_t> endAt;
  if (size >= kEndSize) {
    const std::size_t lowest = size >= kEndSize + 0xFFFF ? size - kEndSize - 0xFFFF : 0;
    for (std::size_t pos = size - kEndSize + 1; pos-- > lowest;) {
      if (r.u32(pos) == kEndSig && pos + kEndSize + r.u16(pos + 20) == size) {
        endAt = pos;
        break;
      }
    }
  }
  if (!endAt)
    return fail(ZipProblem::Kind::Truncated,
                "no end-of-central-directory record at the end of its " + std::to_string(size) +
                    " bytes (the file was cut short)");

  std::uint64_t entries = r.u16(*endAt + 10);
  std::uint64_t directorySize = r.u32(*endAt + 12);
  std::uint64_t directoryOffset = r.u32(*endAt + 16);
  // zip64: a locator right before the end record points at the 64-bit end record.
  if (*endAt >= kEnd64LocatorSize && r.u32(*endAt - kEnd64LocatorSize) == kEnd64LocatorSig) {
    const std::uint64_t end64 = r.u64(*endAt - kEnd64LocatorSize + 8);
    if (!r.has(end64, kEnd64Size) || r.u32(end64) != kEnd64Sig)
      return fail(ZipProblem::Kind::Damaged, "zip64 end record missing at offset " +
                                                 std::to_string(end64));
    entries = r.u64(end64 + 32);
    directorySize = r.u64(end64 + 40);
    directoryOffset = r.u64(end64 + 48);
  }
  if (!r.has(directoryOffset, directorySize) || directoryOffset + directorySize > *endAt)
    return fail(ZipProblem::Kind::Damaged,
                "central directory (offset " + std::to_string(directoryOffset) + ", " +
                    std::to_string(directorySize) + " bytes) lies outside the file");

  std::uint64_t at = directoryOffset;
  for (std::uint64_t i = 0; i < entries; ++i) {
    if (!r.has(at, kCentralHeaderSize) || r.u32(at) != kCentralHeaderSig)
      return fail(ZipProblem::Kind::Damaged,
                  "central directory entry " + std::to_string(i) + " is damaged");
    ZipRecord rec;
    rec.method = r.u16(at + 10);
    rec.crc32 = r.u32(at + 16);
    rec.compressedSize = r.u32(at + 20);
    rec.size = r.u32(at + 24);
    const std::uint16_t nameLen = r.u16(at + 28), extraLen = r.u16(at + 30),
                        commentLen = r.u16(at + 32);
    std::uint64_t localOffset = r.u32(at + 42);
    if (!r.has(at + kCentralHeaderSize, std::uint64_t(nameLen) + extraLen + commentLen))
      return fail(ZipProblem::Kind::Damaged,
                  "central directory entry " + std::to_string(i) + " runs past the file");
    rec.name.assign(bytes + at + kCentralHeaderSize, nameLen);
    // zip64 extra field: the 64-bit values of the fields that hold 0xFFFFFFFF, in this order.
    for (std::uint64_t e = at + kCentralHeaderSize + nameLen,
                       end = at + kCentralHeaderSize + nameLen + extraLen;
         e + 4 <= end;) {
      const std::uint16_t id = r.u16(e), len = r.u16(e + 2);
      if (e + 4 + len > end) break;
      if (id == 0x0001) {
        std::uint64_t p = e + 4;
        auto take = [&](std::uint64_t& field) {
          if (field == 0xFFFFFFFFu && p + 8 <= e + 4 + len) {
            field = r.u64(p);
            p += 8;
          }
        };
        take(rec.size);
        take(rec.compressedSize);
        take(localOffset);
      }
      e += 4 + len;
    }
    at += kCentralHeaderSize + nameLen + extraLen + commentLen;

    if (!r.has(localOffset, kLocalHeaderSize) || r.u32(localOffset) != kLocalHeaderSig)
      return fail(ZipProblem::Kind::Damaged,
                  "record '" + rec.name + "' has no local header at offset " +
                      std::to_string(localOffset));
    rec.dataOffset = localOffset + kLocalHeaderSize + r.u16(localOffset + 26) +
                     r.u16(localOffset + 28);
    if (!r.has(rec.dataOffset, rec.compressedSize) ||
        rec.dataOffset + rec.compressedSize > directoryOffset)
      return fail(ZipProblem::Kind::Damaged,
                  "record '" + rec.name + "' (" + std::to_string(rec.compressedSize) +
                      " bytes at offset " + std::to_string(rec.dataOffset) +
                      ") overlaps the central directory or the end of the file");
    if (rec.method != 0)
      return fail(ZipProblem::Kind::NotZip,
                  "record '" + rec.name + "' is compressed (method " +
                      std::to_string(rec.method) + "); torch.save archives store records");
    // A stored record's two sizes are the same; LibTorch allocates by the uncompressed one.
    if (rec.size != rec.compressedSize)
      return fail(ZipProblem::Kind::Damaged,
                  "stored record '" + rec.name + "' claims " + std::to_string(rec.size) +
                      " bytes but holds " + std::to_string(rec.compressedSize));
    const std::uint32_t actual = crcOf(r.data + rec.dataOffset, rec.compressedSize);
    if (actual != rec.crc32)
      return fail(ZipProblem::Kind::Checksum,
                  "record '" + rec.name + "' (" + std::to_string(rec.size) + " bytes at offset " +
                      std::to_string(rec.dataOffset) + ") fails its CRC-32 check: recorded " +
                      hex8(rec.crc32) + ", computed " + hex8(actual));
    result.records.push_back(std::move(rec));
  }
  if (at != directoryOffset + directorySize)
    return fail(ZipProblem::Kind::Damaged, "central directory size does not match its entries");
  return result;
}

} // namespace ctorch::detail
