// What rank 0 shows and records: a progress bar (stdout is a terminal) or plain periodic lines, the
// JSONL metrics file (one JSON object per line: "train" records every --log-interval steps, "epoch"
// records when an epoch's steps are done, "eval" records after each evaluation) and, with
// --tensorboard-dir, the same numbers as TensorBoard scalars. Other ranks hold a silent Console and
// no RunRecords.
#pragma once

#include "ctorch/train/options.hpp"

#include <ctorch/durable_io.hpp>
#include <ctorch/tensorboard.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>

namespace ctorch::train {

// "42 s", "3:07", "1:02:03"; "?" for a negative or non-finite duration.
std::string formatDuration(double seconds);

struct StepReport {
  std::int64_t epoch = 0;          // 0-based; shown 1-based
  std::int64_t epochs = 1;
  std::int64_t stepInEpoch = 0;    // steps done in this epoch
  std::int64_t stepsPerEpoch = 0;
  std::int64_t globalStep = 0;
  double loss = 0.0;               // mean over ranks and over the steps since the last report
  double lr = 0.0;
  double samplesPerSecond = 0.0;   // all ranks together
  double epochEtaSeconds = -1.0;
  double totalEtaSeconds = -1.0;
};

class Console {
 public:
  // `out` null: silent (ranks other than 0). `terminal`: whether `out` is a terminal (auto mode).
  Console(std::ostream* out, ProgressMode mode, bool terminal);

  // A whole line (a progress bar in the way is finished first). Thread-safe.
  void line(const std::string& text);
  // Periodic progress: redraws the bar (at most ~10 times a second), or writes a line when
  // `periodic` (every --log-interval steps) in line mode.
  void progress(const StepReport& report, bool periodic);
  bool silent() const { return out_ == nullptr; }
  bool barMode() const { return bar_; }

 private:
  void finishBar();
  std::ostream* out_;
  bool bar_ = false;
  bool lines_ = false;
  bool barShown_ = false;
  std::chrono::steady_clock::time_point lastDraw_{};
  std::mutex mutex_;
};

struct TrainRecord {
  std::int64_t step = 0;
  double epoch = 0.0;              // progress in epochs
  double loss = 0.0;
  double lr = 0.0;
  double samplesPerSecond = 0.0;
  double time = 0.0;               // training seconds since the run began (across resumes)
  std::string lossKind;            // lossKindName: "nll", "cross_entropy", "mse" (omitted when empty)
};

struct EvalRecord {
  std::int64_t step = 0;
  double epoch = 0.0;
  double loss = 0.0;
  std::optional<double> accuracy;  // classification only
  std::int64_t correct = 0;
  std::int64_t count = 0;
  double time = 0.0;
};

// The end of an epoch's steps (before evaluation).
struct EpochRecord {
  std::int64_t step = 0;
  std::int64_t epoch = 0;          // epochs completed
  std::int64_t steps = 0;          // steps of the epoch, before a mid-epoch resume included
  std::int64_t stepsRun = 0;       // steps this process ran (fewer after a mid-epoch resume)
  std::int64_t resumedAt = 0;      // the step in the epoch this process began at (0: its start)
  double seconds = 0.0;            // wall time of this process's steps
  double cpuSeconds = 0.0;         // CPU time this process (all its threads) spent in them
  double samplesPerSecond = 0.0;   // all ranks together
  double loss = 0.0;               // mean training loss of the epoch's steps (carried across a resume)
  std::int64_t lossSteps = 0;      // the steps `loss` covers: `steps` unless a stop between two
                                   // loss sums lost some (their losses were not summed yet)
  double time = 0.0;
  // Where `seconds` went on this rank (the rest: logging, metrics, --step-delay-ms).
  double dataSeconds = 0.0;             // waiting for batches
  double forwardBackwardSeconds = 0.0;  // including the wait for DDP's last gradient allreduce
  double optimizerSeconds = 0.0;
  double agreementSeconds = 0.0;        // the per-step allreduce (stop flag, loss), snapshot captures
  // The shared-memory gradient reduction (on its helper thread when overlapped; 0 when not in use),
  // and the part of it spent waiting for the other ranks.
  double reduceSeconds = 0.0;
  double reduceWaitSeconds = 0.0;
};

// This process continued a run from a snapshot (marked in metrics.png).
struct ResumeRecord {
  std::int64_t step = 0;
  double epoch = 0.0;  // progress in epochs
  bool exact = true;   // step for step (same world size), else from an epoch boundary
  double time = 0.0;
};

class MetricsLog {
 public:
  // Starts `path` afresh (resumeStep 0) or keeps only the records of steps <= resumeStep, so a run
  // that resumes from an older snapshot does not leave records of the steps it redoes. A file that
  // cannot be written (a full disk, EIO) is said once on stderr and the run goes on without
  // metrics; the file then holds whole records only (the old file, or those written before). On
  // resume, what stands at `path` must be a regular file (not a link, a FIFO, a device or a
  // directory) of at most 1 GiB: else ctorch::FileRefused (a ConfigError) naming it, and nothing
  // is replaced.
  MetricsLog(const std::filesystem::path& path, std::int64_t resumeStep);
  void write(const TrainRecord& record);
  void write(const EvalRecord& record);
  void write(const EpochRecord& record);
  void write(const ResumeRecord& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  void append(const std::string& jsonLine);
  // A write failed (a full disk): said once on stderr; no more records are written.
  void disable(const std::exception& e, const std::string& kept);
  std::filesystem::path path_;
  std::optional<ctorch::AppendOnlyFile> out_;
};

// --tensorboard-dir: the metrics file's numbers as TensorBoard scalars tagged <kind>/<field>
// (train/loss, train/lr, train/samples_per_s; epoch/loss, epoch/samples_per_s; eval/loss,
// eval/accuracy), each at the record's global step (docs/tensorboard.md). A new event file per
// process, opened with purgeStep resumeStep + 1, so TensorBoard hides what an earlier process logged
// after the snapshot this one resumed from, as MetricsLog drops those records. A directory or file
// that cannot be written is said once on stderr and the run goes on without TensorBoard events.
class TensorBoardLog {
 public:
  TensorBoardLog(const std::filesystem::path& dir, std::int64_t resumeStep);
  void write(const TrainRecord& record);
  void write(const EvalRecord& record);
  void write(const EpochRecord& record);
  // The event file, or nothing when it could not be made.
  std::optional<std::filesystem::path> file() const;

 private:
  std::optional<ctorch::SummaryWriter> writer_;
};

// Everything rank 0 records of the run: the metrics file and the TensorBoard events, each when asked for.
class RunRecords {
 public:
  RunRecords(const std::optional<std::filesystem::path>& metricsFile,
             const std::optional<std::filesystem::path>& tensorboardDir, std::int64_t resumeStep);
  template <typename Record>
  void write(const Record& record) {
    if (metrics_) metrics_->write(record);
    if (tensorboard_) tensorboard_->write(record);
  }
  void write(const ResumeRecord& record) {  // TensorBoard's own mark is the SessionLog START
    if (metrics_) metrics_->write(record);
  }
  // The TensorBoard event file being written, if any.
  std::optional<std::filesystem::path> tensorboardFile() const {
    return tensorboard_ ? tensorboard_->file() : std::nullopt;
  }

 private:
  std::optional<MetricsLog> metrics_;
  std::optional<TensorBoardLog> tensorboard_;
};

}  // namespace ctorch::train
