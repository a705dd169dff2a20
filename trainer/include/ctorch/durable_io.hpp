// Files a training loop writes besides its snapshots (metrics, a final state dict's companions, a
// report), written so that a full or failing disk loses nothing that was there: every write, fsync
// and close is checked, and a failure is a std::system_error whose what() names the file and whose
// code() is the errno (ENOSPC, EIO, EDQUOT ...). No LibTorch here.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace ctorch {

// Replaces `path` with `content`: a temporary file beside it is written, fsynced and closed (each
// checked), renamed over `path`, and the directory fsynced. On any failure the temporary file is
// removed, `path` keeps its previous content, and std::system_error is thrown.
void writeFileAtomically(const std::filesystem::path& path, std::string_view content);

// A file that records are appended to (JSON lines, CSV). Each append() is written whole or not at
// all: a write that fails part-way (ENOSPC) is cut back to the end of the previous record, so the
// file only ever holds complete records. Not copyable; closes on destruction.
class AppendOnlyFile {
 public:
  // Opens (creating it, mode 0644) for appending. Throws std::system_error naming the path, or
  // std::runtime_error when the path is not a regular file (a FIFO, a device, a directory).
  explicit AppendOnlyFile(const std::filesystem::path& path);
  ~AppendOnlyFile();
  AppendOnlyFile(const AppendOnlyFile&) = delete;
  AppendOnlyFile& operator=(const AppendOnlyFile&) = delete;

  // Appends `record` (the caller adds its '\n'). Throws std::system_error naming the file; the file
  // then ends where it ended before this call.
  void append(std::string_view record);
  // fsync: what was appended is on the disk. Throws std::system_error naming the file.
  void sync();
  // Checked close (a deferred write error, e.g. on NFS, shows here). Idempotent.
  void close();

  const std::filesystem::path& path() const { return path_; }
  std::uint64_t size() const { return size_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

} // namespace ctorch
