// Files a training loop writes besides its snapshots (metrics, a final state dict's companions, a
// report), written so that a full or failing disk loses nothing that was there: every write, fsync
// and close is checked, and a failure is a std::system_error whose what() names the file and whose
// code() is the errno (ENOSPC, EIO, EDQUOT ...); and read back (a resumed run keeps the records of
// the steps it does not redo) without trusting what now stands at the path. No LibTorch here.
#pragma once

#include <ctorch/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace ctorch {

// Replaces `path` with `content`: a temporary file beside it is written, fsynced and closed (each
// checked), renamed over `path`, and the directory fsynced. On any failure the temporary file is
// removed, `path` keeps its previous content, and std::system_error is thrown.
void writeFileAtomically(const std::filesystem::path& path, std::string_view content);

// What stands where a file of the loop's own is read back is not one it could have written: a
// symbolic link, a FIFO, a device (/dev/zero), a directory, or a file larger than the reader takes.
// The message names the path and what is there. Bad input: a restart does not help.
class FileRefused : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Bounds of readLinesBack(). A file over `maxBytes` is refused before a byte is read; a line over
// `maxLine` (no record is that long) is passed over without being held.
struct ReadBackLimits {
  std::uint64_t maxBytes = std::uint64_t{1} << 30;
  std::size_t maxLine = std::size_t{64} << 10;
};

// Reads back, line by line, a file this program wrote earlier and is about to rewrite (the metrics
// a resumed run keeps). The final path component must be the regular file itself: a symbolic link
// is not followed (it would let another place decide what the rewrite holds), and a FIFO, a device
// or a directory is refused without blocking and without reading it. At most the file's size at
// open is read, in bounded pieces. `line` gets each line without its '\n' (a last one without '\n'
// too). Returns false, calling nothing, when `path` does not exist. Throws FileRefused (above), or
// std::system_error naming the path when it cannot be opened or read.
bool readLinesBack(const std::filesystem::path& path, const ReadBackLimits& limits,
                   const std::function<void(std::string_view line)>& line);

// Whether AppendOnlyFile follows a symbolic link at its path.
enum class SymlinkPolicy { kFollow, kRefuse };

// A file that records are appended to (JSON lines, CSV). Each append() is written whole or not at
// all: a write that fails part-way (ENOSPC) is cut back to the end of the previous record, so the
// file only ever holds complete records. Not copyable; closes on destruction.
class AppendOnlyFile {
 public:
  // Opens (creating it, mode 0644) for appending. Throws std::system_error naming the path (ELOOP
  // for a symbolic link under kRefuse), or std::runtime_error when the path is not a regular file
  // (a FIFO, a device, a directory).
  explicit AppendOnlyFile(const std::filesystem::path& path, SymlinkPolicy links = SymlinkPolicy::kFollow);
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
