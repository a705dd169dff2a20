// Snapshot files: rotation, newest-valid fallback, and crashes at every step of a write (real child
// processes killed with SIGKILL).
#include "fixtures.hpp"

#include "multiproc.hpp"

#include <csignal>
#include <sys/stat.h>
#include <fstream>
#include <thread>

using namespace snaptest;
using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace {

ctorch::Snapshot tinySnapshot(std::int64_t epochsRun) {
  torch::nn::Linear model(3, 2);
  auto s = ctorch::captureSnapshot({model.ptr().get(), nullptr, nullptr}, identity(), {epochsRun, 0, 0});
  return s;
}

// A snapshot of about `megabytes` MB (one big parameter) for the tests that kill a writer mid-write.
ctorch::Snapshot bigSnapshot(std::int64_t epochsRun, int megabytes) {
  torch::nn::Linear model(1024, megabytes * 256);
  return ctorch::captureSnapshot({model.ptr().get(), nullptr, nullptr}, identity(), {epochsRun, 0, 0});
}

std::int64_t epochsIn(const fs::path& file) { return ctorch::loadSnapshot(file).epochsRun; }

void writeBytes(const fs::path& p, const std::string& content) { ctorch::test::writeFile(p, content); }

std::vector<std::string> names(const std::vector<fs::path>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) out.push_back(p.filename().string());
  return out;
}

ctorch::SnapshotSlotOptions slot(const fs::path& p, int keep) {
  ctorch::SnapshotSlotOptions o;
  o.path = p;
  o.keepPrevious = keep;
  return o;
}

} // namespace

TEST_CASE("saves rotate and keep the K previous snapshots newest first", "[snapshot][files]") {
  TempDir dir("snap-rotate");
  const auto path = dir / "snapshot.pt";
  for (std::int64_t e = 1; e <= 5; ++e) {
    auto s = tinySnapshot(e);
    CHECK(ctorch::saveSnapshot(s, slot(path, 2)) > 1000);
  }
  CHECK(names(ctorch::listSnapshotFiles(path)) ==
        std::vector<std::string>{"snapshot.pt", "snapshot.pt.1", "snapshot.pt.2"});
  CHECK(epochsIn(path) == 5);
  CHECK(epochsIn(dir / "snapshot.pt.1") == 4);
  CHECK(epochsIn(dir / "snapshot.pt.2") == 3);
  // Hard links are replaced by renames, never written through: each file keeps its own content.
  CHECK(fs::hard_link_count(path) == 1);

  // Lowering K drops the surplus at the next save; K=0 keeps only the newest.
  auto s = tinySnapshot(6);
  ctorch::saveSnapshot(s, slot(path, 0));
  CHECK(names(ctorch::listSnapshotFiles(path)) == std::vector<std::string>{"snapshot.pt"});
  CHECK(epochsIn(path) == 6);
  // Nothing but the slot's own files is left in the directory (no temporaries).
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  CHECK(entries == 1);
}

TEST_CASE("listing ignores foreign names and orders by number", "[snapshot][files]") {
  TempDir dir("snap-list");
  for (const char* n : {"snapshot.pt.10", "snapshot.pt.2", "snapshot.pt", "snapshot.pt.x",
                        "snapshot.pt.tmp-1-0", "snapshot.ptt", "other.pt.1", "snapshot.pt.3.bak"})
    writeBytes(dir / n, "x");
  CHECK(names(ctorch::listSnapshotFiles(dir / "snapshot.pt")) ==
        std::vector<std::string>{"snapshot.pt", "snapshot.pt.2", "snapshot.pt.10"});
  CHECK(ctorch::listSnapshotFiles(dir / "none.pt").empty());
}

TEST_CASE("setAsideSkipped keeps a corrupt newest file from being rotated over a good fallback", "[snapshot][files]") {
  TempDir dir("snap-aside");
  const auto path = dir / "snapshot.pt";
  for (std::int64_t e = 1; e <= 2; ++e) {
    auto s = tinySnapshot(e);
    ctorch::saveSnapshot(s, slot(path, 1));
  }
  fs::resize_file(path, fs::file_size(path) / 2);  // the newest (epoch 2) is cut short
  auto found = ctorch::loadNewestValid(path);
  REQUIRE(found.snapshot);
  CHECK(found.snapshot->epochsRun == 1);
  REQUIRE(found.skipped.size() == 1);

  const auto lines = ctorch::setAsideSkipped(found.skipped);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains("snapshot.pt.unusable"));
  CHECK(fs::exists(dir / "snapshot.pt.unusable"));
  CHECK_FALSE(fs::exists(path));

  // The next save rotates nothing corrupt: the good epoch-1 snapshot stays the kept one.
  auto next = tinySnapshot(3);
  ctorch::saveSnapshot(next, slot(path, 1));
  CHECK(epochsIn(path) == 3);
  CHECK(epochsIn(dir / "snapshot.pt.1") == 1);
  CHECK(names(ctorch::listSnapshotFiles(path)) == std::vector<std::string>{"snapshot.pt", "snapshot.pt.1"});
}

TEST_CASE("loadNewestValid falls back past corrupt files and says why", "[snapshot][files]") {
  TempDir dir("snap-fallback");
  const auto path = dir / "snapshot.pt";
  for (std::int64_t e = 1; e <= 3; ++e) {
    auto s = tinySnapshot(e);
    ctorch::saveSnapshot(s, slot(path, 3));
  }
  // Control: all intact, the newest wins and nothing is skipped.
  auto clean = ctorch::loadNewestValid(path);
  REQUIRE(clean.snapshot);
  CHECK(clean.snapshot->epochsRun == 3);
  CHECK(clean.snapshot->source == path);
  CHECK(clean.skipped.empty());

  // Newest zeroed, the one before truncated: the third is used.
  const auto size = fs::file_size(path);
  writeBytes(path, std::string(size, '\0'));
  fs::resize_file(dir / "snapshot.pt.1", fs::file_size(dir / "snapshot.pt.1") / 2);
  auto found = ctorch::loadNewestValid(path);
  REQUIRE(found.snapshot);
  CHECK(found.snapshot->epochsRun == 1);
  CHECK(found.snapshot->source == dir / "snapshot.pt.2");
  REQUIRE(found.skipped.size() == 2);
  CHECK(found.skipped[0].file == path);
  CHECK_THAT(found.skipped[0].reason, Catch::Contains("(zeroed)"));
  CHECK(found.skipped[1].file == dir / "snapshot.pt.1");
  CHECK_THAT(found.skipped[1].reason, Catch::Contains("(truncated)"));
  CHECK_THAT(found.describeSkipped(), Catch::StartsWith("skipped " + path.string() + ": "));

  // Nothing valid at all: no snapshot, every file accounted for.
  writeBytes(dir / "snapshot.pt.2", "garbage");
  writeBytes(dir / "snapshot.pt.3", "");
  auto none = ctorch::loadNewestValid(path);
  CHECK_FALSE(none.snapshot);
  CHECK(none.skipped.size() == 4);

  // No files: nothing found, nothing skipped (a fresh start).
  auto fresh = ctorch::loadNewestValid(dir / "other.pt");
  CHECK_FALSE(fresh.snapshot);
  CHECK(fresh.skipped.empty());
}

TEST_CASE("an incompatible newest snapshot stops the search unless told to skip", "[snapshot][files]") {
  TempDir dir("snap-incompatible");
  const auto path = dir / "snapshot.pt";
  torch::nn::Linear model(3, 2);
  auto a = ctorch::captureSnapshot({model.ptr().get(), nullptr, nullptr}, identity("mlp"), {1, 0, 0});
  ctorch::saveSnapshot(a, slot(path, 2));
  auto b = ctorch::captureSnapshot({model.ptr().get(), nullptr, nullptr}, identity("convnet"), {2, 0, 0});
  ctorch::saveSnapshot(b, slot(path, 2));

  ctorch::LoadNewestOptions options;
  options.expect.modelName = "mlp";
  CHECK_THROWS_WITH(ctorch::loadNewestValid(path, options),
                    Catch::Contains(path.string()) &&
                        Catch::Contains("model name is 'convnet' in the snapshot, 'mlp' in this run"));
  options.skipIncompatible = true;
  auto found = ctorch::loadNewestValid(path, options);
  REQUIRE(found.snapshot);
  CHECK(found.snapshot->epochsRun == 1);
  REQUIRE(found.skipped.size() == 1);
  CHECK_THAT(found.skipped[0].reason, Catch::Contains("'convnet'"));

  CHECK_THROWS_AS(ctorch::loadSnapshot(dir / "missing.pt"), ctorch::SnapshotNotFound);
}

TEST_CASE("stale temporaries of a crashed write are removed by the next save", "[snapshot][files]") {
  TempDir dir("snap-stale");
  const auto path = dir / "snapshot.pt";
  writeBytes(dir / "snapshot.pt.tmp-999-0", "half a snapshot");
  writeBytes(dir / "snapshot.pt.tmp-link", "x");
  writeBytes(dir / "keep.me", "x");
  auto s = tinySnapshot(1);
  ctorch::saveSnapshot(s, slot(path, 1));
  CHECK_FALSE(fs::exists(dir / "snapshot.pt.tmp-999-0"));
  CHECK_FALSE(fs::exists(dir / "snapshot.pt.tmp-link"));
  CHECK(fs::exists(dir / "keep.me"));
}

TEST_CASE("slot options are validated", "[snapshot][files]") {
  auto s = tinySnapshot(1);
  CHECK_THROWS_WITH(ctorch::saveSnapshot(s, slot("", 1)), Catch::Contains("snapshot path is empty"));
  CHECK_THROWS_WITH(ctorch::saveSnapshot(s, slot("/tmp/x/", 1)), Catch::Contains("does not name a file"));
  CHECK_THROWS_WITH(ctorch::saveSnapshot(s, slot("/tmp/x.pt", -1)),
                    Catch::Contains("keep-previous must be in [0, 1000], got -1"));
}

// One rule for a slot's path, asked by every layer in its own terms (issue 41.5).
TEST_CASE("a slot's path: a file name, and what is there a regular file or a link", "[snapshot][files]") {
  TempDir dir("snap-path");
  const fs::path fifo = dir / "fifo", sub = dir / "sub", file = dir / "file.pt", link = dir / "link.pt";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  fs::create_directories(sub);
  writeBytes(file, "x");
  fs::create_symlink(file, link);
  const auto problem = [](const fs::path& p) { return ctorch::snapshotPathProblem(p, "--snapshot-path").value_or("ok"); };
  CHECK(problem("") == "--snapshot-path is empty");
  CHECK(problem(dir / "") == "--snapshot-path '" + (dir / "").string() + "' does not name a file");
  CHECK(problem(dir / "..") == "--snapshot-path '" + (dir / "..").string() + "' does not name a file");
  CHECK(problem(sub) == "--snapshot-path '" + sub.string() + "' is a directory: name a file in it (e.g. --snapshot-path " +
                            (sub / "snapshot.pt").string() + ")");
  CHECK(ctorch::snapshotPathProblem(sub, "ResilienceOptions::snapshotPath").value_or("") ==
        "ResilienceOptions::snapshotPath '" + sub.string() + "' is a directory: name a file in it (e.g. '" +
            (sub / "snapshot.pt").string() + "')");
  CHECK(problem(fifo) == "--snapshot-path '" + fifo.string() + "' is not a regular file (a FIFO, socket or device): name a file");
  CHECK(problem(file) == "ok");
  CHECK(problem(link) == "ok");
  CHECK(problem(dir / "absent.pt") == "ok");
  // The slot itself refuses the FIFO before writing anything.
  auto s = tinySnapshot(1);
  CHECK_THROWS_WITH(ctorch::saveSnapshot(s, slot(fifo, 1)), Catch::Contains("is not a regular file"));
  CHECK(fs::is_fifo(fifo));
}

// ---- Crashes ----------------------------------------------------------------------------------------
// Saves epochsRun=1 (and 2 when keep>1 so that rotation has something to move), then the next one
// with a hook that kills the process right after step `crashAfter` ("none": no crash).
CTORCH_TEST_WORKER(crash_during_save) {
  const fs::path path = args.at(0);
  const int keep = std::stoi(args.at(1));
  const std::string crashAfter = args.at(2);
  auto options = slot(path, keep);
  std::int64_t e = 1;
  for (; e <= 2; ++e) {
    auto s = tinySnapshot(e);
    ctorch::saveSnapshot(s, options);
  }
  options.onWriteStep = [&](ctorch::SnapshotWriteStep step) {
    if (crashAfter == ctorch::writeStepName(step)) std::raise(SIGKILL);
  };
  auto s = tinySnapshot(e);
  ctorch::saveSnapshot(s, options);
  return 0;
}

TEST_CASE("a crash after any step of a write leaves a valid snapshot in the slot", "[snapshot][crash]") {
  using Step = ctorch::SnapshotWriteStep;
  const Step steps[] = {Step::TempSynced, Step::Rotated, Step::PreviousLinked, Step::Renamed,
                        Step::DirectorySynced};
  struct Run {
    int keep;
    Step step;
    std::unique_ptr<TempDir> dir;
    std::unique_ptr<ctorch::test::Process> process;
  };
  // All crashing writers run side by side, each in its own directory.
  std::vector<Run> runs;
  for (int keep : {0, 1, 3}) {
    for (Step step : steps) {
      if (keep == 0 && (step == Step::Rotated || step == Step::PreviousLinked)) continue;  // no such step
      Run run{keep, step, std::make_unique<TempDir>("snap-crash"), nullptr};
      ctorch::test::SpawnOptions so;
      so.argv = {ctorch::test::selfExe().string(), "--ctorch-worker", "crash_during_save",
                 (run.dir->path() / "snapshot.pt").string(), std::to_string(keep),
                 ctorch::writeStepName(step)};
      so.timeout = std::chrono::seconds(60);
      run.process = std::make_unique<ctorch::test::Process>(so);
      runs.push_back(std::move(run));
    }
  }
  for (auto& run : runs) {
    INFO("keep " << run.keep << ", crash after " << ctorch::writeStepName(run.step));
    const auto r = run.process->wait();
    INFO(r.output);
    REQUIRE(r.termSignal == SIGKILL);  // it really died mid-write

    // The slot holds the old (2) or the new (3) snapshot, intact: the new one once renamed.
    const auto path = run.dir->path() / "snapshot.pt";
    const bool renamed = run.step == Step::Renamed || run.step == Step::DirectorySynced;
    REQUIRE(fs::exists(path));
    CHECK(epochsIn(path) == (renamed ? 3 : 2));
    auto found = ctorch::loadNewestValid(path);
    REQUIRE(found.snapshot);
    CHECK(found.skipped.empty());
    CHECK(found.snapshot->epochsRun == (renamed ? 3 : 2));
    // Every kept file is a valid snapshot too (at worst a duplicate of a neighbour).
    for (const auto& f : ctorch::listSnapshotFiles(path)) CHECK_NOTHROW(ctorch::loadSnapshot(f));
    if (run.keep > 0 && renamed) CHECK(epochsIn(run.dir->path() / "snapshot.pt.1") == 2);
  }
  // Control: the same worker without a crash finishes and leaves the new snapshot.
  TempDir dir("snap-nocrash");
  ctorch::test::SpawnOptions so;
  so.argv = {ctorch::test::selfExe().string(), "--ctorch-worker", "crash_during_save",
             (dir / "snapshot.pt").string(), "2", "none"};
  const auto r = ctorch::test::run(so);
  REQUIRE(r.ok());
  CHECK(epochsIn(dir / "snapshot.pt") == 3);
  CHECK(epochsIn(dir / "snapshot.pt.1") == 2);
  CHECK(epochsIn(dir / "snapshot.pt.2") == 1);
}

// Writes ever newer large snapshots until killed, printing "saved N" after each.
CTORCH_TEST_WORKER(save_forever) {
  const fs::path path = args.at(0);
  for (std::int64_t e = 1; e < 1000; ++e) {
    auto s = bigSnapshot(e, 24);
    ctorch::saveSnapshot(s, slot(path, 2));
    std::printf("saved %lld\n", static_cast<long long>(e));
    std::fflush(stdout);
  }
  return 0;
}

TEST_CASE("killing a writer during large writes never leaves a broken slot", "[snapshot][crash]") {
  TempDir dir("snap-kill");
  const auto path = dir / "snapshot.pt";
  // Several kills at moments that fall wherever the writer happens to be (encoding, writing,
  // fsync, renaming); whatever the moment, the slot must hold the last or the next snapshot.
  for (int round = 0; round < 3; ++round) {
    ctorch::test::SpawnOptions so;
    so.argv = {ctorch::test::selfExe().string(), "--ctorch-worker", "save_forever", path.string()};
    so.timeout = std::chrono::seconds(60);
    ctorch::test::Process p(so);
    auto lastSaved = [&]() -> long {
      const std::string out = p.outputSoFar();
      const auto at = out.rfind("saved ");
      return at == std::string::npos ? 0 : std::stol(out.substr(at + 6));
    };
    const long target = 2 + round;  // wait for a few saves so that rotation is under way
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(50);
    while (lastSaved() < target && p.running() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    REQUIRE(lastSaved() >= target);
    // A varying delay into the next save.
    std::this_thread::sleep_for(std::chrono::milliseconds(40 + 70 * round));
    p.signalGroup(SIGKILL);
    const auto r = p.wait();
    const long saved = lastSaved();
    INFO("round " << round << ": last reported save " << saved);
    REQUIRE(r.termSignal == SIGKILL);
    auto found = ctorch::loadNewestValid(path);
    REQUIRE(found.snapshot);
    CHECK(found.skipped.empty());
    CHECK(found.snapshot->source == path);
    CHECK(found.snapshot->epochsRun >= saved);
    CHECK(found.snapshot->epochsRun <= saved + 1);
    for (const auto& f : ctorch::listSnapshotFiles(path)) CHECK_NOTHROW(ctorch::loadSnapshot(f));
    fs::remove_all(dir.path());
    fs::create_directories(dir.path());
  }
}
