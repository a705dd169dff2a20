#include "core/file_io.hpp"

#include <cerrno>
#include <fcntl.h>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <thread>

namespace ctorch::detail {
namespace {

[[noreturn]] void throwErrno(int err, const std::string& what, const std::filesystem::path& p) {
  throw std::system_error(err, std::generic_category(), what + " " + p.string());
}

} // namespace

// CTORCH_TEST_IO_FAULT (see file_io.hpp). Parsed again whenever the variable's value changes, so
// that an in-process test can set, change and clear it between cases; its counters restart then.
int injectedFault(const char* op, const std::filesystem::path& p) {
  struct Rule {
    std::string op;
    long from = 0;
    int err = 0;
    std::string match;
    long seen = 0;
  };
  static std::mutex mutex;
  static std::string parsed;
  static std::vector<Rule> rules;
  const char* value = std::getenv("CTORCH_TEST_IO_FAULT");
  std::lock_guard<std::mutex> lock(mutex);
  if (!value || !*value) {
    parsed.clear();
    rules.clear();
    return 0;
  }
  if (parsed != value) {
    parsed = value;
    rules.clear();
    std::stringstream all(parsed);
    std::string item;
    while (std::getline(all, item, ',')) {
      std::vector<std::string> f;
      std::stringstream fields(item);
      std::string field;
      while (std::getline(fields, field, ':')) f.push_back(field);
      if (f.size() < 3) continue;
      Rule r;
      r.op = f[0];
      r.from = std::strtol(f[1].c_str(), nullptr, 10);
      r.err = f[2] == "ENOSPC" ? ENOSPC : f[2] == "EIO" ? EIO : f[2] == "EDQUOT" ? EDQUOT : 0;
      if (f.size() > 3) r.match = f[3];
      if (r.from > 0 && r.err != 0) rules.push_back(r);
    }
  }
  for (auto& r : rules) {
    if (r.op != op || (!r.match.empty() && p.string().find(r.match) == std::string::npos)) continue;
    if (++r.seen >= r.from) return r.err;
  }
  return 0;
}

namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now so that a failing close (e.g. a deferred write error on NFS) is reported.
  void close(const std::filesystem::path& p) {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throwErrno(errno, "close", p);
    if (const int err = injectedFault("close", p)) throwErrno(err, "close", p);
  }

 private:
  int fd_;
};

} // namespace

void writeAll(int fd, const char* data, std::size_t size, const std::filesystem::path& p) {
  while (size > 0) {
    if (const int err = injectedFault("write", p)) throwErrno(err, "write", p);
    const ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno(errno, "write", p);
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

void fsyncFile(int fd, const std::filesystem::path& p) {
  if (const int err = injectedFault("fsync", p)) throwErrno(err, "fsync", p);
  while (::fsync(fd) != 0) {
    if (errno != EINTR) throwErrno(errno, "fsync", p);
  }
}

std::string fileTypeName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFIFO: return "a FIFO";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFSOCK: return "a socket";
    case S_IFDIR: return "a directory";
    default: return "not a regular file";
  }
}

std::vector<char> readWholeFile(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. Only regular
  // files are read, so /dev/zero or a pipe cannot feed us bytes until memory runs out.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (fd.get() < 0) throwErrno(errno, "open", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throwErrno(errno, "stat", path);
  if (!S_ISREG(st.st_mode))
    throw NotRegularFile(path.string() + " is " + fileTypeName(st.st_mode) +
                         ", not a regular file");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) throwErrno(errno, "fcntl", path);
  // Read straight into a buffer of the size stat reports; grow if the file turns out longer.
  std::vector<char> data(static_cast<std::size_t>(st.st_size) + 1);
  std::size_t have = 0;
  for (;;) {
    if (have == data.size()) data.resize(data.size() * 2 + 4096);
    const ssize_t n = ::read(fd.get(), data.data() + have, data.size() - have);
    if (n < 0) {
      if (errno == EINTR) continue;
      throwErrno(errno, "read", path);
    }
    if (n == 0) break;
    have += static_cast<std::size_t>(n);
  }
  data.resize(have);
  return data;
}

namespace {

// A new file `<dir>/<prefix><pid>-<n>` (O_EXCL: never someone else's); its path in `tmp`.
int createTempFile(const std::filesystem::path& dir, const std::string& prefix, std::filesystem::path& tmp) {
  static std::atomic<unsigned> counter{0};
  int raw = -1;
  for (int attempt = 0; attempt < 100 && raw < 0; ++attempt) {
    tmp = dir / (prefix + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    raw = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (raw < 0 && errno != EEXIST) throwErrno(errno, "create", tmp);
  }
  if (raw < 0) throwErrno(EEXIST, "create", tmp);
  return raw;
}

} // namespace

std::filesystem::path writeTempFile(const std::filesystem::path& dir, const std::string& prefix,
                                    const char* data, std::size_t size,
                                    std::chrono::milliseconds midWriteStall) {
  std::filesystem::path tmp;
  Fd fd(createTempFile(dir, prefix, tmp));
  try {
    if (midWriteStall.count() > 0) {
      // A test hook: a crash test can kill the writer while this file is half written.
      const std::size_t half = size / 2;
      writeAll(fd.get(), data, half, tmp);
      std::this_thread::sleep_for(midWriteStall);
      writeAll(fd.get(), data + half, size - half, tmp);
    } else {
      writeAll(fd.get(), data, size, tmp);
    }
    fsyncFile(fd.get(), tmp);
    fd.close(tmp);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  return tmp;
}

std::filesystem::path writeTempFileStreaming(
    const std::filesystem::path& dir, const std::string& prefix,
    const std::function<void(const std::function<void(const char*, std::size_t)>&)>& produce,
    std::size_t sizeHint, std::chrono::milliseconds midWriteStall, std::size_t* written) {
  std::filesystem::path tmp;
  Fd fd(createTempFile(dir, prefix, tmp));
  try {
    constexpr std::size_t kBuffer = std::size_t{1} << 20;
    std::vector<char> buffer;
    buffer.reserve(kBuffer);
    std::size_t total = 0;
    bool stalled = midWriteStall.count() <= 0;
    auto flush = [&] {
      writeAll(fd.get(), buffer.data(), buffer.size(), tmp);
      buffer.clear();
    };
    auto maybeStall = [&] {
      if (!stalled && total >= sizeHint / 2) {
        // A test hook: a crash test can kill the writer while this file is half written.
        flush();
        stalled = true;
        std::this_thread::sleep_for(midWriteStall);
      }
    };
    produce([&](const char* data, std::size_t size) {
      if (size >= kBuffer / 4) {
        flush();
        if (!stalled && total + size >= sizeHint / 2) {
          const std::size_t first = std::min(size, sizeHint / 2 > total ? sizeHint / 2 - total : 0);
          writeAll(fd.get(), data, first, tmp);
          total += first;
          maybeStall();
          writeAll(fd.get(), data + first, size - first, tmp);
          total += size - first;
          return;
        }
        writeAll(fd.get(), data, size, tmp);
      } else {
        if (buffer.size() + size > kBuffer) flush();
        buffer.insert(buffer.end(), data, data + size);
      }
      total += size;
      maybeStall();
    });
    flush();
    fsyncFile(fd.get(), tmp);
    fd.close(tmp);
    if (written) *written = total;
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  return tmp;
}

void fsyncDirectory(const std::filesystem::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) throwErrno(errno, "open directory", dir);
  // Some file systems refuse fsync on directories (EINVAL); their metadata is then as durable as
  // they make it, and there is nothing more a program can do.
  while (::fsync(fd.get()) != 0) {
    if (errno == EINTR) continue;
    if (errno == EINVAL || errno == ENOTSUP) break;
    throwErrno(errno, "fsync directory", dir);
  }
}

void renameFile(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throwErrno(errno, "rename " + from.string() + " to", to);
}

} // namespace ctorch::detail

// ---- the public durable_io.hpp -----------------------------------------------------------------
#include "ctorch/durable_io.hpp"

namespace ctorch {

void writeFileAtomically(const std::filesystem::path& path, std::string_view content) {
  const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  const auto tmp =
      detail::writeTempFile(dir, "." + path.filename().string() + ".tmp-", content.data(), content.size());
  try {
    detail::renameFile(tmp, path);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  detail::fsyncDirectory(dir);
}

bool readLinesBack(const std::filesystem::path& path, const ReadBackLimits& limits,
                   const std::function<void(std::string_view line)>& line) {
  // O_NOFOLLOW: a link at the path fails (ELOOP) instead of being opened. O_NONBLOCK: a FIFO opens
  // without waiting for a writer. fstat then sees exactly what was opened; only a regular file is read.
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (raw < 0) {
    const int err = errno;
    if (err == ENOENT) return false;
    struct stat st {};
    if (err == ELOOP && ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode)) {
      std::error_code ec;
      const auto target = std::filesystem::read_symlink(path, ec);
      throw FileRefused(path.string() + " is a symbolic link" + (ec ? "" : " (to '" + target.string() + "')") +
                        ", not a regular file");
    }
    throw std::system_error(err, std::generic_category(), "open " + path.string());
  }
  detail::Fd fd(raw);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw std::system_error(errno, std::generic_category(), "stat " + path.string());
  if (!S_ISREG(st.st_mode))
    throw FileRefused(path.string() + " is " + detail::fileTypeName(st.st_mode) + ", not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > limits.maxBytes)
    throw FileRefused(path.string() + " is " + std::to_string(size) + " bytes, more than the limit of " +
                      std::to_string(limits.maxBytes) + " bytes");
  // The size at open bounds the read (a file growing meanwhile adds nothing); `pending` holds at
  // most one line of at most maxLine bytes.
  std::uint64_t left = size;
  constexpr std::uint64_t kPiece = 64 << 10;
  std::vector<char> buffer(static_cast<std::size_t>(std::clamp<std::uint64_t>(size, 1, kPiece)));
  std::string pending;
  bool skipping = false;  // inside a line longer than maxLine
  while (left > 0) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), left));
    const ssize_t n = ::read(fd.get(), buffer.data(), want);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::system_error(errno, std::generic_category(), "read " + path.string());
    }
    if (n == 0) break;  // shorter now than at open
    left -= static_cast<std::uint64_t>(n);
    std::string_view chunk(buffer.data(), static_cast<std::size_t>(n));
    while (!chunk.empty()) {
      const auto end = chunk.find('\n');
      const std::string_view piece = chunk.substr(0, end);
      if (!skipping && pending.size() + piece.size() > limits.maxLine) {
        skipping = true;
        pending.clear();
      }
      if (end == std::string_view::npos) {
        if (!skipping) pending.append(piece);
        break;
      }
      if (!skipping) {
        if (pending.empty()) {
          line(piece);
        } else {
          pending.append(piece);
          line(pending);
        }
      }
      pending.clear();
      skipping = false;
      chunk.remove_prefix(end + 1);
    }
  }
  if (!skipping && !pending.empty()) line(pending);
  return true;
}

AppendOnlyFile::AppendOnlyFile(const std::filesystem::path& path, SymlinkPolicy links) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOCTTY | O_NONBLOCK |
                                 (links == SymlinkPolicy::kRefuse ? O_NOFOLLOW : 0),
               0644);
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "open " + path.string());
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw std::system_error(err, std::generic_category(), "stat " + path.string());
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(path.string() + " is " + detail::fileTypeName(st.st_mode) + ", not a regular file");
  }
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  size_ = static_cast<std::uint64_t>(st.st_size);
}

AppendOnlyFile::~AppendOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendOnlyFile::append(std::string_view record) {
  if (fd_ < 0) throw std::system_error(EBADF, std::generic_category(), "append to closed " + path_.string());
  try {
    detail::writeAll(fd_, record.data(), record.size(), path_);
  } catch (...) {
    // Whatever part of the record reached the file goes again: the file ends with a whole record.
    if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) {
      // Nothing more can be done; the next reader skips a partial last line.
    }
    throw;
  }
  size_ += record.size();
}

void AppendOnlyFile::sync() {
  if (fd_ >= 0) detail::fsyncFile(fd_, path_);
}

void AppendOnlyFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw std::system_error(errno, std::generic_category(), "close " + path_.string());
  if (const int err = detail::injectedFault("close", path_))
    throw std::system_error(err, std::generic_category(), "close " + path_.string());
}

} // namespace ctorch
