#include <ctorch/durable_io.hpp>
#include <ctorch/errors.hpp>
#include <ctorch/tensorboard.hpp>

#include "tensorboard/event_encoding.hpp"
#include "tensorboard/tfrecord.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <iostream>
#include <mutex>
#include <system_error>

namespace ctorch {

namespace tensorboard {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kPrefix = "events.out.tfevents.";
// Held events are written once they take this much, whatever maxQueue says (a long tag).
constexpr std::size_t kMaxPendingBytes = std::size_t{1} << 20;

double secondsSinceEpoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Something that is not a directory where `dir` or one of its parents goes: a ConfigError naming
// it (create_directories would say "File exists").
void refuseNonDirectory(const fs::path& dir) {
  for (fs::path p = dir; !p.empty(); p = p.parent_path()) {
    std::error_code ec;
    const auto st = fs::status(p, ec);
    if (ec || !fs::exists(st)) {
      if (p == p.parent_path()) break;
      continue;
    }
    if (!fs::is_directory(st))
      throw ConfigError("the TensorBoard log directory '" + dir.string() + "' cannot be made: '" + p.string() +
                        "' is a file, not a directory (name another directory)");
    break;
  }
}

// The seconds of the newest event file in `dir` (by its name), or -1.
long long newestEventSeconds(const fs::path& dir) {
  long long newest = -1;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, kPrefix.size(), kPrefix) != 0) continue;
    const std::size_t dot = name.find('.', kPrefix.size());
    const std::string digits = name.substr(kPrefix.size(), dot - kPrefix.size());
    if (digits.empty() || digits.size() > 18 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    newest = std::max(newest, std::stoll(digits));
  }
  return newest;
}

std::string hostName() {
  char buffer[256] = {};
  if (::gethostname(buffer, sizeof buffer - 1) != 0 || !buffer[0]) return "localhost";
  std::string host(buffer);
  std::replace(host.begin(), host.end(), '/', '_');
  return host;
}

// events.out.tfevents.<%010d seconds>.<host>.<pid>.<n><suffix>, as TensorBoard's EventFileWriter.
fs::path eventFileName(const fs::path& dir, const std::string& suffix) {
  static std::atomic<std::uint64_t> counter{0};
  long long seconds = static_cast<long long>(secondsSinceEpoch());
  if (const long long newest = newestEventSeconds(dir); newest >= seconds) seconds = newest + 1;
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%010lld", seconds);
  return dir / (std::string(kPrefix) + stamp + "." + hostName() + "." + std::to_string(::getpid()) + "." +
                std::to_string(counter++) + suffix);
}

}  // namespace
}  // namespace tensorboard

namespace fs = std::filesystem;

struct SummaryWriter::State {
  using Clock = std::chrono::steady_clock;

  fs::path logDir;
  fs::path file;
  SummaryWriterOptions options;
  std::mutex mutex;
  std::optional<AppendOnlyFile> out;
  std::string pending;  // framed records not written yet
  std::size_t pendingEvents = 0;
  Clock::time_point lastWrite;
  bool failed = false;
  bool closed = false;

  void warn(const std::string& message) {
    if (options.warn)
      options.warn(message);
    else
      std::cerr << ("ctorch: warning: " + message + "\n") << std::flush;
  }

  // A write failed: said once; the writer drops every later event.
  void fail(const std::exception& e) {
    out.reset();
    failed = true;
    pending.clear();
    pendingEvents = 0;
    warn("cannot write the TensorBoard event file " + file.string() + " (" + e.what() +
         "): later events are dropped and training goes on; the file holds every whole event written before");
  }

  void writePending() {
    if (pending.empty() || !out) return;
    try {
      out->append(pending);  // whole or not at all (AppendOnlyFile cuts a partial write back)
    } catch (const std::exception& e) {
      fail(e);
      return;
    }
    pending.clear();
    pendingEvents = 0;
    lastWrite = Clock::now();
  }
};

SummaryWriter::SummaryWriter(const fs::path& logDir, SummaryWriterOptions options)
    : state_(std::make_unique<State>()) {
  State& s = *state_;
  if (logDir.empty()) throw ConfigError("SummaryWriter: the log directory is empty (name one, e.g. runs/exp1)");
  if (options.maxQueue < 1) throw ConfigError("SummaryWriterOptions::maxQueue must be at least 1 (got 0)");
  if (options.flushInterval.count() < 0)
    throw ConfigError("SummaryWriterOptions::flushInterval must not be negative (got " +
                      std::to_string(options.flushInterval.count()) + " ms)");
  s.logDir = logDir;
  s.options = std::move(options);
  tensorboard::refuseNonDirectory(logDir);
  std::error_code ec;
  fs::create_directories(logDir, ec);
  if (ec) throw std::system_error(ec, "cannot create the TensorBoard log directory '" + logDir.string() + "'");
  s.file = tensorboard::eventFileName(logDir, s.options.filenameSuffix);
  try {
    s.out.emplace(s.file, SymlinkPolicy::kRefuse);
  } catch (const std::system_error& e) {
    throw std::system_error(e.code(), "cannot create the TensorBoard event file " + s.file.string());
  } catch (const std::exception& e) {
    throw std::system_error(std::make_error_code(std::errc::io_error),
                            "cannot create the TensorBoard event file " + s.file.string() + ": " + e.what());
  }
  // The opening events go at once: a file without its version is not an event file.
  const double now = tensorboard::secondsSinceEpoch();
  std::string head;
  tensorboard::appendRecord(head, tensorboard::fileVersionEvent(now, 0));
  if (const auto purge = s.options.purgeStep) {  // as Python's SummaryWriter(purge_step=...)
    tensorboard::appendRecord(head, tensorboard::fileVersionEvent(now, *purge));
    tensorboard::appendRecord(head, tensorboard::sessionStartEvent(now, *purge));
  }
  try {
    s.out->append(head);
  } catch (const std::system_error& e) {
    s.out.reset();
    fs::remove(s.file, ec);
    throw std::system_error(e.code(), "cannot write the TensorBoard event file " + s.file.string());
  }
  s.lastWrite = State::Clock::now();
}

SummaryWriter::~SummaryWriter() {
  try {
    close();
  } catch (...) {  // a warn callback that throws: a destructor does not
  }
}

void SummaryWriter::addScalar(const std::string& tag, double value, std::int64_t globalStep,
                              std::optional<double> wallTime) {
  if (tag.empty()) throw ConfigError("SummaryWriter::addScalar: the tag is empty (name the curve, e.g. train/loss)");
  State& s = *state_;
  const std::string event =
      tensorboard::scalarEvent(wallTime ? *wallTime : tensorboard::secondsSinceEpoch(), globalStep, tag, static_cast<float>(value));
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.closed || s.failed) return;
  tensorboard::appendRecord(s.pending, event);
  ++s.pendingEvents;
  if (s.pendingEvents >= s.options.maxQueue || s.pending.size() >= tensorboard::kMaxPendingBytes ||
      State::Clock::now() - s.lastWrite >= s.options.flushInterval)
    s.writePending();
}

void SummaryWriter::flush() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.closed) s.writePending();
}

void SummaryWriter::close() {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.closed) return;
  s.writePending();
  s.closed = true;
  if (!s.out) return;
  try {
    s.out->close();  // a deferred write error (NFS) shows here
  } catch (const std::exception& e) {
    s.fail(e);
  }
  s.out.reset();
}

const fs::path& SummaryWriter::logDir() const { return state_->logDir; }
const fs::path& SummaryWriter::file() const { return state_->file; }

bool SummaryWriter::failed() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->failed;
}

}  // namespace ctorch
