#include "tensorboard/tfrecord.hpp"

#include <array>

namespace ctorch::tensorboard {

namespace {

constexpr std::uint32_t kCastagnoli = 0x82F63B78u;  // 0x1EDC6F41 bit-reversed
constexpr std::uint32_t kMaskDelta = 0xa282ead8u;

constexpr std::array<std::uint32_t, 256> makeTable() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ kCastagnoli : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<std::uint32_t, 256> kTable = makeTable();

void appendLittleEndian(std::string& out, std::uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xffu));
}

}  // namespace

std::uint32_t crc32c(std::string_view data, std::uint32_t crc) {
  crc = ~crc;
  for (const char ch : data) crc = kTable[(crc ^ static_cast<unsigned char>(ch)) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

std::uint32_t maskCrc(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kMaskDelta; }

void appendRecord(std::string& out, std::string_view data) {
  const std::size_t start = out.size();
  appendLittleEndian(out, data.size(), 8);
  const std::string_view length(out.data() + start, 8);
  appendLittleEndian(out, maskCrc(crc32c(length)), 4);
  out.append(data);
  appendLittleEndian(out, maskCrc(crc32c(data)), 4);
}

}  // namespace ctorch::tensorboard
