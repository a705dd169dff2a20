// One job per snapshot slot: rank 0 holds an advisory lock (flock) on "<slot>.lock" for the run's
// life; the file names the holder (run id, rendezvous round, pid, host, start time) for the refusal
// of a second job. The kernel lets go when the holder exits, however it ends, so a restart of the
// same job is never refused by a dead holder; a holder that ends normally removes the file (only a
// killed one leaves it, and one that took the lock over, below).
//
// Fencing (issue 58): a holder that is alive but was left behind by its job — its node frozen, then
// removed by the rendezvous — keeps its flock. The round (CTORCH_RDZV_ROUND, a number the nodes of
// a round agree on and that only grows) is the token: a rank 0 of a later round of the same run
// waits a moment for an earlier round's holder to let go, then takes the lock over (a new lock file
// in the old one's place, naming the later round), and every write checks the lock file first: a
// writer whose run has a later round there no longer writes. Private to the library.
#pragma once

#include <chrono>
#include <filesystem>
#include <cstdint>
#include <functional>
#include <optional>
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
  //
  // `round` (the fencing token; unknown: nullopt, and nothing is taken over): a holder of the same
  // run and an earlier round is waited for up to min(`sameRunWait`, kTakeOverWait), then the lock is
  // taken over from it, after one line to `say`.
  Result acquire(const std::filesystem::path& slot, const std::string& runId, std::optional<std::int64_t> round,
                 std::chrono::milliseconds sameRunWait, std::string& detail,
                 const std::function<void(const std::string&)>& say = {});
  bool held() const { return fd_ >= 0; }
  bool tookOver() const { return tookOver_; }
  std::filesystem::path path() const { return path_; }

  static constexpr std::chrono::milliseconds kTakeOverWait{2000};

  // Why a writer of run `runId` in round `round` must not write into `slot` any more: its lock file
  // names the same run in a later round (it was taken over). Nothing when the round or run id is
  // unknown, or the file is missing or names anything else: the lock file is anyone's to write, so
  // only a later round of this very run fences.
  static std::optional<std::string> fencedReason(const std::filesystem::path& slot, const std::string& runId,
                                                 std::optional<std::int64_t> round);

 private:
  enum class Attempt { kHeld, kInUse, kUnavailable, kTakenOver };
  Attempt lockOnce(const std::string& runId, std::optional<std::int64_t> round, std::chrono::milliseconds sameRunWait,
                   std::string& detail, const std::function<void(const std::string&)>& say);

  int fd_ = -1;
  bool tookOver_ = false;
  std::filesystem::path path_;
};

// The run id and round this process's launcher gave it (TORCHELASTIC_RUN_ID made printable and
// bounded; CTORCH_RDZV_ROUND when it is a plain number), as the slot's lock records them.
std::string lockRunId();
std::optional<std::int64_t> lockRound();

} // namespace ctorch::detail
