// The metrics file read back on resume (issue 40.7): what stands at metrics.jsonl is input like any
// other. A symbolic link (to /dev/zero, or to someone else's file), a FIFO, a directory or a file far
// larger than any metrics file is refused at once with one line naming it, rank 0's error is what
// ctorchrun's summary shows (refused before the group exists, or when read back after it), nothing
// is replaced; a long line is passed over without being held, and an ordinary resume keeps its
// records as before.
#include "trainer_test_util.hpp"

#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/errors.hpp>
#include <ctorch/train/report.hpp>

#include <fcntl.h>
#include <fstream>
#include <sys/stat.h>

using namespace traintest;
using ctorch::test::TempDir;

// Named (the tests are built as one unity source): the other files have a kToy and a with() too.
namespace hostile_metrics {

// Four train records, steps 1 to 4, written the way a run writes them.
void writeFourSteps(const fs::path& path) {
  ctorch::train::MetricsLog log(path, 0);
  for (std::int64_t step = 1; step <= 4; ++step) {
    ctorch::train::TrainRecord t;
    t.step = step;
    log.write(t);
  }
}

// MetricsLog(path, resumeStep) throws a ConfigError; its message (one line).
std::string refusal(const fs::path& path, std::int64_t resumeStep) {
  try {
    ctorch::train::MetricsLog log(path, resumeStep);
  } catch (const ctorch::ConfigError& e) {
    return e.what();
  }
  return "<not refused>";
}

// Bytes this process has read through read() and its kin so far (/proc/self/io's rchar), or -1.
long long bytesRead() {
  std::ifstream io("/proc/self/io");
  std::string key;
  long long value = 0;
  while (io >> key >> value)
    if (key == "rchar:") return value;
  return -1;
}

}  // namespace hostile_metrics

namespace hm = hostile_metrics;

TEST_CASE("metrics file: what is not a regular file is refused on resume without reading it, naming it",
          "[trainer][metrics][hostile]") {
  TempDir dir("metrics-hostile");
  const fs::path path = dir / "metrics.jsonl";
  // Nothing is read: not /dev/zero's endless bytes, not the 1 GiB file (a FIFO's open would block
  // for good, which CTest's timeout reports).
  const long long readBefore = hm::bytesRead();
  REQUIRE(readBefore >= 0);

  fs::create_symlink("/dev/zero", path);  // read without end, memory growing, before
  std::string m = hm::refusal(path, 5);
  CHECK(m.find(path.string()) != std::string::npos);
  CHECK(m.find("is a symbolic link (to '/dev/zero')") != std::string::npos);
  CHECK(m.find('\n') == std::string::npos);
  CHECK(fs::is_symlink(path));  // not replaced
  CHECK(fs::read_symlink(path) == "/dev/zero");
  fs::remove(path);

  // A link to a regular file: its records would be kept and the link replaced; a link lets another
  // place (someone else's file) decide what the rewrite holds.
  hm::writeFourSteps(dir / "elsewhere.jsonl");
  const std::string elsewhere = ctorch::test::readFile(dir / "elsewhere.jsonl");
  fs::create_symlink(dir / "elsewhere.jsonl", path);
  m = hm::refusal(path, 2);
  CHECK(m.find(path.string() + " is a symbolic link (to '" + (dir / "elsewhere.jsonl").string() + "')") !=
        std::string::npos);
  CHECK(fs::is_symlink(path));
  CHECK(ctorch::test::readFile(dir / "elsewhere.jsonl") == elsewhere);
  fs::remove(path);

  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);  // opening it for reading waited for a writer, before
  m = hm::refusal(path, 5);
  CHECK(m.find(path.string() + " is a FIFO") != std::string::npos);
  CHECK(fs::is_fifo(path));
  fs::remove(path);

  fs::create_directories(path / "inside");  // the rewrite failed on it, quietly, before
  m = hm::refusal(path, 5);
  CHECK(m.find(path.string() + " is a directory") != std::string::npos);
  CHECK(fs::is_directory(path / "inside"));
  fs::remove_all(path);

  // Far larger than any run's metrics (sparse: no disk used): refused by its size, nothing read.
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, (off_t{1} << 30) + 1) == 0);
    ::close(fd);
  }
  m = hm::refusal(path, 5);
  CHECK(m.find(path.string() + " is 1073741825 bytes") != std::string::npos);
  CHECK(fs::file_size(path) == (std::uintmax_t{1} << 30) + 1);  // not replaced
  fs::remove(path);

  // The link's target file and the four records written (well under a page each) are all it read.
  CHECK(hm::bytesRead() - readBefore < (1 << 20));
}

TEST_CASE("metrics file: a line longer than any record is passed over, the records around it kept",
          "[trainer][metrics][hostile]") {
  TempDir dir("metrics-long-line");
  const fs::path path = dir / "metrics.jsonl";
  hm::writeFourSteps(path);
  const std::string records = ctorch::test::readFile(path);
  // 8 MiB of digits with no newline between two good halves: held whole, it would be parsed whole.
  std::string text = records.substr(0, records.find('\n') + 1);
  text += std::string(8u << 20, '7') + "\n";
  text += records.substr(records.find('\n') + 1);
  ctorch::test::writeFile(path, text);
  {
    ctorch::train::MetricsLog resumed(path, 3);
    ctorch::train::TrainRecord t;
    t.step = 4;
    resumed.write(t);
  }
  const std::string after = ctorch::test::readFile(path);
  CHECK(after.size() < 4096);
  CHECK(countMatches(after, std::regex("\n")) == 4);
  for (int step = 1; step <= 4; ++step) CHECK(after.find("\"step\":" + std::to_string(step)) != std::string::npos);
  CHECK(!fs::is_symlink(path));
}

TEST_CASE("resume: metrics.jsonl linked to /dev/zero fails rank 0 at once, not rank 1 by timeout (issue 40.7)",
          "[trainer][process][metrics][hostile]") {
  TempDir dir("metrics-dev-zero");
  const fs::path metrics = dir / "metrics.jsonl";
  const auto first = ctorch::test::run(trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "1"})));
  INFO(show(first));
  REQUIRE(first.ok());
  fs::rename(metrics, dir / "metrics.saved");
  fs::create_symlink("/dev/zero", metrics);
  const std::string shown = (fs::path(".") / "metrics.jsonl").string();  // as the run names it (its cwd is dir)

  // Before: rank 0 read /dev/zero without end (memory growing) and rank 1 timed out in its first
  // step, after --timeout (30 min by default); the summary blamed rank 1.
  const auto r = ctorch::test::run(trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "2"}),
                                                      {"--max-restarts", "2"}, std::chrono::seconds(90)));
  INFO(show(r));
  // At once: rank 0's own refusal is the root cause, no rank waited for a timeout, nothing restarted.
  CHECK(r.exitCode == ctorch::contract::kExitUsage);
  CHECK_THAT(r.output, Catch::Contains("ctorch-train: error: --metrics-file '" + shown +
                                       "' is a symbolic link (to '/dev/zero')"));
  CHECK_THAT(r.output, Catch::Contains("root cause (first failure observed): rank 0, exit 2"));
  CHECK_THAT(r.output, Catch::Contains("a restart cannot fix"));
  CHECK(r.output.find("restarting, restart") == std::string::npos);
  CHECK(r.output.find("DistributedTimeout") == std::string::npos);
  CHECK(fs::is_symlink(metrics));

  // A FIFO and a directory there: the same, one line each (alone: a world of one).
  fs::remove(metrics);
  REQUIRE(::mkfifo(metrics.c_str(), 0600) == 0);
  const auto fifo =
      ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--epochs", "2"}), std::chrono::seconds(60)));
  INFO(show(fifo));
  CHECK(fifo.exitCode == ctorch::contract::kExitUsage);
  CHECK_THAT(fifo.output, Catch::Contains("--metrics-file '" + shown + "' is not a regular file"));
  CHECK(fs::is_fifo(metrics));
  fs::remove(metrics);
  fs::create_directories(metrics);
  const auto directory =
      ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--epochs", "2"}), std::chrono::seconds(60)));
  INFO(show(directory));
  CHECK(directory.exitCode == ctorch::contract::kExitUsage);
  CHECK_THAT(directory.output, Catch::Contains("--metrics-file '" + shown + "' is a directory"));
  fs::remove(metrics);

  // A regular file passes the check before the run, and is refused when it is read back (after the
  // group exists, rank 0 alone): still rank 0's error in the summary, not rank 1's lost peer.
  {
    const int fd = ::open(metrics.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::ftruncate(fd, (off_t{1} << 30) + 1) == 0);  // sparse
    ::close(fd);
  }
  const auto large = ctorch::test::run(trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "2"}),
                                                          {"--max-restarts", "2"}, std::chrono::seconds(90)));
  INFO(show(large));
  CHECK(large.exitCode == ctorch::contract::kExitUsage);
  CHECK_THAT(large.output, Catch::Contains("ctorch-train: error: the metrics file " + shown +
                                           " is 1073741825 bytes, more than the limit of 1073741824 bytes: it is "
                                           "read back on resume and rewritten"));
  CHECK_THAT(large.output, Catch::Contains("root cause (first failure observed): rank 0, exit 2"));
  CHECK_THAT(large.output, Catch::Contains("a restart cannot fix"));
  CHECK(large.output.find("restarting, restart") == std::string::npos);
  CHECK(large.output.find("DistributedTimeout") == std::string::npos);
  CHECK(fs::file_size(metrics) == (std::uintmax_t{1} << 30) + 1);
  fs::remove(metrics);

  // Control: the file itself back, the same resume runs and keeps the first epoch's records.
  fs::rename(dir / "metrics.saved", metrics);
  const std::string before = ctorch::test::readFile(metrics);
  const auto resumed = ctorch::test::run(trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "2"})));
  INFO(show(resumed));
  REQUIRE(resumed.ok());
  CHECK(resumed.output.find("resuming from") != std::string::npos);
  const std::string after = ctorch::test::readFile(metrics);
  CHECK(after.rfind(before, 0) == 0);
  CHECK(after.find("\"kind\":\"resume\"") != std::string::npos);
  CHECK(countMatches(after, std::regex(R"("kind":"epoch")")) == 2);
}
