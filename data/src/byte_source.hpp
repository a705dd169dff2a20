// Private: reads a file that may be gzip-compressed (zlib decides from the content), turning every
// failure into a one-line DataFileError / DataFormatError that names the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

namespace ctorch::data::detail {

class ByteSource {
 public:
  // Throws DataFileError if the file is missing, a directory, not a regular file (a FIFO, a device:
  // refused without blocking or reading), or cannot be opened (saying what errno says).
  explicit ByteSource(const std::filesystem::path& file);
  ~ByteSource();
  ByteSource(const ByteSource&) = delete;
  ByteSource& operator=(const ByteSource&) = delete;

  // Reads up to n bytes into dst; returns fewer only at the end of the data. Throws DataFileError
  // when the gzip stream is corrupt or ends before its trailer ("truncated gzip").
  size_t read(void* dst, size_t n);
  // Reads exactly n bytes or throws DataFormatError "truncated: <what> needs N bytes, found M".
  void readExactly(void* dst, size_t n, const std::string& what);
  // True if no byte is left (reads one byte to find out).
  bool atEnd();
  // Decompressed bytes read so far.
  uint64_t offset() const { return offset_; }
  bool compressed() const { return compressed_; }
  // The most bytes the content can have: the file's size, or for gzip what deflate's largest
  // ratio allows. A header announcing more is lying; check before allocating for it.
  uint64_t maxContentBytes() const;
  const std::filesystem::path& path() const { return path_; }

 private:
  // Whether the last 4 bytes of the (gzip) file, its ISIZE, equal `decompressed` mod 2^32: the
  // stream ended where its writer ended it, not cut short.
  bool gzipTrailerMatches(uint64_t decompressed) const;
  std::filesystem::path path_;
  void* gz_ = nullptr;   // gzFile, kept out of this header
  uint64_t offset_ = 0;
  uint64_t fileSize_ = 0;
  bool compressed_ = false;
};

} // namespace ctorch::data::detail
