#include "snapshot/slot_lock.hpp"

#include "core/file_io.hpp"
#include "snapshot/slot_layout.hpp"

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>

namespace ctorch::detail {
namespace {

// The holder's line, printable characters only and bounded: the file is anyone's to write.
std::string readHolder(int fd) {
  char buf[512];
  const ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  std::string out;
  for (ssize_t i = 0; i < n && buf[i] != '\n'; ++i)
    out.push_back(buf[i] >= 0x20 && buf[i] < 0x7f ? buf[i] : '?');
  return out;
}

// "run=<id> pid=<pid> host=<host> since=<time>" -> the value of `field`, or "".
std::string fieldOf(const std::string& line, const std::string& field) {
  const std::string key = field + "=";
  std::size_t at = line.rfind(key, 0) == 0 ? 0 : line.find(" " + key);
  if (at == std::string::npos) return "";
  if (at != 0) ++at;
  const std::size_t start = at + key.size();
  return line.substr(start, line.find(' ', start) - start);
}

std::string describeHolder(const std::string& line) {
  if (line.empty()) return "a process that has not said who it is";
  const std::string run = fieldOf(line, "run"), pid = fieldOf(line, "pid"), host = fieldOf(line, "host"),
                    since = fieldOf(line, "since");
  if (pid.empty()) return "'" + line + "'";
  return (run.empty() || run == "-" ? std::string("a job without a run id") : "run " + run) + ", pid " + pid +
         (host.empty() ? "" : " on " + host) + (since.empty() ? "" : " since " + since);
}

} // namespace

namespace {

// Whether `path` still names the file open on `fd` (the holder before us may have removed it, and a
// newer holder made another).
bool namesOpenFile(const std::filesystem::path& path, int fd) {
  struct stat open {}, named {};
  return ::fstat(fd, &open) == 0 && ::lstat(path.c_str(), &named) == 0 && open.st_dev == named.st_dev &&
         open.st_ino == named.st_ino;
}

}  // namespace

// The holder removes the file before it lets go, while it still holds the lock: a run that ends
// leaves no "<slot>.lock" behind. A process that opened the file before the removal takes the lock
// on a file no longer named (acquire sees that and opens the path again).
SlotLock::~SlotLock() {
  if (fd_ < 0) return;
  if (namesOpenFile(path_, fd_)) ::unlink(path_.c_str());
  ::close(fd_);
}

SlotLock::Result SlotLock::acquire(const std::filesystem::path& slot, const std::string& runId,
                                   std::chrono::milliseconds sameRunWait, std::string& detail,
                                   const std::function<void(const std::string&)>& say) {
  path_ = detail::lockFile(slot);
  // The slot's directory is made here (the first save would make it): the lock must exist from
  // the start of the run, not from its first snapshot.
  if (slot.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(slot.parent_path(), ec);
  }
  for (int attempt = 0;; ++attempt) {
    const Result r = lockOnce(runId, sameRunWait, detail, say);
    if (r != Result::kHeld || namesOpenFile(path_, fd_) || attempt >= 100) return r;
    ::close(fd_);  // locked a file its holder removed as it let go: the lock is the new file's
    fd_ = -1;
  }
}

SlotLock::Result SlotLock::lockOnce(const std::string& runId, std::chrono::milliseconds sameRunWait,
                                    std::string& detail, const std::function<void(const std::string&)>& say) {
  // O_NONBLOCK: a FIFO put in its place must not block the open; O_NOFOLLOW: never someone's link.
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0644);
  if (fd < 0) {
    detail = "cannot open " + path_.string() + ": " + std::strerror(errno);
    return Result::kUnavailable;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    detail = path_.string() + " is " + fileTypeName(st.st_mode) + ", not a regular file";
    return Result::kUnavailable;
  }
  const auto deadline = std::chrono::steady_clock::now() + sameRunWait;
  bool said = false;
  for (;;) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK) {
      ::close(fd);
      detail = "cannot lock " + path_.string() + ": " + std::strerror(err);
      return Result::kUnavailable;
    }
    const std::string holder = readHolder(fd);
    const bool sameRun = !runId.empty() && fieldOf(holder, "run") == runId;
    if (!sameRun || std::chrono::steady_clock::now() >= deadline) {
      ::close(fd);
      detail = describeHolder(holder);
      return Result::kInUse;
    }
    if (!said && say)
      say("snapshot slot lock " + path_.string() + " is held by this job's previous rank 0 (" + describeHolder(holder) +
          "): waiting up to " + std::to_string(sameRunWait.count()) + " ms for it to let go");
    said = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  fd_ = fd;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  char since[32] = {};
  const std::time_t now = std::time(nullptr);
  std::tm tm {};
  ::gmtime_r(&now, &tm);
  std::strftime(since, sizeof since, "%Y-%m-%dT%H:%M:%SZ", &tm);
  std::string line = "run=" + (runId.empty() ? std::string("-") : runId) + " pid=" + std::to_string(::getpid()) +
                     " host=" + host + " since=" + since + "\n";
  // Best effort: the lock itself is what excludes; the line only names the holder.
  if (::ftruncate(fd_, 0) == 0) {
    const ssize_t n = ::pwrite(fd_, line.data(), line.size(), 0);
    (void)n;
  }
  return Result::kHeld;
}

} // namespace ctorch::detail
