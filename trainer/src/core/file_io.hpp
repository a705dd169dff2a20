// Small POSIX file helpers for durable writes (write fully, fsync file and directory, atomic
// replace). Failures become std::system_error naming the path. Private to the library.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch::detail {

// A path that names a FIFO, a device, a socket or a directory where a file's bytes are expected.
class NotRegularFile : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The whole content of the regular file `path`; throws std::system_error (ENOENT when missing) or
// NotRegularFile, without blocking on a FIFO or reading a device.
std::vector<char> readWholeFile(const std::filesystem::path& path);

// Creates a new file `<dir>/<prefix><pid>-<n>` (O_EXCL), writes `size` bytes, fsyncs and closes
// it. Removes it again if anything fails. Returns its path. `midWriteStall` > 0 (a test hook, see
// snapshotWriteStall) pauses that long after the first half of the bytes is written.
std::filesystem::path writeTempFile(const std::filesystem::path& dir, const std::string& prefix,
                                    const char* data, std::size_t size,
                                    std::chrono::milliseconds midWriteStall = {});

// The same, with the bytes produced by `produce`, which calls its sink with them in order (small
// pieces are gathered into 1 MiB writes, large ones written directly): nothing is held in memory
// twice. `sizeHint` places the test hook's pause (after about half of it).
std::filesystem::path writeTempFileStreaming(
    const std::filesystem::path& dir, const std::string& prefix,
    const std::function<void(const std::function<void(const char*, std::size_t)>&)>& produce,
    std::size_t sizeHint, std::chrono::milliseconds midWriteStall = {}, std::size_t* written = nullptr);

// A test hook: CTORCH_TEST_IO_FAULT=<op>:<n>:<errno>[:<text>][,...] makes the n-th and every later
// call of <op> (write, fsync or close) on a file whose path contains <text> fail with <errno>
// (ENOSPC, EIO or EDQUOT), as a full or failing disk does. Returns that errno, or 0. Unset (the
// normal case): 0 after one getenv.
int injectedFault(const char* op, const std::filesystem::path& path);

// "a FIFO", "a directory", ... for a stat mode that is not a regular file.
std::string fileTypeName(unsigned mode);

// Writes all of `data` to `fd` (EINTR retried); fsyncs `fd`. A failure (or CTORCH_TEST_IO_FAULT)
// is std::system_error naming `path`.
void writeAll(int fd, const char* data, std::size_t size, const std::filesystem::path& path);
void fsyncFile(int fd, const std::filesystem::path& path);

void fsyncDirectory(const std::filesystem::path& dir);
void renameFile(const std::filesystem::path& from, const std::filesystem::path& to);

} // namespace ctorch::detail
