// One job per snapshot slot: rank 0 holds an advisory lock (flock) on "<slot>.lock" for the run's
// life; the file names the holder (run id, pid, host, start time) for the refusal of a second job.
// The kernel lets go when the holder exits, however it ends, so a restart of the same job is never
// refused by a dead holder; a holder that ends normally removes the file (only a killed one leaves
// it). Private to the library (ResilientTraining).
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>

namespace ctorch::detail {

class SlotLock {
 public:
  SlotLock() = default;
  ~SlotLock();
  SlotLock(const SlotLock&) = delete;
  SlotLock& operator=(const SlotLock&) = delete;

  enum class Result { kHeld, kInUse, kUnavailable };
  // Takes the lock on "<slot>.lock". kInUse: another live process holds it (`detail` names it:
  // "run X, pid P on host H since T"); a holder of the same non-empty `runId` (this job's previous
  // rank 0, still exiting) is waited for up to `sameRunWait` first, after one line to `say` (when
  // given) naming the holder. kUnavailable: the lock file cannot be made or locked here (a read-only
  // directory, a file system without locks, a FIFO in its place): `detail` says why, and the run goes
  // on without the check.
  Result acquire(const std::filesystem::path& slot, const std::string& runId,
                 std::chrono::milliseconds sameRunWait, std::string& detail,
                 const std::function<void(const std::string&)>& say = {});
  bool held() const { return fd_ >= 0; }
  std::filesystem::path path() const { return path_; }

 private:
  Result lockOnce(const std::string& runId, std::chrono::milliseconds sameRunWait, std::string& detail,
                  const std::function<void(const std::string&)>& say);

  int fd_ = -1;
  std::filesystem::path path_;
};

} // namespace ctorch::detail
