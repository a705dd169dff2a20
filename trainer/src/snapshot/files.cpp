// Snapshot files: crash-safe writing with rotation, verified loading, newest-valid search.
#include "ctorch/snapshot.hpp"
#include "ctorch/durable_io.hpp"

#include "core/file_io.hpp"
#include "snapshot/portable_archive.hpp"
#include "snapshot/slot_layout.hpp"

#include <cerrno>
#include <system_error>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cctype>

namespace ctorch {
namespace fs = std::filesystem;
namespace {

fs::path directoryOf(const fs::path& slot) {
  return slot.has_parent_path() ? slot.parent_path() : fs::path(".");
}

bool pathExists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(p, ec));
}

// CTORCH_TEST_SNAPSHOT_STALL_MS=N: every snapshot write pauses N ms with its temporary file half
// written, so that a fault-injection test (scripts/chaos) can kill the writer in the middle of a
// write, not just before or after it. Read once; unset (the normal case) means no pause.
std::chrono::milliseconds snapshotWriteStall() {
  static const std::chrono::milliseconds stall = [] {
    const char* v = std::getenv("CTORCH_TEST_SNAPSHOT_STALL_MS");
    if (!v || !*v) return std::chrono::milliseconds(0);
    char* end = nullptr;
    const long ms = std::strtol(v, &end, 10);
    return (end && *end == 0 && ms > 0 && ms <= 600000) ? std::chrono::milliseconds(ms)
                                                        : std::chrono::milliseconds(0);
  }();
  return stall;
}

// The suffix number of `name` if it is "<base>.<digits>", else -1.
long suffixNumber(const std::string& name, const std::string& base) {
  if (name.size() <= base.size() + 1 || name.compare(0, base.size(), base) != 0 ||
      name[base.size()] != '.')
    return -1;
  const std::string digits = name.substr(base.size() + 1);
  if (digits.size() > 9 || !std::all_of(digits.begin(), digits.end(), [](unsigned char c) {
        return std::isdigit(c) != 0;
      }))
    return -1;
  return std::stol(digits);
}

// Makes `link` another name of `current`, atomically replacing whatever `link` was. A hard link
// keeps `current` in place the whole time; where the file system has none, a durable copy does.
void linkAsPrevious(const fs::path& current, const fs::path& link) {
  const fs::path dir = directoryOf(current);
  const fs::path staging = current.parent_path() / (detail::temporaryPrefix(current) + "link");
  ::unlink(staging.c_str());
  if (::link(current.c_str(), staging.c_str()) != 0) {
    const int err = errno;
    if (err != EPERM && err != EXDEV && err != ENOTSUP && err != EOPNOTSUPP && err != EMLINK)
      throw std::system_error(err, std::generic_category(),
                              "link " + current.string() + " to " + staging.string());
    const auto data = detail::readWholeFile(current);
    const fs::path copy = detail::writeTempFile(dir, detail::temporaryPrefix(current) + "copy-",
                                                data.data(), data.size());
    detail::renameFile(copy, link);
    return;
  }
  detail::renameFile(staging, link);
}

void removeStaleTemporaries(const fs::path& slot) {
  const std::string prefix = detail::temporaryPrefix(slot);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(directoryOf(slot), ec)) {
    const std::string name = entry.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) == 0) fs::remove(entry.path(), ec);
  }
}

} // namespace

const char* writeStepName(SnapshotWriteStep step) {
  switch (step) {
    case SnapshotWriteStep::TempSynced: return "temp-synced";
    case SnapshotWriteStep::Rotated: return "rotated";
    case SnapshotWriteStep::PreviousLinked: return "previous-linked";
    case SnapshotWriteStep::Renamed: return "renamed";
    case SnapshotWriteStep::DirectorySynced: return "directory-synced";
  }
  return "?";
}

namespace {

bool namesAFile(const fs::path& path) {
  return !path.empty() && path.has_filename() && path.filename() != "." && path.filename() != "..";
}

}  // namespace

std::optional<std::string> snapshotPathProblem(const fs::path& path, const std::string& who) {
  if (path.empty()) return who + " is empty";
  const std::string named = who + " '" + path.string() + "'";
  if (!namesAFile(path)) return named + " does not name a file";
  std::error_code ec;
  const auto st = fs::symlink_status(path, ec);
  if (ec || !fs::exists(st) || fs::is_regular_file(st) || fs::is_symlink(st)) return std::nullopt;
  if (fs::is_directory(st)) {
    const std::string example = (path / "snapshot.pt").string();
    return named + " is a directory: name a file in it (e.g. " +
           (who.rfind("--", 0) == 0 ? who + " " + example : "'" + example + "'") + ")";
  }
  return named + " is not a regular file (a FIFO, socket or device): name a file";
}

void SnapshotSlotOptions::validate() const {
  if (auto problem = snapshotPathProblem(path, "snapshot path")) throw std::invalid_argument(*problem);
  if (keepPrevious < 0 || keepPrevious > 1000)
    throw std::invalid_argument("snapshot keep-previous must be in [0, 1000], got " +
                                std::to_string(keepPrevious));
}

std::size_t saveSnapshot(Snapshot& snapshot, const SnapshotSlotOptions& options) {
  options.validate();
  // Encoding (pickling) happens before the file system is touched: a snapshot that cannot be
  // encoded (an unsupported user item) leaves the slot as it was.
  return detail::writePreparedSnapshot(detail::prepareSnapshot(snapshot), options);
}

std::size_t detail::writePreparedSnapshot(const PreparedArchive& prepared, const SnapshotSlotOptions& options) {
  const fs::path& slot = options.path;
  const fs::path dir = directoryOf(slot);
  auto step = [&](SnapshotWriteStep s) {
    if (options.onWriteStep) options.onWriteStep(s);
  };
  if (options.fence) options.fence();  // before anything is touched (stale temporaries included)
  // The archive is streamed from the tensors into the file, not built in memory first (for a large
  // model that copy, and its fresh pages, slowed the training steps running beside the writer).
  // A folder made here (a sharded run's "<file>.shards") is made durable in its parent too.
  if (fs::create_directories(dir) && dir.has_parent_path()) detail::fsyncDirectory(dir.parent_path());
  removeStaleTemporaries(slot);

  // 1. The new content, complete and durable, under a temporary name nobody reads.
  std::size_t size = 0;
  const fs::path tmp = detail::writeTempFileStreaming(
      dir, detail::temporaryPrefix(slot), [&](const auto& sink) { prepared.write(sink); },
      prepared.sizeBound(), snapshotWriteStall(), &size);
  step(SnapshotWriteStep::TempSynced);

  try {
    if (options.fence) options.fence();  // again: the write may have taken long
    const bool hadCurrent = pathExists(slot);
    if (options.keepPrevious > 0) {
      // 2. Older ones move up one place: path.(K-1) -> path.K, ..., path.1 -> path.2. Each rename
      //    replaces its target atomically; path itself is not touched.
      for (int i = options.keepPrevious - 1; i >= 1; --i)
        if (pathExists(detail::keptFile(slot, i))) detail::renameFile(detail::keptFile(slot, i), detail::keptFile(slot, i + 1));
      step(SnapshotWriteStep::Rotated);
      // 3. The current one also becomes path.1 (a second name: path stays in place).
      if (hadCurrent) linkAsPrevious(slot, detail::keptFile(slot, 1));
      step(SnapshotWriteStep::PreviousLinked);
    }
    // 4. The new one replaces path in one atomic rename.
    detail::renameFile(tmp, slot);
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  step(SnapshotWriteStep::Renamed);
  // 5. Make the renames durable.
  detail::fsyncDirectory(dir);
  step(SnapshotWriteStep::DirectorySynced);

  // Numbers above K (left by a run with a larger K) are dropped so that K means K.
  std::error_code ec;
  const std::string base = slot.filename().string();
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const long n = suffixNumber(entry.path().filename().string(), base);
    if (n > options.keepPrevious) fs::remove(entry.path(), ec);
  }
  return size;
}

Snapshot loadSnapshot(const fs::path& file, const SnapshotExpectation& expect) {
  std::vector<char> bytes;
  try {
    bytes = detail::readWholeFile(file);
  } catch (const std::system_error& e) {
    if (e.code().value() == ENOENT) throw SnapshotNotFound(file);
    throw SnapshotError(file, "snapshot " + file.string() + " cannot be read: " + e.what());
  } catch (const detail::NotRegularFile& e) {
    throw SnapshotError(file, "snapshot " + file.string() + " cannot be read: " + e.what());
  }
  Snapshot s = decodeSnapshot(bytes, file);
  auto diffs = compareWithExpectation(s.header, expect);
  if (!diffs.empty()) throw SnapshotIncompatible(file, diffs);
  // What this run makes possible: the same run at the same world size has this many steps an epoch.
  if (expect.stepsPerEpoch && s.header.worldSize == expect.stepsPerEpochWorldSize &&
      s.stepInEpoch > *expect.stepsPerEpoch)
    throw SnapshotCorrupt(file, SnapshotCorrupt::Kind::BadContent,
                          "STEP_IN_EPOCH is " + std::to_string(s.stepInEpoch) + ", but an epoch of this run has " +
                              std::to_string(*expect.stepsPerEpoch) + " steps at world size " +
                              std::to_string(s.header.worldSize) + " (the snapshot's): no run like this one wrote it");
  return s;
}

std::vector<fs::path> listSnapshotFiles(const fs::path& slot) {
  std::vector<std::pair<long, fs::path>> found;
  const std::string base = slot.filename().string();
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(directoryOf(slot), ec)) {
    const std::string name = entry.path().filename().string();
    if (name == base) found.emplace_back(0, slot);
    else if (const long n = suffixNumber(name, base); n > 0) found.emplace_back(n, slot.parent_path() / name);
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<fs::path> out;
  for (auto& [n, p] : found) out.push_back(std::move(p));
  return out;
}

std::string SnapshotSearch::describeSkipped() const {
  std::string out;
  for (const auto& s : skipped)
    out += (out.empty() ? "" : "; ") + std::string("skipped ") + s.file.string() + ": " + s.reason;
  return out;
}

std::vector<std::string> setAsideSkipped(const std::vector<SkippedSnapshot>& skipped) {
  std::vector<std::string> lines;
  for (const auto& s : skipped) {
    std::error_code ec;
    const fs::path aside = detail::unusableFile(s.file);
    fs::rename(s.file, aside, ec);
    lines.push_back("set aside " + s.file.string() + " as " + aside.filename().string() +
                    (ec ? " failed: " + ec.message() : " (unusable; never read again)"));
  }
  return lines;
}

SnapshotSearch loadNewestValid(const fs::path& slot, const LoadNewestOptions& options) {
  SnapshotSearch result;
  for (const auto& file : listSnapshotFiles(slot)) {
    try {
      Snapshot candidate = loadSnapshot(file, options.expect);
      if (options.accept) options.accept(candidate);
      result.snapshot = std::move(candidate);
      return result;
    } catch (const SnapshotIncompatible& e) {
      if (!options.skipIncompatible) throw;
      result.skipped.push_back({file, e.what()});
    } catch (const SnapshotNotFound& e) {
      // Renamed away between listing and reading (a writer rotating): not an error.
      result.skipped.push_back({file, "disappeared while searching"});
    } catch (const SnapshotError& e) {
      result.skipped.push_back({file, e.what()});
    }
  }
  return result;
}

std::size_t saveStateDict(const torch::nn::Module& module, const fs::path& path) {
  if (!namesAFile(path))
    throw std::invalid_argument("state dict path '" + path.string() + "' does not name a file");
  const std::vector<char> bytes = detail::portableArchive(c10::IValue(captureModelState(module)));
  const fs::path dir = directoryOf(path);
  fs::create_directories(dir);
  writeFileAtomically(path, std::string_view(bytes.data(), bytes.size()));
  return bytes.size();
}

} // namespace ctorch
