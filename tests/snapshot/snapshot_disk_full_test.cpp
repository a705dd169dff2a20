// A full or failing disk (issue 27): every write, fsync and close of a snapshot, a state dict, an
// atomically replaced file and an append-only file fails in turn (CTORCH_TEST_IO_FAULT, the
// library's fault-injecting sink: ENOSPC and EIO), and each time the call fails with one error
// naming the file and the errno, leaves no temporary file, and leaves every file written before
// exactly as it was. Without the fix, a write failing inside the archive writer aborted the process.
#include "fixtures.hpp"

#include "multiproc.hpp"

#include <ctorch/durable_io.hpp>

#include <cerrno>
#include <cstdlib>
#include <map>
#include <system_error>

using namespace snaptest;
using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace {

// The fault for the duration of a scope (the library re-reads the variable when it changes).
struct Fault {
  explicit Fault(const std::string& spec) { ::setenv("CTORCH_TEST_IO_FAULT", spec.c_str(), 1); }
  ~Fault() { ::unsetenv("CTORCH_TEST_IO_FAULT"); }
};

// Every file in `dir` with its bytes.
std::map<std::string, std::string> contents(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename().string()] = ctorch::test::readFile(e.path());
  return out;
}

ctorch::Snapshot snapshotOf(torch::nn::Module& model, std::int64_t step) {
  return ctorch::captureSnapshot({&model, nullptr, nullptr}, identity(), {0, step, step});
}

ctorch::SnapshotSlotOptions slotKeeping(const fs::path& p, int keep) {
  ctorch::SnapshotSlotOptions o;
  o.path = p;
  o.keepPrevious = keep;
  return o;
}

// Calls `attempt` with the n-th call of `op` failing, n = 1, 2, ... until it succeeds; `check`
// runs after each failure with the error. Returns how many failed.
template <typename Attempt, typename Check>
int failEachCall(const std::string& op, const std::string& err, const std::string& match, Attempt attempt, Check check) {
  int failures = 0;
  for (int n = 1; n < 200; ++n) {
    bool threw = false;
    {
      Fault fault(op + ":" + std::to_string(n) + ":" + err + ":" + match);
      try {
        attempt();
      } catch (const std::system_error& e) {
        threw = true;
        INFO(op << " #" << n << " " << err << ": " << e.what());
        CHECK(e.code().value() == (err == "ENOSPC" ? ENOSPC : EIO));
        check(e);
      }
    }
    if (!threw) return failures;
    ++failures;
  }
  FAIL("still failing after 200 injected faults");
  return failures;
}

} // namespace

TEST_CASE("disk full: a snapshot write failing at any write, fsync or close leaves the slot and its rotation "
          "as they were, no temporary file, and one error naming the file and the errno", "[snapshot][files][diskfull]") {
  TempDir dir("snap-diskfull");
  const auto path = dir / "snapshot.pt";
  torch::manual_seed(3);
  torch::nn::Linear small(4, 3);
  torch::nn::Linear big(1024, 1536);  // a 6 MB snapshot: several writes, some straight from the tensor
  for (std::int64_t step = 1; step <= 3; ++step) {
    auto s = snapshotOf(*small, step);
    ctorch::saveSnapshot(s, slotKeeping(path, 2));
  }
  const auto before = contents(dir.path());
  REQUIRE(before.size() == 3);
  for (const std::string err : {"ENOSPC", "EIO"}) {
    for (const std::string op : {"write", "fsync", "close"}) {
      const int failed = failEachCall(op, err, "snapshot.pt", [&] {
        auto s = snapshotOf(*big, 4);
        ctorch::saveSnapshot(s, slotKeeping(path, 2));
      }, [&](const std::system_error& e) {
        CHECK_THAT(e.what(), Catch::Contains((dir / "snapshot.pt.tmp-").string()));
        CHECK(contents(dir.path()) == before);  // no temporary left, nothing rotated, nothing changed
      });
      INFO(op << " " << err);
      if (op == "write") CHECK(failed >= 3);  // every write of the archive was hit in turn (small records gathered, the big tensor direct)
      else CHECK(failed == 1);
      // The success that ended the loop rotated the slot: back to `before` for the next round.
      CHECK(ctorch::loadSnapshot(path).globalStep == 4);
      CHECK(ctorch::loadSnapshot(dir / "snapshot.pt.1").globalStep == 3);
      for (const auto& [name, bytes] : before) ctorch::test::writeFile(dir / name, bytes);
    }
  }
}

TEST_CASE("disk full: a state dict and an atomically replaced file keep their previous content", "[snapshot][files][diskfull]") {
  TempDir dir("state-diskfull");
  torch::nn::Linear model(256, 256);
  const auto weights = dir / "model.pt";
  const auto report = dir / "report.json";
  ctorch::saveStateDict(*model, weights);
  ctorch::writeFileAtomically(report, "{\"old\": true}\n");
  const auto before = contents(dir.path());
  for (const std::string err : {"ENOSPC", "EIO"})
    for (const std::string op : {"write", "fsync", "close"}) {
      failEachCall(op, err, "model.pt", [&] { ctorch::saveStateDict(*model, weights); },
                   [&](const std::system_error&) { CHECK(contents(dir.path()) == before); });
      failEachCall(op, err, "report.json", [&] { ctorch::writeFileAtomically(report, std::string(3 << 20, 'x')); },
                   [&](const std::system_error&) { CHECK(contents(dir.path()).at("report.json") == before.at("report.json")); });
      ctorch::test::writeFile(report, before.at("report.json"));
    }
}

TEST_CASE("disk full: an append-only file holds whole records only", "[snapshot][files][diskfull]") {
  TempDir dir("append-diskfull");
  const auto path = dir / "metrics.jsonl";
  ctorch::AppendOnlyFile log(path);
  log.append("{\"step\": 1}\n");
  {
    Fault fault("write:1:ENOSPC:metrics");
    CHECK_THROWS_AS(log.append(std::string(100000, 'x') + "\n"), std::system_error);
  }
  CHECK(ctorch::test::readFile(path) == "{\"step\": 1}\n");
  log.append("{\"step\": 2}\n");
  CHECK(ctorch::test::readFile(path) == "{\"step\": 1}\n{\"step\": 2}\n");
  {
    Fault fault("fsync:1:EIO:metrics");
    try {
      log.sync();
      FAIL("fsync did not fail");
    } catch (const std::system_error& e) {
      CHECK(e.code().value() == EIO);
      CHECK_THAT(e.what(), Catch::Contains(path.string()));
    }
  }
  CHECK_THROWS_WITH(ctorch::AppendOnlyFile(dir.path()), Catch::Contains("directory"));
}
