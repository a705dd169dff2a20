#include "byte_source.hpp"

#include <cerrno>
#include <climits>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zlib.h>

#include <ctorch/data/error.hpp>

namespace ctorch::data::detail {
namespace {
gzFile handle(void* p) { return static_cast<gzFile>(p); }

// zlib's message for the stream's last error, without the "<path>: " zlib puts in front of it.
std::string zlibMessage(void* gz, const std::filesystem::path& path) {
  int code = Z_OK;
  const char* message = gzerror(handle(gz), &code);
  std::string text = message && *message ? message : "unknown error";
  const std::string prefix = path.string() + ": ";
  if (text.compare(0, prefix.size(), prefix) == 0) text.erase(0, prefix.size());
  return text;
}
}  // namespace

namespace {
std::string fileTypeName(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    default: return "not a regular file";
  }
}
}  // namespace

ByteSource::ByteSource(const std::filesystem::path& file) : path_(file) {
  // O_NONBLOCK: opening a FIFO would wait for a writer forever; fstat on the descriptor then sees
  // exactly what was opened, so only a regular file is ever read (never /dev/zero or a pipe).
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) throw DataFileError(file.string() + ": missing file");
    throw DataFileError(file.string() + ": cannot open: " + std::strerror(err));
  }
  struct stat st {};
  std::string refusal;
  if (::fstat(fd, &st) != 0) refusal = std::string("cannot stat: ") + std::strerror(errno);
  else if (S_ISDIR(st.st_mode)) refusal = "is a directory, expected a file";
  else if (!S_ISREG(st.st_mode)) refusal = "is " + fileTypeName(st.st_mode) + ", expected a regular file";
  const int flags = refusal.empty() ? ::fcntl(fd, F_GETFL) : 0;
  if (refusal.empty() && (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0))
    refusal = std::string("cannot open: ") + std::strerror(errno);
  // zlib reads a plain file transparently; look at the magic ourselves to word errors right.
  unsigned char magic[2] = {0, 0};
  if (refusal.empty() && ::pread(fd, magic, 2, 0) < 0)
    refusal = std::string("cannot read: ") + std::strerror(errno);
  if (!refusal.empty()) {
    ::close(fd);
    throw DataFileError(file.string() + ": " + refusal);
  }
  fileSize_ = static_cast<uint64_t>(st.st_size);
  compressed_ = fileSize_ >= 2 && magic[0] == 0x1f && magic[1] == 0x8b;
  errno = 0;
  gz_ = gzdopen(fd, "rb");
  if (gz_ == nullptr) {
    const int err = errno;
    ::close(fd);
    throw DataFileError(file.string() + ": cannot open: " + (err ? std::strerror(err) : "out of memory"));
  }
  gzbuffer(handle(gz_), 1 << 18);
}

uint64_t ByteSource::maxContentBytes() const {
  // Deflate cannot expand more than 1032:1 (zlib's FAQ); the gzip header and trailer only add.
  constexpr uint64_t kMaxInflateRatio = 1032;
  if (!compressed_) return fileSize_;
  return fileSize_ > UINT64_MAX / kMaxInflateRatio ? UINT64_MAX : fileSize_ * kMaxInflateRatio;
}

ByteSource::~ByteSource() {
  if (gz_ != nullptr) gzclose(handle(gz_));
}

size_t ByteSource::read(void* dst, size_t n) {
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < n) {
    auto chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
    int got = gzread(handle(gz_), out + done, chunk);
    if (got < 0) {
      throw DataFileError(path_.string() + ": unreadable gzip data (zlib: " + zlibMessage(gz_, path_) + ")");
    }
    if (got == 0) {
      // gzread returns 0 both at a clean end and when the stream stops before its trailer.
      int code = Z_OK;
      gzerror(handle(gz_), &code);
      if (code != Z_OK) {
        throw DataFileError(path_.string() + ": truncated or corrupt gzip data (zlib: " +
                            zlibMessage(gz_, path_) + ")");
      }
      // Some zlib builds (Debian sid's) end a stream whose header is garbage without an error:
      // a gzip file from which nothing at all decompresses is unreadable, not an empty file.
      if (compressed_ && offset_ + done == 0)
        throw DataFileError(path_.string() + ": unreadable gzip data (nothing decompresses from it)");
      break;
    }
    done += static_cast<size_t>(got);
  }
  offset_ += done;
  return done;
}

bool ByteSource::gzipTrailerMatches(uint64_t decompressed) const {
  unsigned char trailer[4];
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return false;
  const bool read = fileSize_ >= 18 &&
                    ::pread(fd, trailer, 4, static_cast<off_t>(fileSize_ - 4)) == 4;
  ::close(fd);
  if (!read) return false;
  const uint32_t isize = static_cast<uint32_t>(trailer[0]) | static_cast<uint32_t>(trailer[1]) << 8 |
                         static_cast<uint32_t>(trailer[2]) << 16 | static_cast<uint32_t>(trailer[3]) << 24;
  return isize == static_cast<uint32_t>(decompressed);
}

void ByteSource::readExactly(void* dst, size_t n, const std::string& what) {
  uint64_t start = offset_;
  size_t got = read(dst, n);
  if (got != n && compressed_ && !gzipTrailerMatches(offset_)) {
    // Where zlib reports a stream cut short as a clean end (Debian sid's zlib does), the trailer
    // tells: a whole gzip file ends with its content's size (ISIZE), a cut one with anything else.
    throw DataFileError(path_.string() + ": truncated or corrupt gzip data: " + what + " needs " +
                        std::to_string(n) + " bytes at offset " + std::to_string(start) + ", found " +
                        std::to_string(got));
  }
  if (got != n) {
    throw DataFormatError(path_.string() + ": truncated: " + what + " needs " + std::to_string(n) +
                          " bytes at offset " + std::to_string(start) + ", found " +
                          std::to_string(got));
  }
}

bool ByteSource::atEnd() {
  char c;
  if (read(&c, 1) == 0) return true;
  offset_ -= 1;
  gzungetc(static_cast<unsigned char>(c), handle(gz_));
  return false;
}

} // namespace ctorch::data::detail
