#include <ctorch/durable_io.hpp>
#include <ctorch/errors.hpp>

#include "ctorch/train/report.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <system_error>

namespace ctorch::train {

namespace {

std::string fixed(double v, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", digits, v);
  return buffer;
}

// The learning rate in a readable width: 0.05, 0.000123, 1.2e-07.
std::string compact(double v) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.4g", v);
  return buffer;
}

std::string counter(std::int64_t value, std::int64_t total) {
  const std::string t = std::to_string(total);
  std::string v = std::to_string(value);
  if (v.size() < t.size()) v.insert(0, t.size() - v.size(), ' ');
  return v + "/" + t;
}

}  // namespace

std::string formatDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  if (seconds < 9.95) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.1f s", seconds);
    return buffer;
  }
  const auto total = static_cast<std::int64_t>(std::llround(seconds));
  if (total < 60) return std::to_string(total) + " s";
  const std::int64_t h = total / 3600, m = (total / 60) % 60, s = total % 60;
  char buffer[64];
  if (h > 0)
    std::snprintf(buffer, sizeof buffer, "%lld:%02lld:%02lld", static_cast<long long>(h), static_cast<long long>(m),
                  static_cast<long long>(s));
  else
    std::snprintf(buffer, sizeof buffer, "%lld:%02lld", static_cast<long long>(m), static_cast<long long>(s));
  return buffer;
}

Console::Console(std::ostream* out, ProgressMode mode, bool terminal) : out_(out) {
  if (mode == ProgressMode::kAuto) mode = terminal ? ProgressMode::kBar : ProgressMode::kLines;
  bar_ = mode == ProgressMode::kBar;
  lines_ = mode == ProgressMode::kLines;
}

void Console::finishBar() {
  if (barShown_) {
    *out_ << '\n';
    barShown_ = false;
  }
}

void Console::line(const std::string& text) {
  if (!out_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  finishBar();
  *out_ << text << std::endl;
}

void Console::progress(const StepReport& r, bool periodic) {
  if (!out_ || (!bar_ && !lines_)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string epochText = "epoch " + counter(r.epoch + 1, r.epochs);
  if (lines_) {
    if (!periodic) return;
    *out_ << epochText << "  step " << counter(r.stepInEpoch, r.stepsPerEpoch) << "  loss " << fixed(r.loss, 4)
          << "  lr " << compact(r.lr) << "  " << fixed(r.samplesPerSecond, 0) << " samples/s  ETA "
          << formatDuration(r.epochEtaSeconds) << " (run " << formatDuration(r.totalEtaSeconds) << ")"
          << std::endl;
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  const bool last = r.stepInEpoch >= r.stepsPerEpoch;
  if (!last && barShown_ && now - lastDraw_ < std::chrono::milliseconds(100)) return;
  lastDraw_ = now;
  constexpr int kWidth = 30;
  const double fraction = r.stepsPerEpoch > 0 ? static_cast<double>(r.stepInEpoch) / r.stepsPerEpoch : 1.0;
  const int filled = static_cast<int>(std::lround(fraction * kWidth));
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kWidth - filled), '.');
  *out_ << "\r" << epochText << " [" << bar << "] " << counter(r.stepInEpoch, r.stepsPerEpoch) << " loss "
        << fixed(r.loss, 4) << " " << fixed(r.samplesPerSecond, 0) << " samples/s ETA "
        << formatDuration(r.epochEtaSeconds) << "   " << std::flush;
  barShown_ = true;
}

MetricsLog::MetricsLog(const std::filesystem::path& path, std::int64_t resumeStep) : path_(path) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::string text;
  if (resumeStep > 0) {
    // The records kept are a subset of the file, so `text` is bounded by the reader's limit
    // (1 GiB: ~7 million train records of ~150 bytes, one every --log-interval steps).
    try {
      ctorch::readLinesBack(path, ctorch::ReadBackLimits{}, [&](std::string_view line) {
        const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (record.is_object() && record.contains("step") && record["step"].is_number_integer() &&
            record["step"].get<std::int64_t>() <= resumeStep)
          text.append(line).push_back('\n');
      });
    } catch (const ctorch::FileRefused& e) {
      // Not a file this trainer wrote (checkOutputs refuses most of these before the run starts;
      // this is what stands there now): one line, and the run does not replace it.
      throw ctorch::FileRefused("the metrics file " + std::string(e.what()) +
                                ": it is read back on resume and rewritten (move it away, or pass another "
                                "--metrics-file, or none)");
    } catch (const std::system_error& e) {
      disable(e, "it keeps what it held before");  // unreadable (EIO, EACCES): never replaced by less
      return;
    }
  }
  // Rewritten whole through a temporary file (every write, the fsync and the close checked): a
  // crash or a full disk leaves the old file or the new one, never an empty one. The rename
  // replaces whatever name stood there; the append never follows a link put there since.
  try {
    ctorch::writeFileAtomically(path, text);
    out_.emplace(path, ctorch::SymlinkPolicy::kRefuse);
  } catch (const std::exception& e) {
    disable(e, "it keeps what it held before");
  }
}

void MetricsLog::disable(const std::exception& e, const std::string& kept) {
  out_.reset();
  std::cerr << "ctorch-train: warning: cannot write the metrics file " << path_.string() << " (" << e.what()
            << "): the run goes on without metrics; " << kept << std::endl;
}

void MetricsLog::append(const std::string& jsonLine) {
  if (!out_) return;
  try {
    out_->append(jsonLine + '\n');
  } catch (const std::exception& e) {
    disable(e, "it holds every complete record up to the previous one");
  }
}

// The fields every metrics record has (kind, step, epoch), whatever its kind.
static nlohmann::json recordHead(const char* kind, std::int64_t step, nlohmann::json epoch) {
  nlohmann::json j;
  j["kind"] = kind;
  j["step"] = step;
  j["epoch"] = epoch;
  return j;
}

void MetricsLog::write(const TrainRecord& r) {
  nlohmann::json j = recordHead("train", r.step, r.epoch);
  j["loss"] = r.loss;
  j["lr"] = r.lr;
  j["samples_per_s"] = r.samplesPerSecond;
  j["time"] = r.time;
  if (!r.lossKind.empty()) j["loss_kind"] = r.lossKind;
  append(j.dump());
}

void MetricsLog::write(const EvalRecord& r) {
  nlohmann::json j = recordHead("eval", r.step, r.epoch);
  j["loss"] = r.loss;
  j["accuracy"] = r.accuracy ? nlohmann::json(*r.accuracy) : nlohmann::json(nullptr);
  j["correct"] = r.correct;
  j["count"] = r.count;
  j["time"] = r.time;
  append(j.dump());
}

void MetricsLog::write(const EpochRecord& r) {
  nlohmann::json j = recordHead("epoch", r.step, r.epoch);
  j["steps"] = r.steps;
  j["steps_run"] = r.stepsRun;
  if (r.resumedAt > 0) j["resumed_at"] = r.resumedAt;
  j["loss_steps"] = r.lossSteps;
  j["seconds"] = r.seconds;
  j["cpu_seconds"] = r.cpuSeconds;
  j["samples_per_s"] = r.samplesPerSecond;
  j["loss"] = r.loss;
  j["time"] = r.time;
  j["phase_seconds"] = {{"data", r.dataSeconds},
                        {"forward_backward", r.forwardBackwardSeconds},
                        {"optimizer", r.optimizerSeconds},
                        {"agreement", r.agreementSeconds}};
  j["reduce_seconds"] = r.reduceSeconds;
  j["reduce_wait_seconds"] = r.reduceWaitSeconds;
  append(j.dump());
}

void MetricsLog::write(const ResumeRecord& r) {
  nlohmann::json j = recordHead("resume", r.step, r.epoch);
  j["exact"] = r.exact;
  j["time"] = r.time;
  append(j.dump());
}

TensorBoardLog::TensorBoardLog(const std::filesystem::path& dir, std::int64_t resumeStep) {
  ctorch::SummaryWriterOptions options;
  options.purgeStep = resumeStep + 1;  // the first step this process runs; 1 for a fresh run
  options.maxQueue = 16;               // a record's scalars go together: write() flushes
  options.warn = [](const std::string& message) {
    std::cerr << ("ctorch-train: warning: " + message + "\n") << std::flush;
  };
  try {
    writer_.emplace(dir, std::move(options));
  } catch (const std::exception& e) {
    // checkOutputs() made and probed the directory before the run began: what stands there now.
    std::cerr << ("ctorch-train: warning: cannot write TensorBoard events in " + dir.string() + " (" +
                  ctorch::errorMessage(e) + "): the run goes on without them\n")
              << std::flush;
  }
}

std::optional<std::filesystem::path> TensorBoardLog::file() const {
  if (!writer_) return std::nullopt;
  return writer_->file();
}

void TensorBoardLog::write(const TrainRecord& r) {
  if (!writer_) return;
  writer_->addScalar("train/loss", r.loss, r.step);
  writer_->addScalar("train/lr", r.lr, r.step);
  writer_->addScalar("train/samples_per_s", r.samplesPerSecond, r.step);
  writer_->flush();
}

void TensorBoardLog::write(const EvalRecord& r) {
  if (!writer_) return;
  writer_->addScalar("eval/loss", r.loss, r.step);
  if (r.accuracy) writer_->addScalar("eval/accuracy", *r.accuracy, r.step);
  writer_->flush();
}

void TensorBoardLog::write(const EpochRecord& r) {
  if (!writer_) return;
  writer_->addScalar("epoch/loss", r.loss, r.step);
  writer_->addScalar("epoch/samples_per_s", r.samplesPerSecond, r.step);
  writer_->flush();
}

RunRecords::RunRecords(const std::optional<std::filesystem::path>& metricsFile,
                       const std::optional<std::filesystem::path>& tensorboardDir, std::int64_t resumeStep) {
  if (metricsFile) metrics_.emplace(*metricsFile, resumeStep);
  if (tensorboardDir) tensorboard_.emplace(*tensorboardDir, resumeStep);
}

}  // namespace ctorch::train
