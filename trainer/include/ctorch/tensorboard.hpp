// TensorBoard event files from a C++ training loop: ctorch::SummaryWriter reads like Python's
// torch.utils.tensorboard.SummaryWriter (addScalar, flush, close, purgeStep) and writes the files
// `tensorboard --logdir` opens: TFRecord framing with masked CRC-32C, Event and Summary protobufs.
//
// The few protobuf messages are encoded by hand (trainer/src/tensorboard/event_encoding.cpp), not with
// libprotobuf: LibTorch brings a protobuf of its own (built into pytorch.org's zips), and another in
// the same process risks clashing symbols; so the installed package needs nothing new
// (docs/tensorboard.md). No LibTorch here.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace ctorch {

struct SummaryWriterOptions {
  // Python's purge_step. The file then starts with a SessionLog START event at this step, and
  // TensorBoard hides the events of the run's earlier files at steps >= purgeStep: a run resumed
  // from a snapshot of step N passes N + 1 (its first new step), so the steps that the stopped
  // process logged after its snapshot, and that the resumed one logs again, appear once.
  // TensorBoard takes the first START of a run for the run's start and purges nothing on it: a run
  // that may be resumed passes purgeStep from its first process on (1 when it starts afresh), so
  // that the resumed process's START is not the first (ctorch-train does).
  std::optional<std::int64_t> purgeStep;
  // Python's max_queue: events held in memory before they are written (at least 1).
  std::size_t maxQueue = 10;
  // Python's flush_secs: held events are written when one is added this long after the last write.
  // No thread of its own: held events wait for the next add, flush() or close().
  std::chrono::milliseconds flushInterval = std::chrono::seconds(120);
  // Python's filename_suffix, appended to the event file's name.
  std::string filenameSuffix;
  // Where the one warning of a failed write goes (the disk is full). Default: stderr,
  // "ctorch: warning: ...".
  std::function<void(const std::string& message)> warn;
};

// One event file in `logDir`: events.out.tfevents.<seconds>.<host>.<pid>.<n>, as TensorBoard and
// PyTorch name them. The seconds are never earlier than an event file's already in `logDir`:
// TensorBoard reads a run's files in name order, and a resumed run's file must come after the one
// it continues even within the same second. The file opens with an Event holding file_version
// "brain.Event:2".
//
// A write that fails (ENOSPC, EIO) is said once through `warn` and the writer drops every later
// event: training goes on, and the file holds whole records only. Thread-safe. Not copyable.
class SummaryWriter {
 public:
  // Creates `logDir` (with its parents) and the event file. Throws ctorch::ConfigError when
  // something that is not a directory stands at `logDir` (or at one of its parents) or an option is
  // out of range, std::system_error naming the path when the directory or the file cannot be made
  // (EACCES, EROFS, ENOSPC).
  explicit SummaryWriter(const std::filesystem::path& logDir, SummaryWriterOptions options = {});
  ~SummaryWriter();  // close()
  SummaryWriter(const SummaryWriter&) = delete;
  SummaryWriter& operator=(const SummaryWriter&) = delete;

  // A point of the curve `tag` ("train/loss") at `globalStep`, stored as a float32 simple_value as
  // Python's add_scalar does. `wallTime`: seconds since the epoch (default: now). Nothing after
  // close() or a failed write.
  void addScalar(const std::string& tag, double value, std::int64_t globalStep,
                 std::optional<double> wallTime = std::nullopt);
  // Writes the held events to the file.
  void flush();
  // flush(), then closes the file. Idempotent.
  void close();

  const std::filesystem::path& logDir() const;
  // The event file being written.
  const std::filesystem::path& file() const;
  // Whether a write failed (the writer drops events since).
  bool failed() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ctorch
