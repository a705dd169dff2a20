// Worker output routing without processes: line splitting, prefixes, --redirects/--tee/
// --local-ranks-filter decisions, and the log directory layout.
#include "ctorch_catch.hpp"

#include "ctorch/launcher/cli.hpp"
#include "ctorch/launcher/console_writer.hpp"
#include "ctorch/launcher/worker_logs.hpp"
#include "multiproc.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <sstream>

using namespace ctorch::launcher;
namespace fs = std::filesystem;

namespace {

LaunchConfig logsConfigFor(const std::vector<std::string>& args) {
  auto cl = parseCommandLine(args);
  REQUIRE_FALSE(cl.exitNow);
  MachineProbe p;
  p.hostname = [] { return std::string("host1"); };
  return makeLaunchConfig(cl.options, processEnvironment(), p);
}

RendezvousInfo oneNode(int nproc, const std::string& runId = "job") {
  RendezvousInfo i;
  i.runId = runId;
  i.numNodes = 1;
  i.nprocPerNode = {nproc};
  i.computeRanks();
  i.nodeHosts = {"host1"};
  return i;
}

std::string drain(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

struct Console {
  int out[2];
  int err[2];
  Console() {
    REQUIRE(::pipe2(out, O_NONBLOCK | O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err, O_NONBLOCK | O_CLOEXEC) == 0);
  }
  ~Console() {
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
  }
};

} // namespace

TEST_CASE("worker logs: the line splitter emits whole lines only") {
  LineSplitter s;
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  s.feed("hel", emit);
  CHECK(lines.empty());
  s.feed("lo\nwor", emit);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0] == "hello");
  s.feed("ld\n\nx", emit);
  CHECK(lines == std::vector<std::string>{"hello", "world", ""});
  s.finish(emit);
  CHECK(lines.back() == "x");
}

TEST_CASE("worker logs: a line that never ends is emitted in bounded pieces") {
  LineSplitter s(10);
  std::vector<std::string> lines;
  auto emit = [&](std::string_view l) { lines.emplace_back(l); };
  s.feed(std::string(25, 'a'), emit);  // no newline: memory stays bounded
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].size() == 10);
  s.feed("\n", emit);
  REQUIRE(lines.size() == 3);
  CHECK(lines[2] == "aaaaa");
}

TEST_CASE("worker logs: torchrun's prefix / with the host when there are several nodes") {
  CHECK(consolePrefix("default", 3, "h", false) == "[default3]:");
  CHECK(consolePrefix("trainer", 12, "node7", true) == "[node7:trainer12]:");
}

TEST_CASE("worker logs: routes for --redirects / --tee and --local-ranks-filter") {
  auto c = logsConfigFor({"--nproc-per-node", "3", "-r", "0:1,1:3", "-t", "2:2", "--local-ranks-filter", "1,2", "/bin/true"});
  auto out0 = routeFor(c, 0, Stream::Stdout);
  CHECK((out0.file && !out0.console));  // redirected: file only
  auto err0 = routeFor(c, 0, Stream::Stderr);
  CHECK((!err0.file && !err0.console));  // rank 0 is filtered out and not redirected: nowhere
  auto err2 = routeFor(c, 2, Stream::Stderr);
  CHECK((err2.file && err2.console));  // tee: both
  auto out2 = routeFor(c, 2, Stream::Stdout);
  CHECK((!out2.file && out2.console));
  auto d = logsConfigFor({"/bin/true"});
  CHECK(routeFor(d, 0, Stream::Stdout).console);
  CHECK_FALSE(routeFor(d, 0, Stream::Stdout).file);
}

TEST_CASE("worker logs: layout <log-dir>/<run_id>_<random>/attempt_<k>/<local_rank>/ and tee copies") {
  ctorch::test::TempDir dir;
  auto c = logsConfigFor({"--log-dir", dir.path().string(), "-t", "3", "/bin/true"});
  Console con;
  WorkerLogs logs(c, con.out[1], con.err[1]);
  CHECK_FALSE(logs.temporary());
  auto files = logs.beginAttempt(oneNode(2, "run42"), 1);
  REQUIRE(files.size() == 2);
  const fs::path run = logs.runDir();
  CHECK(run.parent_path() == dir.path());
  CHECK(run.filename().string().rfind("run42_", 0) == 0);
  CHECK(run.filename().string().size() == std::string("run42_").size() + 6);
  CHECK(files[1].rankDir == run / "attempt_1" / "1");
  CHECK(files[1].errorFile == run / "attempt_1" / "1" / "error.json");
  CHECK(files[0].out.toAgent);
  REQUIRE(files[0].out.file);
  logs.onOutput(0, Stream::Stdout, "first li");
  logs.onOutput(1, Stream::Stdout, "other\n");
  logs.onOutput(0, Stream::Stdout, "ne\nsecond");
  logs.onOutput(1, Stream::Stderr, "oops\n");
  logs.onClosed(0, Stream::Stdout);
  logs.endAttempt();
  CHECK(drain(con.out[0]) == "[default1]:other\n[default0]:first line\n[default0]:second\n");
  CHECK(drain(con.err[0]) == "[default1]:oops\n");
  // Files get the raw stream, without prefixes.
  CHECK(ctorch::test::readFile(*files[0].out.file) == "first line\nsecond");
  CHECK(ctorch::test::readFile(files[1].rankDir / "stderr.log") == "oops\n");
}

TEST_CASE("worker logs: a new attempt starts with a clean directory") {
  ctorch::test::TempDir dir;
  auto c = logsConfigFor({"--log-dir", dir.path().string(), "/bin/true"});
  Console con;
  WorkerLogs logs(c, con.out[1], con.err[1]);
  auto f = logs.beginAttempt(oneNode(1), 0);
  ctorch::test::writeFile(f[0].errorFile, "{}");
  auto g = logs.beginAttempt(oneNode(1), 0);  // same attempt number (re-rendezvous)
  CHECK_FALSE(fs::exists(g[0].errorFile));
}

TEST_CASE("worker logs: a reused --log-dir and run id (a requeued job) never overwrite an earlier run") {
  ctorch::test::TempDir dir;
  auto c = logsConfigFor({"--log-dir", dir.path().string(), "-r", "3", "/bin/true"});
  fs::path first, second;
  for (fs::path* run : {&first, &second}) {
    WorkerLogs logs(c, -1, -1);
    auto f = logs.beginAttempt(oneNode(1, "job7"), 0);
    ctorch::test::writeFile(f[0].errorFile, "{}");
    *run = logs.runDir();
  }
  CHECK(first != second);
  CHECK(fs::exists(first / "attempt_0" / "0" / "error.json"));  // still there
  // Within one run, attempts share the run directory.
  WorkerLogs logs(c, -1, -1);
  auto a0 = logs.beginAttempt(oneNode(1, "job7"), 0);
  auto a1 = logs.beginAttempt(oneNode(1, "job7"), 1);
  CHECK(a0[0].rankDir.parent_path().parent_path() == a1[0].rankDir.parent_path().parent_path());
}

TEST_CASE("worker logs: -r/--tee without --log-dir keep the temporary directory (the output is there)") {
  auto c = logsConfigFor({"-r", "3", "/bin/true"});
  fs::path base;
  {
    WorkerLogs logs(c, -1, -1);
    CHECK(logs.temporary());
    CHECK(logs.kept());
    base = logs.baseDir();
    logs.beginAttempt(oneNode(1), 0);
  }
  CHECK(fs::exists(base));
  fs::remove_all(base);
  CHECK_FALSE(WorkerLogs(logsConfigFor({"/bin/true"}), -1, -1).kept());
}

TEST_CASE("worker logs: a temporary log directory is removed unless kept") {
  auto c = logsConfigFor({"/bin/true"});
  fs::path kept, removed;
  {
    WorkerLogs logs(c, -1, -1);
    CHECK(logs.temporary());
    removed = logs.baseDir();
    logs.beginAttempt(oneNode(1), 0);
  }
  CHECK_FALSE(fs::exists(removed));
  {
    WorkerLogs logs(c, -1, -1);
    kept = logs.baseDir();
    logs.keep();
  }
  CHECK(fs::exists(kept));
  fs::remove_all(kept);
}

// Issue 12.5: a console nobody reads. The writer never blocks (the pipe here is a blocking one, as
// a shell's is), keeps a bounded backlog, drops beyond it and says so once the console moves again.
TEST_CASE("console writer: never blocks on a full pipe - bounded backlog, counted drop, marker, order kept") {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);  // blocking, like ctorchrun's inherited stdout
  ::fcntl(p[1], F_SETPIPE_SZ, 4096);
  std::size_t written = 0;
  std::uint64_t dropped = 0;
  {
    ConsoleWriter w(p[1], 16 * 1024);
    CHECK_FALSE(w.isTerminal());
    const std::string line(99, 'x');
    // 200 KB into a 4 KiB pipe nobody reads: finishing at all is the proof. The bound only turns
    // a blocked write into a failure (the pipe is then read, so that the writer returns).
    auto writing = std::async(std::launch::async, [&] {
      for (int i = 0; i < 2000; ++i) {
        w.write(line + "\n");
        written += line.size() + 1;
      }
    });
    const bool finished = writing.wait_for(std::chrono::seconds(45)) == std::future_status::ready;
    if (!finished) {
      ::fcntl(p[0], F_SETFL, O_NONBLOCK);
      while (writing.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready) drain(p[0]);
    }
    REQUIRE(finished);
    CHECK(w.pending());
    CHECK(w.droppedBytes() > 0);
    CHECK(w.droppedBytes() < written);
    dropped = w.droppedBytes();
    // The reader comes back: the backlog flows, then the marker, then new output.
    std::string got;
    for (int round = 0; round < 100 && (w.pending() || got.find("dropped") == std::string::npos); ++round) {
      ::fcntl(p[0], F_SETFL, O_NONBLOCK);
      got += drain(p[0]);
      w.flush();
    }
    w.write("after\n");
    got += drain(p[0]);
    INFO(got.size());
    CHECK(got.find("[... " + std::to_string(dropped) + " bytes dropped: console not read]\n") != std::string::npos);
    CHECK(got.size() >= 16 * 1024);  // the backlog was kept
    CHECK(got.substr(got.size() - 6) == "after\n");
    // Whole lines only: every line is the 99 x's, the marker or "after".
    std::istringstream in(got);
    std::string l;
    while (std::getline(in, l)) CHECK((l == line || l == "after" || l.rfind("[... ", 0) == 0));
  }
  ::close(p[0]);
  ::close(p[1]);
}
