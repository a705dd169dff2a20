// The error-file helper: torchrun's JSON schema, written atomically, read back by nlohmann and by
// Python's own torch.distributed.elastic reader; runRecorded as a main() wrapper.
#include "ctorch/error_file.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/snapshot.hpp"
#include "multiproc.hpp"

#include "ctorch_catch.hpp"
#include <nlohmann/json.hpp>

#include <c10/util/Exception.h>

#include <cstdlib>

using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace {

struct ScopedEnv {
  explicit ScopedEnv(const fs::path& value) { ::setenv(ctorch::contract::env::kErrorFile, value.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(ctorch::contract::env::kErrorFile); }
};

nlohmann::json readJson(const fs::path& p) { return nlohmann::json::parse(ctorch::test::readFile(p)); }

} // namespace

TEST_CASE("without TORCHELASTIC_ERROR_FILE recording does nothing", "[errorfile]") {
  ::unsetenv(ctorch::contract::env::kErrorFile);
  CHECK_FALSE(ctorch::recordError(std::runtime_error("x")));
  CHECK_FALSE(ctorch::recordErrorMessage("x"));
}

TEST_CASE("recordError writes torchrun's error-file schema", "[errorfile]") {
  TempDir dir("errfile");
  const auto file = dir / "error.json";
  ScopedEnv env(file);
  const auto before = std::chrono::duration_cast<std::chrono::seconds>(
                          std::chrono::system_clock::now().time_since_epoch()).count();
  REQUIRE(ctorch::recordError(ctorch::SnapshotNotFound("run/snapshot.pt")));
  const auto after = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
  const auto j = readJson(file);
  REQUIRE(j.is_object());
  REQUIRE(j.size() == 1);
  const auto& m = j.at("message");
  CHECK(m.at("message") == "ctorch::SnapshotNotFound: snapshot run/snapshot.pt does not exist");
  const auto& extra = m.at("extraInfo");
  CHECK_THAT(extra.at("py_callstack").get<std::string>(), Catch::Contains("SnapshotNotFound"));
  const auto ts = extra.at("timestamp").get<std::string>();  // a string, as Python writes it
  CHECK(std::stoll(ts) >= before);
  CHECK(std::stoll(ts) <= after);
  // Atomic replacement leaves no temporary behind; a second record replaces the first.
  REQUIRE(ctorch::recordErrorMessage("second"));
  CHECK(readJson(file).at("message").at("message") == "second");
  std::size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  CHECK(entries == 1);
}

TEST_CASE("awkward text stays valid ASCII JSON", "[errorfile]") {
  const std::string nasty = "quote \" backslash \\ newline \n tab \t bell \x07 e-acute \xc3\xa9 "
                            "emoji \xf0\x9f\x98\x80 bad \xff end";
  const auto text = ctorch::errorFileJson(nasty, "details", std::chrono::system_clock::time_point{});
  for (unsigned char c : text) CHECK(c < 0x80);
  const auto j = nlohmann::json::parse(text);
  CHECK(j["message"]["message"] ==
        "quote \" backslash \\ newline \n tab \t bell \x07 e-acute \xc3\xa9 emoji \xf0\x9f\x98\x80 "
        "bad \xef\xbf\xbd end");
  CHECK(j["message"]["extraInfo"]["timestamp"] == "0");
}

TEST_CASE("nested causes and LibTorch errors are described", "[errorfile]") {
  TempDir dir("errfile-nested");
  ScopedEnv env(dir / "error.json");
  try {
    try {
      throw std::invalid_argument("inner cause");
    } catch (...) {
      std::throw_with_nested(std::runtime_error("outer failure"));
    }
  } catch (const std::exception& e) {
    REQUIRE(ctorch::recordError(e));
  }
  auto j = readJson(dir / "error.json");
  CHECK_THAT(j["message"]["message"].get<std::string>(), Catch::Contains("outer failure"));
  CHECK_THAT(j["message"]["extraInfo"]["py_callstack"].get<std::string>(),
             Catch::Contains("caused by: std::invalid_argument: inner cause"));

  try {
    TORCH_CHECK(false, "shapes do not match");
  } catch (const c10::Error& e) {
    REQUIRE(ctorch::recordError(e));
    CHECK_THAT(ctorch::describeException(e), Catch::StartsWith("c10::Error: shapes do not match"));
  }
  j = readJson(dir / "error.json");
  const auto message = j["message"]["message"].get<std::string>();
  CHECK_THAT(message, Catch::Contains("shapes do not match"));
  CHECK_THAT(message, !Catch::Contains("Exception raised from"));  // backtrace only in the details
  CHECK_THAT(j["message"]["extraInfo"]["py_callstack"].get<std::string>(),
             Catch::Contains("Exception raised from"));
  // LibTorch's backtraces are mostly frames without symbols: none of them reaches the file.
  CHECK_THAT(j["message"]["extraInfo"]["py_callstack"].get<std::string>(), !Catch::Contains("<unknown function>"));
}

TEST_CASE("backtrace frames without symbols are left out, one line per run", "[errorfile]") {
  const std::string trace =
      "shapes do not match\n"
      "Exception raised from f at x.cpp:1 (most recent call first):\n"
      "frame #0: c10::Error::Error(c10::SourceLocation) + 0x96 (0x7f in libc10.so)\n"
      "frame #1: <unknown function> + 0x1 (0x7f in libtorch_cpu.so)\n"
      "frame #2: <unknown function> + 0x2 (0x7f in libtorch_cpu.so)\n"
      "frame #3: main + 0x10 (0x55 in app)\n"
      "frame #4: <unknown function> + 0x3 (0x7f in libc.so.6)\n";
  CHECK(ctorch::trimBacktrace(trace) ==
        "shapes do not match\n"
        "Exception raised from f at x.cpp:1 (most recent call first):\n"
        "frame #0: c10::Error::Error(c10::SourceLocation) + 0x96 (0x7f in libc10.so)\n"
        "(2 frames without symbols left out)\n"
        "frame #3: main + 0x10 (0x55 in app)\n"
        "(1 frame without symbols left out)\n");
  CHECK(ctorch::trimBacktrace("no frames here") == "no frames here");
}

TEST_CASE("an unwritable error file warns and returns false", "[errorfile]") {
  TempDir dir("errfile-bad");
  ScopedEnv env(dir / "no" / "such" / "dir" / "error.json");
  CHECK_FALSE(ctorch::recordError(std::runtime_error("x")));
}

CTORCH_TEST_WORKER(recorded_main) {
  return ctorch::runRecorded([&]() -> int {
    if (args.at(0) == "throw") throw std::runtime_error("bad value 'x' for --lr");
    if (args.at(0) == "unknown") throw 42;
    return std::stoi(args.at(0));
  });
}

TEST_CASE("runRecorded records and prints one line and exits 1 and normal exits pass through",
          "[errorfile]") {
  TempDir dir("errfile-run");
  auto runWith = [&](const std::string& arg) {
    ctorch::test::SpawnOptions so;
    so.argv = {ctorch::test::selfExe().string(), "--ctorch-worker", "recorded_main", arg};
    so.setEnv[ctorch::contract::env::kErrorFile] = (dir / ("error-" + arg + ".json")).string();
    return ctorch::test::run(so);
  };
  auto r = runWith("throw");
  CHECK(r.exitCode == 1);
  CHECK(r.output == "error: std::runtime_error: bad value 'x' for --lr\n");
  CHECK(readJson(dir / "error-throw.json")["message"]["message"] ==
        "std::runtime_error: bad value 'x' for --lr");

  r = runWith("unknown");
  CHECK(r.exitCode == 1);
  CHECK_THAT(readJson(dir / "error-unknown.json")["message"]["message"].get<std::string>(),
             Catch::Contains("unknown exception"));

  r = runWith("7");
  CHECK(r.exitCode == 7);
  CHECK_FALSE(fs::exists(dir / "error-7.json"));
}

TEST_CASE("Python's torchrun reads the error file", "[errorfile][python]") {
  if (!fs::exists("/usr/bin/python3")) CTORCH_SKIP("/usr/bin/python3 is not installed");
  TempDir dir("errfile-py");
  const auto file = dir / "error.json";
  {
    ScopedEnv env(file);
    REQUIRE(ctorch::recordError(std::runtime_error("disk full while writing snapshot.pt")));
  }
  // torchrun's agent builds a ProcessFailure from the worker's error file and prints the summary.
  const std::string script =
      "import sys\n"
      "try:\n"
      "    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure, ChildFailedError\n"
      "except ImportError:\n"
      "    print('NO_TORCH'); sys.exit(0)\n"
      "f = ProcessFailure(local_rank=0, pid=123, exitcode=1, error_file=sys.argv[1])\n"
      "assert f.message['message'] == 'std::runtime_error: disk full while writing snapshot.pt', f.message\n"
      "assert f.timestamp > 1600000000, f.timestamp\n"
      "print(ChildFailedError('trainer', {0: f}).format_msg())\n";
  ctorch::test::SpawnOptions so;
  so.argv = {"/usr/bin/python3", "-c", script, file.string()};
  so.timeout = std::chrono::seconds(60);
  const auto r = ctorch::test::run(so);
  INFO(r.output);
  if (r.output.find("NO_TORCH") != std::string::npos) CTORCH_SKIP("python3-torch is not installed");
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("disk full while writing snapshot.pt"));
  CHECK_THAT(r.output, Catch::Contains("exitcode  : 1"));
}

TEST_CASE("configuration errors and incompatible snapshots are recorded as not worth retrying, others as usual",
          "[errorfile]") {
  TempDir dir("errfile-retry");
  const auto file = dir / "error.json";
  ScopedEnv env(file);
  auto retry = [&] {
    const auto extra = readJson(file).at("message").at("extraInfo");
    return extra.contains("ctorch_retry") ? extra.at("ctorch_retry").get<std::string>() : std::string("(absent)");
  };
  REQUIRE(ctorch::recordError(ctorch::ConfigError("bad --lr")));
  CHECK(retry() == "never");
  REQUIRE(ctorch::recordError(ctorch::ResumeRefused("no usable snapshot")));
  CHECK(retry() == "never");
  REQUIRE(ctorch::recordError(ctorch::SnapshotIncompatible("snapshot.pt", {"config 'lr' differs"})));
  CHECK(retry() == "never");
  REQUIRE(ctorch::recordError(ctorch::DistributedError("peer lost")));
  CHECK(retry() == "(absent)");  // torchrun's schema: retried
  REQUIRE(ctorch::recordError(std::runtime_error("x"), /*retryable=*/false));
  CHECK(retry() == "never");
  REQUIRE(ctorch::recordErrorMessage("usage", "", /*retryable=*/false));
  CHECK(retry() == "never");
}
