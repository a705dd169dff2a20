// Structural check of a zip archive as torch.save / pickle_save write it (stored records, zip64 end
// records), done before the bytes reach the unpickler: LibTorch's reader does not verify CRC-32s,
// and a damaged pickle must not be parsed at all. Strict on purpose: whatever it accepts, LibTorch's
// reader (miniz) reads as the very same records (docs/snapshot.md, "One reading of the zip").
// Private to the library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ctorch::detail {

struct ZipRecord {
  std::string name;
  std::uint32_t crc32 = 0;
  std::uint16_t method = 0;          // 0: stored (what torch.save writes)
  std::uint64_t compressedSize = 0;
  std::uint64_t size = 0;
  std::uint64_t dataOffset = 0;      // first byte of the record's data in the archive
};

struct ZipProblem {
  enum class Kind { NotZip, Truncated, Damaged, Checksum };
  Kind kind;
  std::string detail;
};

// Parses the central directory and checks every record's location and CRC-32, and that the archive
// has exactly one reading. Returns the records in central-directory order or, when something is
// wrong, the first problem found.
struct ZipCheckResult {
  std::vector<ZipRecord> records;
  std::vector<ZipProblem> problems;  // empty when the archive is sound
};
ZipCheckResult checkZipArchive(const char* data, std::size_t size);

} // namespace ctorch::detail
