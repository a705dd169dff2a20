#include "snapshot/slot_lock.hpp"

#include "core/file_io.hpp"
#include "snapshot/slot_layout.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
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

// A round as the lock file writes it (digits only, at most 18): anything else is unknown.
std::optional<std::int64_t> parseRound(const std::string& text) {
  if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoll(text);
}

std::string describeHolder(const std::string& line) {
  if (line.empty()) return "a process that has not said who it is";
  const std::string run = fieldOf(line, "run"), pid = fieldOf(line, "pid"), host = fieldOf(line, "host"),
                    since = fieldOf(line, "since");
  if (pid.empty()) return "'" + line + "'";
  const auto round = parseRound(fieldOf(line, "round"));
  return (run.empty() || run == "-" ? std::string("a job without a run id") : "run " + run) + ", pid " + pid +
         (host.empty() ? "" : " on " + host) + (since.empty() ? "" : " since " + since) +
         (round ? ", round " + std::to_string(*round) : std::string());
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
// One that took the lock over leaves its line: the holder it took it from may still be alive (frozen),
// and its next write must find the later round there (fencedReason).
SlotLock::~SlotLock() {
  if (fd_ < 0) return;
  if (!tookOver_ && namesOpenFile(path_, fd_)) ::unlink(path_.c_str());
  ::close(fd_);
}

std::string lockRunId() {
  const char* id = std::getenv(contract::env::kRunId);
  std::string runId = id ? std::string(id).substr(0, 200) : std::string();
  for (char& c : runId)
    if (c == ' ' || c < 0x20 || c > 0x7e) c = '_';
  return runId;
}

std::optional<std::int64_t> lockRound() {
  const char* round = std::getenv(contract::env::kRendezvousRound);
  return round ? parseRound(round) : std::nullopt;
}

std::optional<std::string> SlotLock::fencedReason(const std::filesystem::path& slot, const std::string& runId,
                                                  std::optional<std::int64_t> round) {
  if (!round || runId.empty()) return std::nullopt;
  const std::filesystem::path path = detail::lockFile(slot);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return std::nullopt;
  struct stat st {};
  std::string holder;
  if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) holder = readHolder(fd);
  ::close(fd);
  if (fieldOf(holder, "run") != runId) return std::nullopt;
  const auto theirs = parseRound(fieldOf(holder, "round"));
  if (!theirs || *theirs <= *round) return std::nullopt;
  return "the snapshot slot's lock " + path.string() + " is held by round " + std::to_string(*theirs) + " of this run (" +
         describeHolder(holder) + "), and this process is of round " + std::to_string(*round) +
         ": the group went on without it, so it writes nothing more";
}

SlotLock::Result SlotLock::acquire(const std::filesystem::path& slot, const std::string& runId,
                                   std::optional<std::int64_t> round, std::chrono::milliseconds sameRunWait,
                                   std::string& detail, const std::function<void(const std::string&)>& say) {
  path_ = detail::lockFile(slot);
  // The slot's directory is made here (the first save would make it): the lock must exist from
  // the start of the run, not from its first snapshot.
  if (slot.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(slot.parent_path(), ec);
  }
  for (int attempt = 0;; ++attempt) {
    const Attempt r = lockOnce(runId, round, sameRunWait, detail, say);
    if (r == Attempt::kInUse) return Result::kInUse;
    if (r == Attempt::kUnavailable) return Result::kUnavailable;
    if (r == Attempt::kTakenOver) {  // the old file is unlinked: the next open makes ours
      if (attempt >= 100) {
        detail = "the lock file " + path_.string() + " kept being replaced";
        return Result::kInUse;
      }
      continue;
    }
    if (namesOpenFile(path_, fd_) || attempt >= 100) {
      // Our line, now that the file is ours: the round is what fences an earlier round's writer.
      char host[256] = {};
      ::gethostname(host, sizeof host - 1);
      char since[32] = {};
      const std::time_t now = std::time(nullptr);
      std::tm tm {};
      ::gmtime_r(&now, &tm);
      std::strftime(since, sizeof since, "%Y-%m-%dT%H:%M:%SZ", &tm);
      const std::string line = "run=" + (runId.empty() ? std::string("-") : runId) +
                               " round=" + (round ? std::to_string(*round) : std::string("-")) + " pid=" +
                               std::to_string(::getpid()) + " host=" + host + " since=" + since + "\n";
      // Best effort: the lock itself is what excludes; the line names the holder and its round.
      if (::ftruncate(fd_, 0) == 0) {
        const ssize_t n = ::pwrite(fd_, line.data(), line.size(), 0);
        (void)n;
      }
      return Result::kHeld;
    }
    ::close(fd_);  // locked a file its holder removed as it let go: the lock is the new file's
    fd_ = -1;
  }
}

SlotLock::Attempt SlotLock::lockOnce(const std::string& runId, std::optional<std::int64_t> round,
                                     std::chrono::milliseconds sameRunWait, std::string& detail,
                                     const std::function<void(const std::string&)>& say) {
  // O_NONBLOCK: a FIFO put in its place must not block the open; O_NOFOLLOW: never someone's link.
  const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0644);
  if (fd < 0) {
    detail = "cannot open " + path_.string() + ": " + std::strerror(errno);
    return Attempt::kUnavailable;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    detail = path_.string() + " is " + fileTypeName(st.st_mode) + ", not a regular file";
    return Attempt::kUnavailable;
  }
  const auto start = std::chrono::steady_clock::now();
  bool said = false;
  for (;;) {
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK) {
      ::close(fd);
      detail = "cannot lock " + path_.string() + ": " + std::strerror(err);
      return Attempt::kUnavailable;
    }
    const std::string holder = readHolder(fd);
    const bool sameRun = !runId.empty() && fieldOf(holder, "run") == runId;
    const auto theirRound = parseRound(fieldOf(holder, "round"));
    // A holder of this run's earlier round: its group went on without it (it is exiting, or its node
    // was removed while frozen and still holds the lock). Waited for briefly — well inside the ranks'
    // agreement on the lock — then the lock is ours.
    const bool earlier = sameRun && round && theirRound && *theirRound < *round;
    const auto waited = std::chrono::steady_clock::now() - start;
    if (earlier && waited >= std::min(sameRunWait, kTakeOverWait)) {
      if (say)
        say("snapshot slot lock " + path_.string() + " is held by " + describeHolder(holder) +
            ", an earlier round of this run that the group went on without: taking the lock over for round " +
            std::to_string(*round) + " (the old holder writes nothing more)");
      // Only the file we opened: a newer one in its place is someone else's.
      if (namesOpenFile(path_, fd)) ::unlink(path_.c_str());
      ::close(fd);
      tookOver_ = true;
      return Attempt::kTakenOver;
    }
    if (!sameRun || (!earlier && waited >= sameRunWait)) {
      ::close(fd);
      detail = describeHolder(holder);
      return Attempt::kInUse;
    }
    if (!said && say)
      say("snapshot slot lock " + path_.string() + " is held by this job's previous rank 0 (" + describeHolder(holder) +
          "): waiting up to " +
          std::to_string((earlier ? std::min(sameRunWait, kTakeOverWait) : sameRunWait).count()) +
          " ms for it to let go");
    said = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  fd_ = fd;
  return Attempt::kHeld;
}

} // namespace ctorch::detail
