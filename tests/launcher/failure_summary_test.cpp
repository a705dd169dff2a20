// Error files in torchrun's schema (both forms) and the failure summary table.
#include "ctorch_catch.hpp"

#include "ctorch/launcher/failure_summary.hpp"
#include "multiproc.hpp"

#include <csignal>

using namespace ctorch::launcher;

TEST_CASE("failure summary: error files in both torchrun forms / and broken ones") {
  ctorch::test::TempDir dir;
  auto full = dir / "full.json";
  ctorch::test::writeFile(full, R"({"message": {"message": "RuntimeError: boom\nsecond line",
      "extraInfo": {"py_callstack": "Traceback:\n  line 1", "timestamp": "1700000000"}}})");
  auto e = readErrorFile(full);
  REQUIRE(e);
  CHECK(e->message == "RuntimeError: boom\nsecond line");
  CHECK(e->callstack == "Traceback:\n  line 1");
  REQUIRE(e->timestamp);
  CHECK(std::chrono::system_clock::to_time_t(*e->timestamp) == 1700000000);
  auto simple = dir / "simple.json";
  ctorch::test::writeFile(simple, R"({"message": "plain text"})");
  CHECK(readErrorFile(simple)->message == "plain text");
  auto broken = dir / "broken.json";
  ctorch::test::writeFile(broken, R"({"message": {"mess)");
  CHECK_FALSE(readErrorFile(broken));
  CHECK_FALSE(readErrorFile(dir / "missing.json"));
}

TEST_CASE("failure summary: an error file that says a restart cannot help is read as such") {
  ctorch::test::TempDir dir;
  const auto never = dir / "never.json", plain = dir / "plain.json";
  ctorch::test::writeFile(never, R"({"message": {"message": "ctorch::ConfigError: x", "extraInfo": {"py_callstack": "", "timestamp": "1700000000", "ctorch_retry": "never"}}})");
  ctorch::test::writeFile(plain, R"({"message": {"message": "RuntimeError: y", "extraInfo": {"timestamp": "1700000000", "ctorch_retry": 1}}})");
  REQUIRE(ctorch::launcher::readErrorFile(never));
  CHECK(ctorch::launcher::readErrorFile(never)->retryNever);
  REQUIRE(ctorch::launcher::readErrorFile(plain));
  CHECK_FALSE(ctorch::launcher::readErrorFile(plain)->retryNever);  // only the string "never" counts
}

TEST_CASE("failure summary: error-file times keep the precision they have - no invented .000") {
  ctorch::test::TempDir dir;
  auto whole = dir / "whole.json";
  ctorch::test::writeFile(whole, R"({"message": {"message": "E", "extraInfo": {"timestamp": "1700000000"}}})");
  auto frac = dir / "frac.json";
  ctorch::test::writeFile(frac, R"({"message": {"message": "E", "extraInfo": {"timestamp": "1700000000.257"}}})");
  auto num = dir / "num.json";
  ctorch::test::writeFile(num, R"({"message": {"message": "E", "extraInfo": {"timestamp": 1700000000.5}}})");
  FailureReport r;
  r.program = "train";
  r.numWorkers = 3;
  int rank = 0;
  for (const auto& path : {whole, frac, num}) {
    FailureRecord f;
    f.globalRank = rank++;
    f.status = ExitStatus::exited(1);
    f.errorFile = path;
    f.error = readErrorFile(path);
    REQUIRE(f.error);
    r.failures.push_back(f);
  }
  std::string table = formatFailureSummary(r);
  INFO(table);
  CHECK(table.find(".000") == std::string::npos);
  CHECK(table.find(formatTime(std::chrono::system_clock::from_time_t(1700000000), false) + "  ") != std::string::npos);
  CHECK(table.find(":20.257") != std::string::npos);  // 1700000000 is ..:13:20 in any whole-hour zone
  CHECK(table.find(":20.500") != std::string::npos);
}

// Issue 28.7: a root cause without an error file says how the program would write one.
TEST_CASE("failure summary: a missing error file says how a Python or a C++ program writes one") {
  FailureReport r;
  r.program = "train.py";
  r.python = true;
  FailureRecord a;
  a.globalRank = 0;
  a.status = ExitStatus::exited(1);
  a.errorFile = "/tmp/x/error.json";
  r.failures = {a};
  CHECK_THAT(formatFailureSummary(r), Catch::Contains("(not written)") && Catch::Contains("@record"));
  r.python = false;
  CHECK_THAT(formatFailureSummary(r), Catch::Contains("ctorch::runRecorded"));
  r.failures[0].status = ExitStatus::killed(SIGKILL);  // killed: no program could have written it
  CHECK(formatFailureSummary(r).find("ctorch::runRecorded") == std::string::npos);
}

TEST_CASE("failure summary: table with the root cause first and marked") {
  FailureReport r;
  r.program = "train";
  r.runId = "job1";
  r.attempt = 2;
  r.maxRestarts = 2;
  r.numWorkers = 4;
  r.stoppedByAgent = 2;
  FailureRecord a;
  a.globalRank = 3;
  a.localRank = 3;
  a.host = "nodeA";
  a.pid = 4321;
  a.status = ExitStatus::killed(SIGSEGV);
  a.errorFile = "/tmp/x/error.json";
  a.error = ErrorFileInfo{"ValueError: bad shape", "frame 1\nframe 2", std::nullopt};
  FailureRecord b;
  b.globalRank = 1;
  b.localRank = 1;
  b.host = "nodeA";
  b.pid = 4319;
  b.status = ExitStatus::exited(7);
  r.failures = {a, b};
  std::string s = formatFailureSummary(r);
  INFO(s);
  CHECK(s.find("train FAILED: 2 of 4 workers failed (attempt 3 of 3, run id job1)") != std::string::npos);
  CHECK(s.find("2 stopped by ctorchrun") != std::string::npos);
  CHECK(s.find("3*") != std::string::npos);
  CHECK(s.find("signal 11 (SIGSEGV)") != std::string::npos);
  CHECK(s.find("ValueError: bad shape") != std::string::npos);
  CHECK(s.find("exit 7") != std::string::npos);
  CHECK(s.find("root cause (first failure observed): rank 3") != std::string::npos);
  CHECK(s.find("      frame 2") != std::string::npos);
  CHECK(s.find("4321") < s.find("4319"));  // observed order
}

TEST_CASE("exit status: exit codes and descriptions") {
  CHECK(ExitStatus::exited(3).asExitCode() == 3);
  CHECK(ExitStatus::killed(SIGKILL).asExitCode() == 137);
  CHECK(ExitStatus::killed(SIGSEGV).describe() == "signal 11 (SIGSEGV)");
  CHECK((ExitStatus{0, 0, ENOENT}).asExitCode() == 127);
  CHECK((ExitStatus{0, 0, EACCES}).asExitCode() == 126);
  CHECK(parseSignal("term") == SIGTERM);
  CHECK(parseSignal("SIGUSR1") == SIGUSR1);
  CHECK(parseSignal("9") == 9);
  CHECK(parseSignal("SIGNOPE") == -1);
}
