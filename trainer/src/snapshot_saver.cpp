// Rank 0's snapshot writes for ResilientTraining and their failures (a full disk, EIO): the slot's
// lock, the write job for the slot, the boundary slot and extra copies, the agreed WriteFailed.
#include "snapshot_saver.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <cstdlib>
#include <iostream>

namespace ctorch::detail {

SnapshotSaver::SnapshotSaver(Options options)
    : o_(std::move(options)), boundarySlot_(boundarySlotFor(o_.slot)), writer_(o_.backgroundWrite) {}

bool SnapshotSaver::lockSlot(std::string& holder) {
  const char* id = std::getenv(contract::env::kRunId);
  std::string runId = id ? std::string(id).substr(0, 200) : std::string();
  for (char& c : runId)
    if (c == ' ' || c < 0x20 || c > 0x7e) c = '_';
  std::string detail;
  switch (slotLock_.acquire(o_.slot, runId, std::chrono::seconds(10), detail)) {
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
  if (o_.rank != 0 || writeError_) return;
  try {
    writer_.wait();
  } catch (const WriteFailed&) {
    writeError_ = std::current_exception();
  }
}

void SnapshotSaver::throwWriteFailed(std::int64_t globalStep) {
  const std::string at = "global step " + std::to_string(globalStep);
  if (o_.rank != 0)
    throw WriteFailed("rank " + std::to_string(o_.rank) + ": stopped at " + at +
                      " with every rank: rank 0 could not write the snapshot (its error names the file)");
  collectWriteError();
  try {
    if (writeError_) std::rethrow_exception(writeError_);
  } catch (const WriteFailed& e) {
    const std::int64_t durable = durableAt_.load();
    throw WriteFailed(std::string(e.what()) + "; " + o_.slot.string() +
                      (durable >= 0 ? " holds the last snapshot written (global step " + std::to_string(durable) + ")"
                                    : " keeps what it held before") +
                      "; every rank stopped at " + at + " (exit code " + std::to_string(contract::kExitWriteFailed) +
                      "): free space and run the same command again to resume");
  }
  throw WriteFailed("a snapshot write failed; every rank stopped at " + at);
}

void SnapshotSaver::write(Snapshot snapshot, bool boundary, const SaveExtras& extras, Targets targets,
                          std::string label, std::int64_t globalStep) {
  const bool onlyExtras = targets == Targets::kExtrasOnly;
  SnapshotJob job;
  job.snapshot = std::move(snapshot);
  auto add = [&job](const std::filesystem::path& path, int keep) {
    SnapshotSlotOptions slotOptions;
    slotOptions.path = path;
    slotOptions.keepPrevious = keep;
    job.slots.push_back(slotOptions);
  };
  if (!onlyExtras) {
    add(o_.slot, o_.keepPrevious);
    if (boundary) add(boundarySlot_, 1);
  }
  for (const auto& extra : extras.alsoWriteTo) add(extra, 0);
  if (job.slots.empty()) return;
  job.afterWrite = extras.afterWrite;
  job.report = [this](const std::string& line) { o_.say(line); };
  job.reportError = [this](const std::string& line) { std::cerr << o_.programName << ": " << line << std::endl; };
  job.label = std::move(label);
  if (!onlyExtras) {
    auto after = std::move(job.afterWrite);
    job.afterWrite = [this, after = std::move(after), globalStep] {
      if (after) after();
      durableAt_ = globalStep;
    };
  }
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
