// Writes snapshots on a background thread so that training goes on while a captured copy is
// encoded, written, fsync'ed and renamed (ctorch::saveSnapshot: crash-safe at any instant). One
// job at a time: submitting waits for the previous one; wait() before depending on a write.
#pragma once

#include "ctorch/snapshot.hpp"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ctorch {

struct SnapshotJob {
  Snapshot snapshot;
  std::vector<SnapshotSlotOptions> slots;     // written in order (the newest-snapshot slot first)
  std::function<void()> afterWrite;           // e.g. prune old checkpoint files
  std::function<void(const std::string&)> report;  // one line per job when done (may be empty)
  // The error line, at the moment a write fails (empty: printed to stderr).
  std::function<void(const std::string&)> reportError;
  std::string label;                          // "epoch 2 step 120" for the report
};

class SnapshotWriter {
 public:
  explicit SnapshotWriter(bool background);
  ~SnapshotWriter();  // finishes the job in flight (errors are reported, not thrown)
  SnapshotWriter(const SnapshotWriter&) = delete;
  SnapshotWriter& operator=(const SnapshotWriter&) = delete;

  // Waits for the previous job (rethrowing its error), then starts this one (or runs it now).
  // A job that fails on the file system (a full disk, an I/O error) fails with ctorch::WriteFailed,
  // whose message names the job, the file and the errno; the library's own errors (an item that
  // cannot be encoded) keep their type.
  void submit(SnapshotJob job);
  // Waits until nothing is in flight; rethrows the error of a failed job (once).
  void wait();
  // True once a write has failed (already reported); the loop then calls wait() to stop with it.
  bool failed() const { return failed_; }

 private:
  void run(SnapshotJob& job);
  void loop();
  static std::string describe(const std::exception_ptr& error);
  // The job's failure as it is kept and rethrown: WriteFailed("snapshot write failed (<label>): ...")
  // unless it is already one of the library's errors.
  static std::exception_ptr classify(const std::exception_ptr& error, const std::string& label);

  bool background_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<SnapshotJob> pending_;
  bool busy_ = false;
  bool stop_ = false;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  std::thread thread_;
};

}  // namespace ctorch
