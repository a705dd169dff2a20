// The TFRecord framing of TensorBoard's event files: each record is its length (uint64, little
// endian), the masked CRC-32C of those 8 bytes, the data, and the masked CRC-32C of the data.
// Pure functions: the tests check them against known vectors and an independent reader.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ctorch::tensorboard {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), in software: crc32c("123456789") is
// 0xE3069283. `crc` continues an earlier value over more bytes.
std::uint32_t crc32c(std::string_view data, std::uint32_t crc = 0);

// TFRecord's mask of a stored CRC (a CRC of bytes that hold CRCs is weak otherwise):
// ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t maskCrc(std::uint32_t crc);

// Appends one framed record holding `data` to `out`.
void appendRecord(std::string& out, std::string_view data);

}  // namespace ctorch::tensorboard
