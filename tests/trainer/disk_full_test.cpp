// A full or failing disk under a real job (issue 27): rank 0's snapshot write fails (the library's
// fault-injecting sink, and a real 24 MB tmpfs filling up under the MNIST CNN's 6 MB snapshots):
// every rank stops at the same step with exit 74 and one line naming the file and the errno,
// ctorchrun neither restarts nor replaces anyone, no temporary file is left, the slot holds the
// last snapshot written, and the same command resumes from it once there is space. The metrics
// file is never emptied by a failed rewrite.
#include "trainer_test_util.hpp"

#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/train/report.hpp>

#include <sys/mount.h>

#include <cstdlib>

using namespace traintest;
using ctorch::test::TempDir;

namespace {

const std::vector<std::string> kDiskToy = {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                       "512", "--batch-size", "16", "--test-limit", "64", "--log-interval", "4",
                                       "--epochs", "3", "--save-every-steps", "3"};

std::vector<std::string> temporaries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp") != std::string::npos) out.push_back(e.path().filename().string());
  return out;
}

// The "(global step N)" that rank 0's error names as the last snapshot written, or -1.
std::int64_t lastWrittenIn(const std::string& output) {
  std::smatch m;
  static const std::regex pattern(R"(holds the last snapshot written \(global step (\d+)\))");
  return std::regex_search(output, m, pattern) ? std::stoll(m[1]) : -1;
}

} // namespace

TEST_CASE("disk full: rank 0's failed snapshot write stops every rank at one step with exit 74, no restart, "
          "the slot intact, and the same command resumes", "[trainer][process][diskfull]") {
  TempDir dir("diskfull-job");
  auto o = trainUnderLauncher(dir.path(), 2, kDiskToy, {"--max-restarts", "3"});
  o.setEnv["CTORCH_TEST_IO_FAULT"] = "write:4:ENOSPC:snapshot.pt";  // rank 0's 4th write to the slot
  const auto r = ctorch::test::run(o);
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitWriteFailed);
  CHECK_THAT(r.output, Catch::Contains("snapshot write failed"));
  CHECK_THAT(r.output, Catch::Contains("write ./snapshot.pt.tmp-"));
  CHECK_THAT(r.output, Catch::Contains("No space left on device"));
  CHECK_THAT(r.output, Catch::Contains("rank 0 could not write the snapshot"));  // rank 1's line
  CHECK_THAT(r.output, Catch::Contains("not restarting"));
  CHECK(r.output.find("restarting, restart") == std::string::npos);
  CHECK(r.output.find("replacing worker") == std::string::npos);
  CHECK(r.output.find("terminate called") == std::string::npos);
  CHECK(r.output.find("collectives give up") == std::string::npos);  // a disk is not a silent peer
  CHECK(temporaries(dir.path()).empty());
  const std::int64_t written = lastWrittenIn(r.output);
  REQUIRE(written > 0);
  CHECK(ctorch::loadSnapshot(dir / "snapshot.pt").globalStep == written);
  // Both ranks stopped at the same step: each says so with the same number.
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex(R"(every rank stopped at global step (\d+))")));
  const std::string stoppedAt = m[1];
  CHECK_THAT(r.output, Catch::Contains("rank 1: stopped at global step " + stoppedAt));

  // Space again: the same command resumes from the last snapshot written and finishes.
  auto again = trainUnderLauncher(dir.path(), 2, kDiskToy, {"--max-restarts", "3"});
  const auto r2 = ctorch::test::run(again);
  INFO(show(r2));
  REQUIRE(r2.ok());
  CHECK_THAT(r2.output, Catch::Contains("global step " + std::to_string(written)));
  CHECK(fs::exists(dir / "model.pt"));
}

TEST_CASE("disk full: with --sharding optimizer, rank 1's failed shard write stops every rank at one step with exit "
          "74, its error naming its shard file, and the same command resumes", "[trainer][process][diskfull][sharding]") {
  TempDir dir("diskfull-shard");
  std::vector<std::string> args = kDiskToy;
  args.insert(args.end(), {"--sharding", "optimizer"});
  auto o = trainUnderLauncher(dir.path(), 2, args, {"--max-restarts", "3"});
  o.setEnv["CTORCH_TEST_IO_FAULT"] = "write:3:ENOSPC:rank1.pt";  // only rank 1 writes these
  const auto r = ctorch::test::run(o);
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitWriteFailed);
  CHECK_THAT(r.output, Catch::Contains("write snapshot.pt.shards/rank1.pt.tmp-"));
  CHECK_THAT(r.output, Catch::Contains("No space left on device"));
  CHECK_THAT(r.output, Catch::Contains("rank 0: stopped at global step"));  // rank 0's own write was fine
  CHECK_THAT(r.output, Catch::Contains("a rank could not write its part of the snapshot"));
  CHECK_THAT(r.output, Catch::Contains("not restarting"));
  CHECK(r.output.find("terminate called") == std::string::npos);
  CHECK(temporaries(dir.path()).empty());
  CHECK(temporaries(dir / "snapshot.pt.shards").empty());
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex(R"(every rank stopped at global step (\d+))")));
  CHECK_THAT(r.output, Catch::Contains("rank 0: stopped at global step " + std::string(m[1])));

  auto again = trainUnderLauncher(dir.path(), 2, args, {"--max-restarts", "3"});
  const auto r2 = ctorch::test::run(again);
  INFO(show(r2));
  REQUIRE(r2.ok());
  // The snapshot rank 0 wrote at the failed step has no shard of rank 1: skipped, the one before resumes.
  CHECK_THAT(r2.output, Catch::Contains("lacks rank 1's shard"));
  CHECK_THAT(r2.output, Catch::Contains("exactly where it stopped"));
  CHECK(fs::exists(dir / "model.pt"));
}

TEST_CASE("disk full: the MNIST CNN filling a 24 MB tmpfs ends with exit 74 and one line, no crash, no temporary "
          "file, a loadable slot", "[trainer][process][diskfull]") {
  if (::geteuid() != 0) CTORCH_SKIP("mounting a tmpfs needs root");
  TempDir dir("diskfull-tmpfs");
  const fs::path mnt = dir / "small";
  fs::create_directories(mnt);
  if (::mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=24m") != 0)
    CTORCH_SKIP(std::string("cannot mount a tmpfs here: ") + std::strerror(errno));
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{mnt};
  // About 6 MB per snapshot (weights and momentum): the slot, its previous one, the epoch-boundary
  // slot and a temporary file do not fit.
  const auto r = ctorch::test::run(trainAlone(
      dir.path(), {"--model", "mnist-cnn", "--dataset", "synthetic-images", "--synthetic-size", "2048",
                   "--batch-size", "32", "--test-limit", "64", "--epochs", "2", "--save-every-steps", "4",
                   "--snapshot-path", (mnt / "snapshot.pt").string()},
      std::chrono::seconds(200)));
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitWriteFailed);
  CHECK_THAT(r.output, Catch::Contains("No space left on device"));
  CHECK(r.output.find("terminate called") == std::string::npos);
  CHECK(countMatches(r.output, std::regex("ctorch-train: error: ")) == 1);
  CHECK(temporaries(mnt).empty());
  const std::int64_t written = lastWrittenIn(r.output);
  REQUIRE(written > 0);
  CHECK(ctorch::loadSnapshot(mnt / "snapshot.pt").globalStep == written);
}

TEST_CASE("disk full: a metrics file that cannot be rewritten keeps its records, one that cannot be appended to "
          "keeps whole records, and the run is told once", "[trainer][diskfull]") {
  TempDir dir("diskfull-metrics");
  const fs::path path = dir / "metrics.jsonl";
  {
    ctorch::train::MetricsLog log(path, 0);
    for (std::int64_t step = 1; step <= 4; ++step) {
      ctorch::train::TrainRecord t;
      t.step = step;
      log.write(t);
    }
  }
  const std::string before = ctorch::test::readFile(path);
  REQUIRE(countMatches(before, std::regex("\n")) == 4);
  ::setenv("CTORCH_TEST_IO_FAULT", "write:1:ENOSPC:metrics.jsonl", 1);
  {
    ctorch::train::MetricsLog resumed(path, 2);  // would keep steps 1-2: the rewrite fails
    ctorch::train::TrainRecord t;
    t.step = 3;
    resumed.write(t);  // nothing more is written
  }
  ::unsetenv("CTORCH_TEST_IO_FAULT");
  CHECK(ctorch::test::readFile(path) == before);  // not emptied, not cut
  {
    ctorch::train::MetricsLog resumed(path, 2);
    ctorch::train::TrainRecord t;
    t.step = 3;
    resumed.write(t);
    ::setenv("CTORCH_TEST_IO_FAULT", "write:1:EIO:metrics.jsonl", 1);
    t.step = 4;
    resumed.write(t);
    ::unsetenv("CTORCH_TEST_IO_FAULT");
    t.step = 5;
    resumed.write(t);  // after a failure the log stays off: no gap filled with later records
  }
  const std::string after = ctorch::test::readFile(path);
  CHECK(countMatches(after, std::regex("\n")) == 3);
  CHECK(after.find("\"step\":3") != std::string::npos);
  CHECK(after.find("\"step\":4") == std::string::npos);
  CHECK(after.back() == '\n');
}
