#include "snapshot/background_writer.hpp"

#include "ctorch/errors.hpp"
#include "snapshot/portable_archive.hpp"

#include <c10/core/GradMode.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

namespace ctorch {

SnapshotWriter::SnapshotWriter(bool background) : background_(background) {
  if (background_) thread_ = std::thread([this] { loop(); });
}

SnapshotWriter::~SnapshotWriter() {
  if (!background_) return;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !pending_ && !busy_; });
    stop_ = true;
  }
  changed_.notify_all();
  thread_.join();  // a failed write was reported when it failed (see loop)
}

std::string SnapshotWriter::describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

std::exception_ptr SnapshotWriter::classify(const std::exception_ptr& error, const std::string& label) {
  try {
    std::rethrow_exception(error);
  } catch (const WriteFailed&) {
    return error;
  } catch (const Error&) {
    return error;  // e.g. ConfigError: a user item that cannot be encoded
  } catch (...) {
  }
  return std::make_exception_ptr(WriteFailed("snapshot write failed (" + label + "): " + describe(error)));
}

void SnapshotWriter::run(SnapshotJob& job) {
  c10::NoGradGuard noGrad;
  const auto start = std::chrono::steady_clock::now();
  std::size_t bytes = 0;
  // Encoded once for every file of the job (the slot, the epoch-boundary slot, extra copies); each
  // slot is checked before, as saveSnapshot checks it.
  std::optional<detail::PreparedArchive> prepared;
  for (const auto& slot : job.slots) {
    slot.validate();
    if (!prepared) prepared = detail::prepareSnapshot(job.snapshot);
    bytes = detail::writePreparedSnapshot(*prepared, slot);
  }
  if (job.afterWrite) job.afterWrite();
  if (job.report) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    char size[64];
    if (bytes >= 1000000)
      std::snprintf(size, sizeof size, "%.1f MB in %.2f s", static_cast<double>(bytes) / 1e6, seconds);
    else
      std::snprintf(size, sizeof size, "%.1f kB in %.2f s", static_cast<double>(bytes) / 1e3, seconds);
    std::ostringstream os;
    os << "snapshot written: " << job.slots.front().path.string();
    for (size_t i = 1; i < job.slots.size(); ++i) os << " and " << job.slots[i].path.string();
    os << " (" << job.label << ", " << size << ")";
    job.report(os.str());
  }
}

void SnapshotWriter::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stop_ || pending_.has_value(); });
    if (!pending_) return;
    SnapshotJob job = std::move(*pending_);
    pending_.reset();
    busy_ = true;
    lock.unlock();
    std::exception_ptr error;
    try {
      run(job);
    } catch (...) {
      error = std::current_exception();
    }
    if (error) {
      // Said at once, not at the next save: the run may go on for a long time believing its last
      // snapshot exists. The loop sees failed() and stops at its next step (wait() rethrows).
      error = classify(error, job.label);
      const std::string line = describe(error);
      if (job.reportError) job.reportError(line);
      else std::cerr << ("ctorch-train: " + line + "\n") << std::flush;  // one write, from this thread
      failed_ = true;
    }
    lock.lock();
    busy_ = false;
    if (error && !error_) error_ = error;
    changed_.notify_all();
  }
}

void SnapshotWriter::wait() {
  if (!background_) return;
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !pending_ && !busy_; });
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

void SnapshotWriter::submit(SnapshotJob job) {
  wait();
  if (!background_) {
    try {
      run(job);
    } catch (...) {
      failed_ = true;
      std::rethrow_exception(classify(std::current_exception(), job.label));
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ = std::move(job);
  }
  changed_.notify_all();
}

}  // namespace ctorch
