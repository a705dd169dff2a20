// Writers of small files in the formats the readers parse (IDX, CIFAR-10 batches, gzip), so tests can
// make good and corrupt inputs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <zlib.h>

#include "multiproc.hpp"

namespace ctorch::test {

inline void appendBigEndian32(std::string& out, uint32_t v) {
  out.push_back(static_cast<char>(v >> 24));
  out.push_back(static_cast<char>(v >> 16));
  out.push_back(static_cast<char>(v >> 8));
  out.push_back(static_cast<char>(v));
}

// An IDX file's bytes: magic, sizes, then `data` as given (the caller may give too few or too many).
inline std::string idxBytes(uint32_t magic, const std::vector<uint32_t>& sizes, const std::string& data) {
  std::string out;
  appendBigEndian32(out, magic);
  for (auto s : sizes) appendBigEndian32(out, s);
  return out + data;
}

// n images of rows x cols whose pixel (i, r, c) is (i * 31 + r * 7 + c) % 256.
inline std::string imagePixels(uint32_t n, uint32_t rows, uint32_t cols) {
  std::string out;
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t c = 0; c < cols; ++c) out.push_back(static_cast<char>((i * 31 + r * 7 + c) % 256));
  return out;
}

inline std::string labelBytes(uint32_t n, uint32_t classes = 10) {
  std::string out;
  for (uint32_t i = 0; i < n; ++i) out.push_back(static_cast<char>((i * 3) % classes));
  return out;
}

inline void writeGzip(const std::filesystem::path& path, const std::string& content) {
  gzFile f = gzopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error("gzopen " + path.string());
  if (!content.empty()) gzwrite(f, content.data(), static_cast<unsigned>(content.size()));
  gzclose(f);
}

// A CIFAR-10 record: label, then 3072 pixels with (record, channel, position) -> value.
inline std::string cifarRecords(uint32_t n, uint32_t first = 0) {
  std::string out;
  for (uint32_t i = first; i < first + n; ++i) {
    out.push_back(static_cast<char>(i % 10));
    for (uint32_t ch = 0; ch < 3; ++ch)
      for (uint32_t p = 0; p < 1024; ++p) out.push_back(static_cast<char>((i * 13 + ch * 101 + p) % 256));
  }
  return out;
}

}  // namespace ctorch::test
