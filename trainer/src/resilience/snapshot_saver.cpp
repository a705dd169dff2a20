// Rank 0's snapshot writes for ResilientTraining and their failures (a full disk, EIO): the slot's
// lock, the write job for the slot, the boundary slot and extra copies, the agreed WriteFailed.
#include "resilience/snapshot_saver.hpp"

#include "resilience/shard_files.hpp"
#include "snapshot/slot_layout.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <cstdlib>
#include <iostream>

namespace ctorch::detail {

SnapshotSaver::SnapshotSaver(Options options)
    : o_(std::move(options)), boundarySlot_(detail::boundarySlot(o_.slot)), writer_(o_.backgroundWrite) {}

bool SnapshotSaver::lockSlot(std::string& holder) {
  std::string detail;
  switch (slotLock_.acquire(o_.slot, lockRunId(), lockRound(), std::chrono::seconds(10), detail, o_.say)) {
    case SlotLock::Result::kHeld: return true;
    case SlotLock::Result::kUnavailable:
      o_.say("warning: " + detail + "; running without the check that no other job uses this snapshot slot");
      return true;
    case SlotLock::Result::kInUse: holder = detail; return false;
  }
  return true;
}

void SnapshotSaver::refuseBusySlot(const std::string& holder) const {
  if (o_.rank == 0)
    throw ConfigError("snapshot slot " + o_.slot.string() + " is in use by another job (" + holder + "; lock " +
                      slotLock_.path().string() + "): two jobs on one slot would mix their snapshots; stop that "
                      "job, or give this one another snapshot path");
  throw ConfigError("rank " + std::to_string(o_.rank) + ": snapshot slot " + o_.slot.string() +
                    " is in use by another job (rank 0's error names it)");
}

void SnapshotSaver::collectWriteError() {
  if (writeError_) return;
  try {
    writer_.wait();
  } catch (const WriteFailed&) {
    writeError_ = std::current_exception();
  }
}

void SnapshotSaver::throwWriteFailed(std::int64_t globalStep) {
  const std::string at = "global step " + std::to_string(globalStep);
  collectWriteError();
  if (!writeError_) {
    if (o_.rank != 0 || sharded_)
      throw WriteFailed("rank " + std::to_string(o_.rank) + ": stopped at " + at + " with every rank: " +
                        (sharded_ ? std::string("a rank could not write its part of the snapshot (its error names the file)")
                                  : std::string("rank 0 could not write the snapshot (its error names the file)")));
    throw WriteFailed("a snapshot write failed; every rank stopped at " + at);
  }
  try {
    std::rethrow_exception(writeError_);
  } catch (const WriteFailed& e) {
    const std::int64_t durable = durableAt_.load();
    const std::string holds = o_.rank == 0 ? o_.slot.string() + (durable >= 0 ? " holds the last snapshot written (global step " +
                                                                                   std::to_string(durable) + ")"
                                                                             : " keeps what it held before") +
                                                 "; "
                                           : std::string();
    throw WriteFailed(std::string(e.what()) + "; " + holds + "every rank stopped at " + at + " (exit code " +
                      std::to_string(contract::kExitWriteFailed) + "): free space and run the same command again to resume");
  }
}

std::vector<SnapshotSlotOptions> SnapshotSaver::files(bool boundary, const SaveExtras& extras, Targets targets,
                                                     int slotKeep, int boundaryKeep,
                                                     const std::function<std::filesystem::path(const std::filesystem::path&)>& name) const {
  std::vector<SnapshotSlotOptions> out;
  // Fencing (slot_lock.hpp): a process of an earlier round of this run, left behind by its group,
  // writes nothing once a later round holds the slot's lock — checked before each file is touched.
  auto fence = [slot = o_.slot, runId = lockRunId(), round = lockRound(), rank = o_.rank] {
    if (auto why = SlotLock::fencedReason(slot, runId, round))
      throw WriteFailed("rank " + std::to_string(rank) + ": " + *why);
  };
  auto add = [&](const std::filesystem::path& path, int keep) {
    SnapshotSlotOptions slotOptions;
    slotOptions.path = name(path);
    slotOptions.keepPrevious = keep;
    slotOptions.fence = fence;
    out.push_back(slotOptions);
  };
  if (targets == Targets::kSlotAndExtras) {
    add(o_.slot, slotKeep);
    if (boundary) add(boundarySlot_, boundaryKeep);
  }
  for (const auto& extra : extras.alsoWriteTo) add(extra, 0);
  return out;
}

void SnapshotSaver::write(Snapshot snapshot, bool boundary, const SaveExtras& extras, Targets targets,
                          std::string label, std::int64_t globalStep, bool announce) {
  SnapshotJob job;
  job.snapshot = std::move(snapshot);
  job.slots = files(boundary, extras, targets, o_.keepPrevious, 1, [](const std::filesystem::path& p) { return p; });
  submit(std::move(job), extras.afterWrite, std::move(label),
         targets == Targets::kExtrasOnly ? std::nullopt : std::optional<std::int64_t>(globalStep),
         /*report=*/announce || o_.logEverySave);
}

void SnapshotSaver::writeShard(Snapshot shard, bool boundary, const SaveExtras& extras, Targets targets,
                               std::string label) {
  sharded_ = true;
  SnapshotJob job;
  job.snapshot = std::move(shard);
  job.slots = files(boundary, extras, targets, o_.keepPrevious + 1, 2,
                    [this](const std::filesystem::path& p) { return shardSlotFor(p, o_.rank); });
  // Rank 0's progress line is the snapshot's; a shard's write says nothing unless it fails.
  submit(std::move(job), nullptr, "rank " + std::to_string(o_.rank) + "'s shard, " + label, std::nullopt,
         /*report=*/false);
}

void SnapshotSaver::submit(SnapshotJob job, std::function<void()> afterWrite, std::string label,
                           std::optional<std::int64_t> durableStep, bool report) {
  if (job.slots.empty()) return;
  job.afterWrite = std::move(afterWrite);
  if (report) job.report = [this](const std::string& line) { o_.say(line); };
  job.reportError = [this](const std::string& line) { std::cerr << (o_.programName + ": " + line + "\n") << std::flush; };
  job.label = std::move(label);
  if (durableStep) {
    auto after = std::move(job.afterWrite);
    job.afterWrite = [this, after = std::move(after), step = *durableStep] {
      if (after) after();
      durableAt_ = step;
    };
  }
  // After a failed write nothing more is written: the agreed stop comes at the next agreement.
  if (writeError_ || writer_.failed()) return;
  try {
    writer_.submit(std::move(job));
  } catch (const WriteFailed& e) {
    // This write (run now: said here) or the background one before it (said when it failed).
    writeError_ = std::current_exception();
    if (!o_.backgroundWrite) std::cerr << o_.programName << ": " << e.what() << std::endl;
  }
}

} // namespace ctorch::detail
