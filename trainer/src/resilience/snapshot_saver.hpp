// ResilientTraining's writes: rank 0 locks the snapshot slot, hands each captured state to the
// background writer for its files, and keeps a failed write until every rank agrees to stop on it.
#pragma once

#include "snapshot/capture_pool.hpp"
#include "snapshot/slot_lock.hpp"

#include "ctorch/resilience.hpp"
#include "snapshot/background_writer.hpp"

#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::detail {

class SnapshotSaver {
 public:
  struct Options {
    std::filesystem::path slot;
    int rank = 0;
    int keepPrevious = 2;
    bool backgroundWrite = true;
    bool logEverySave = false;  // else only the writes write() is asked to announce
    std::string programName;
    std::function<void(const std::string&)> say;  // rank 0's progress lines
  };
  explicit SnapshotSaver(Options options);

  const std::filesystem::path& slot() const { return o_.slot; }
  const std::filesystem::path& boundarySlot() const { return boundarySlot_; }

  // Rank 0: takes "<slot>.lock". False (with `holder` naming it) when another job holds it; a slot
  // that cannot be locked here (a read-only directory, no locks on this file system) is said once
  // and not refused.
  bool lockSlot(std::string& holder);
  [[noreturn]] void refuseBusySlot(const std::string& holder) const;

  // 1.0 when a snapshot write failed here (rank 0): voted with the stop flag, so that every rank
  // stops at the same step with WriteFailed.
  double writeFlag() const { return writeError_ || writer_.failed() ? 1.0 : 0.0; }
  // Waits for this rank's write in flight and keeps its WriteFailed (the writer hands it out once);
  // the library's other errors (an item that cannot be encoded) propagate as they are.
  void collectWriteError();
  // Every rank, once the vote said a write failed: a rank whose write failed rethrows its error with
  // where the run stands; the others say which rank's error names the file.
  [[noreturn]] void throwWriteFailed(std::int64_t globalStep);

  // Rank 0: hands `snapshot` to the writer, for the slot (and the boundary slot when `boundary`)
  // and extras.alsoWriteTo, or (kExtrasOnly) extras.alsoWriteTo alone. After a failed write
  // nothing more is written: the agreed stop comes at the next agreement. `announce`: rank 0 says
  // "snapshot written" once it is durable (always with Options::logEverySave).
  enum class Targets { kSlotAndExtras, kExtrasOnly };
  void write(Snapshot snapshot, bool boundary, const SaveExtras& extras, Targets targets, std::string label,
             std::int64_t globalStep, bool announce);
  // Every rank of a sharded run (a ZeroRedundancyOptimizer): this rank's shard, beside each file
  // write() writes (zero_shards.hpp), rotated one place more than the slot so that every kept
  // snapshot still finds its shards while the newest ones are in flight.
  void writeShard(Snapshot shard, bool boundary, const SaveExtras& extras, Targets targets, std::string label);
  // Rank 0's capture buffers, kept from save to save (null when `reuse` is off).
  CapturePool* pool(bool reuse) { return reuse ? &capturePool_ : nullptr; }
  // Waits for the write in flight; rethrows its failure.
  void wait() { writer_.wait(); }

  // Every rank: what this process would save at (globalStep, stepInEpoch) is already in the slot.
  void markSaved(std::int64_t globalStep, bool boundary) {
    savedAt_ = globalStep;
    savedBoundary_ = boundary;
  }
  void forgetSaved() { savedAt_ = -1; }  // nothing on disk holds this point (a state sent in place)
  bool saved(std::int64_t globalStep, std::int64_t stepInEpoch) const {
    return savedAt_ == globalStep && (stepInEpoch != 0 || savedBoundary_);
  }

 private:
  // The files of one save: the slot (kept `slotKeep`), the boundary slot at an epoch boundary, each
  // extra copy (kept 0); `name` maps each to the file this rank writes.
  std::vector<SnapshotSlotOptions> files(bool boundary, const SaveExtras& extras, Targets targets, int slotKeep,
                                         int boundaryKeep,
                                         const std::function<std::filesystem::path(const std::filesystem::path&)>& name) const;
  // Hands a job to the writer; `durableStep`: the global step it makes durable in the slot.
  void submit(SnapshotJob job, std::function<void()> afterWrite, std::string label,
              std::optional<std::int64_t> durableStep, bool report);

  Options o_;
  std::filesystem::path boundarySlot_;
  SlotLock slotLock_;  // rank 0: "<slot>.lock", held for the run's life
  // Rank 0: the failed write's error, taken from the writer (its wait() hands it out once), and the
  // global step of the newest snapshot known durable.
  std::exception_ptr writeError_;
  std::atomic<std::int64_t> durableAt_{-1};
  CapturePool capturePool_;  // rank 0's copies, reused from save to save
  std::int64_t savedAt_ = -1;  // global step of the newest snapshot submitted (-1: none this process)
  bool savedBoundary_ = false; // ... and whether it was the epoch-boundary one
  bool sharded_ = false;       // this run writes per-rank shards (any rank's write may fail)
  // Last: destroyed first, it finishes the write in flight while what the job reaches is alive.
  SnapshotWriter writer_;
};

} // namespace ctorch::detail
