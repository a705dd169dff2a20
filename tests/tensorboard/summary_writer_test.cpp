// ctorch::SummaryWriter and the pieces under it: CRC-32C against RFC 3720's vectors, the TFRecord
// framing and the protobuf bytes read back by the tests' own reader (event_file_reader.hpp), the
// file's name and opening events, the queue, bad log directories in one line, a full disk said once
// with training going on; and the writer's file read by read_events.py (protobuf's own parser on
// TensorBoard's messages).
#include "event_file_reader.hpp"

#include "ctorch_catch.hpp"
#include "multiproc.hpp"

#include <ctorch/errors.hpp>
#include <ctorch/tensorboard.hpp>

#include "tensorboard/event_encoding.hpp"
#include "tensorboard/tfrecord.hpp"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <system_error>
#include <thread>
#include <tuple>

using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace summary_writer_test {

std::string bytes(std::initializer_list<int> values) {
  std::string out;
  for (int v : values) out.push_back(static_cast<char>(v));
  return out;
}

// What a constructor or call throws, as the message of `Exception` ("<none>" when nothing is thrown).
template <typename Exception, typename F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  }
  return "<none>";
}

std::string hostName() {
  char buffer[256] = {};
  ::gethostname(buffer, sizeof buffer - 1);
  return buffer;
}

bool allDigits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The environment variable for the duration of a scope.
struct ScopedFault {
  explicit ScopedFault(const std::string& value) { ::setenv("CTORCH_TEST_IO_FAULT", value.c_str(), 1); }
  ~ScopedFault() { ::unsetenv("CTORCH_TEST_IO_FAULT"); }
};

}  // namespace summary_writer_test

namespace sw = summary_writer_test;

TEST_CASE("CRC-32C: RFC 3720's vectors, the check value of 123456789, continuation, and TFRecord's mask",
          "[tensorboard][crc]") {
  using ctorch::tensorboard::crc32c;
  using ctorch::tensorboard::maskCrc;
  CHECK(crc32c("123456789") == 0xE3069283u);
  CHECK(crc32c("") == 0u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  CHECK(crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  CHECK(crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  CHECK(crc32c(ascending) == 0x46DD794Eu);
  CHECK(crc32c(descending) == 0x113FDB5Cu);
  CHECK(crc32c("6789", crc32c("12345")) == 0xE3069283u);
  CHECK(tbtest::bitwiseCrc32c(ascending) == 0x46DD794Eu);  // the tests' own reader agrees
  CHECK(maskCrc(0) == 0xa282ead8u);
  CHECK(maskCrc(0xE3069283u) == (((0xE3069283u >> 15) | (0xE3069283u << 17)) + 0xa282ead8u));
}

TEST_CASE("TFRecord: records read back by an independent reader, and a flipped bit is caught",
          "[tensorboard][tfrecord]") {
  const std::vector<std::string> payloads = {"", "a", std::string(300, 'x'), std::string(70000, '\x7f'), "abc"};
  std::string file;
  for (const auto& p : payloads) ctorch::tensorboard::appendRecord(file, p);
  CHECK(tbtest::readRecords(file) == payloads);
  // The last record's layout byte for byte: length 3 (little endian), its masked CRC, the data, its masked CRC.
  const std::string last = file.substr(file.size() - 19);
  CHECK(last.substr(0, 8) == sw::bytes({3, 0, 0, 0, 0, 0, 0, 0}));
  CHECK(tbtest::littleEndian(last.substr(8, 4)) == tbtest::maskedCrc(last.substr(0, 8)));
  CHECK(last.substr(12, 3) == "abc");
  CHECK(tbtest::littleEndian(last.substr(15, 4)) == tbtest::maskedCrc("abc"));

  std::string flipped = file;
  flipped[flipped.size() - 5] ^= 0x01;  // in "abc"
  CHECK_THROWS_WITH(tbtest::readRecords(flipped), "the data's CRC does not hold");
  flipped = file;
  flipped[1] ^= 0x10;  // in the first length
  CHECK_THROWS_WITH(tbtest::readRecords(flipped), "the length's CRC does not hold");
  CHECK_THROWS_WITH(tbtest::readRecords(file.substr(0, file.size() - 1)), "a cut record");
}

TEST_CASE("event encoding: the bytes protobuf writes for Event, Summary and SessionLog", "[tensorboard][encoding]") {
  using namespace ctorch::tensorboard;
  // wall_time 1.5 (fixed64), step 3, summary { value { tag "a" simple_value 1.0 } }
  CHECK(scalarEvent(1.5, 3, "a", 1.0f) == sw::bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F, 0x10, 0x03, 0x2A, 0x0A, 0x0A,
                                                      0x08, 0x0A, 0x01, 'a', 0x15, 0, 0, 0x80, 0x3F}));
  // proto3 leaves wall_time 0, step 0 and an empty tag out; simple_value is a oneof member: always there.
  // A negative step is a 10-byte varint.
  CHECK(scalarEvent(0.0, -1, "", 0.0f) == sw::bytes({0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01,
                                                      0x2A, 0x07, 0x0A, 0x05, 0x15, 0, 0, 0, 0}));
  // session_log is Event's field 7 (6 is the deprecated log_message); status START = 1.
  CHECK(sessionStartEvent(0.0, 11) == sw::bytes({0x10, 0x0B, 0x3A, 0x02, 0x08, 0x01}));
  CHECK(fileVersionEvent(0.0, 0) == sw::bytes({0x1A, 0x0D}) + "brain.Event:2");

  const tbtest::Event e = tbtest::parseEvent(scalarEvent(1700000000.25, std::int64_t{1} << 40, "train/loss", 0.125f));
  CHECK(e.wallTime == 1700000000.25);
  CHECK(e.step == std::int64_t{1} << 40);
  REQUIRE(e.values.size() == 1);
  CHECK(e.values[0].first == "train/loss");
  CHECK(e.values[0].second == 0.125f);
}

TEST_CASE("SummaryWriter: the file TensorBoard and PyTorch name, opening with brain.Event:2, a purge step, scalars "
          "at their steps",
          "[tensorboard][writer]") {
  TempDir dir("tb-writer");
  const fs::path logDir = dir / "runs" / "exp1";  // made with its parents
  ctorch::SummaryWriterOptions options;
  options.purgeStep = 7;
  fs::path file;
  const auto wallClock = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  const double before = wallClock();  // events stamped by the writer fall between the two readings
  {
    ctorch::SummaryWriter w(logDir, options);
    file = w.file();
    CHECK(w.logDir() == logDir);
    w.addScalar("train/loss", 0.75, 7, 1700000001.0);
    w.addScalar("train/loss", 0.5, 8, 1700000002.0);
    w.addScalar("eval/accuracy", 0.25, 8);
  }  // the destructor closes: everything is written
  const double after = wallClock();
  REQUIRE(file.parent_path() == logDir);
  const std::string name = file.filename().string();
  REQUIRE(name.rfind("events.out.tfevents.", 0) == 0);
  const std::string rest = name.substr(20);
  CHECK(sw::allDigits(rest.substr(0, 10)));
  const std::string middle = "." + sw::hostName() + "." + std::to_string(::getpid()) + ".";
  CHECK(rest.substr(10, middle.size()) == middle);
  CHECK(sw::allDigits(rest.substr(10 + middle.size())));

  const auto events = tbtest::readEventFile(file);
  REQUIRE(events.size() == 6);
  CHECK(events[0].fileVersion == std::optional<std::string>("brain.Event:2"));
  CHECK(events[0].step == 0);
  CHECK(events[0].wallTime >= before);
  CHECK(events[0].wallTime <= after);
  // As Python's SummaryWriter(purge_step=7): file_version and SessionLog START at step 7.
  CHECK(events[1].fileVersion == std::optional<std::string>("brain.Event:2"));
  CHECK(events[1].step == 7);
  CHECK(events[2].sessionStatus == std::optional<std::uint64_t>(1));
  CHECK(events[2].step == 7);
  CHECK(events[3].step == 7);
  CHECK(events[3].wallTime == 1700000001.0);
  CHECK(events[3].values == std::vector<std::pair<std::string, float>>{{"train/loss", 0.75f}});
  CHECK(events[4].values == std::vector<std::pair<std::string, float>>{{"train/loss", 0.5f}});
  CHECK(events[5].step == 8);
  CHECK(events[5].values == std::vector<std::pair<std::string, float>>{{"eval/accuracy", 0.25f}});
  CHECK(events[5].wallTime >= before);
  CHECK(events[5].wallTime <= after);

  // Without a purge step the file opens with the version alone; filenameSuffix ends the name.
  options = {};
  options.filenameSuffix = ".rank0";
  ctorch::SummaryWriter plain(logDir, options);
  CHECK(plain.file().string().size() > 6);
  CHECK(plain.file().string().substr(plain.file().string().size() - 6) == ".rank0");
  plain.close();
  CHECK(tbtest::readEventFile(plain.file()).size() == 1);
}

TEST_CASE("SummaryWriter: events wait for maxQueue, flush() or close(), flushInterval 0 writes each, nothing "
          "after close",
          "[tensorboard][writer]") {
  TempDir dir("tb-queue");
  ctorch::SummaryWriterOptions options;
  options.maxQueue = 3;
  options.flushInterval = std::chrono::hours(1);
  ctorch::SummaryWriter w(dir.path(), options);
  const auto count = [&] { return tbtest::readEventFile(w.file()).size(); };
  CHECK(count() == 1);  // the version goes at once
  w.addScalar("x", 1, 1);
  w.addScalar("x", 2, 2);
  CHECK(count() == 1);
  w.addScalar("x", 3, 3);  // the third: the queue is full
  CHECK(count() == 4);
  w.addScalar("x", 4, 4);
  CHECK(count() == 4);
  w.flush();
  CHECK(count() == 5);
  w.flush();  // nothing held: nothing written
  CHECK(count() == 5);
  w.addScalar("x", 5, 5);
  w.close();
  CHECK(count() == 6);
  w.addScalar("x", 6, 6);  // dropped, as Python's writer after close()
  w.flush();
  w.close();
  CHECK(count() == 6);

  options.flushInterval = std::chrono::milliseconds(0);
  ctorch::SummaryWriter each(dir.path(), options);
  each.addScalar("y", 1, 1);
  CHECK(tbtest::readEventFile(each.file()).size() == 2);
}

TEST_CASE("SummaryWriter: a later writer's file sorts after every earlier one, within one second too",
          "[tensorboard][writer]") {
  TempDir dir("tb-order");
  std::vector<fs::path> made;
  for (int i = 0; i < 3; ++i) made.push_back(ctorch::SummaryWriter(dir.path()).file());
  CHECK(tbtest::eventFiles(dir.path()) == made);  // name order is creation order
  // A file stamped ahead of the clock (another host's): the next name still sorts after it. Far
  // ahead (11 days), so that the clock cannot pass it during the test.
  const long long ahead =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count() +
      1'000'000;
  const fs::path future = dir / ("events.out.tfevents." + std::to_string(ahead) + ".other.1.0");
  ctorch::test::writeFile(future, "");
  const fs::path next = ctorch::SummaryWriter(dir.path()).file();
  CHECK(next.filename().string().substr(20, 10) == std::to_string(ahead + 1));
  CHECK(tbtest::eventFiles(dir.path()).back() == next);
}

TEST_CASE("SummaryWriter: a log directory that cannot be made, a bad option or an empty tag is one line",
          "[tensorboard][writer][errors]") {
  TempDir dir("tb-bad");
  ctorch::test::writeFile(dir / "taken", "a file");
  std::string m = sw::thrown<ctorch::ConfigError>([&] { ctorch::SummaryWriter w(dir / "taken"); });
  CHECK(m == "the TensorBoard log directory '" + (dir / "taken").string() + "' cannot be made: '" +
                 (dir / "taken").string() + "' is a file, not a directory (name another directory)");
  m = sw::thrown<ctorch::ConfigError>([&] { ctorch::SummaryWriter w(dir / "taken" / "sub" / "dir"); });
  CHECK_THAT(m, Catch::Contains("'" + (dir / "taken").string() + "' is a file, not a directory"));
  CHECK(m.find('\n') == std::string::npos);
  CHECK(fs::is_regular_file(dir / "taken"));

  // A place no directory can be made (as root, a permission bit would not stop it).
  m = sw::thrown<std::system_error>([] { ctorch::SummaryWriter w("/proc/self/ctorch-tensorboard"); });
  CHECK_THAT(m, Catch::StartsWith("cannot create the TensorBoard log directory '/proc/self/ctorch-tensorboard': "));
  CHECK(m.find('\n') == std::string::npos);

  CHECK_THAT(sw::thrown<ctorch::ConfigError>([] { ctorch::SummaryWriter w(""); }),
             Catch::Contains("the log directory is empty"));
  ctorch::SummaryWriterOptions zero;
  zero.maxQueue = 0;
  CHECK(sw::thrown<ctorch::ConfigError>([&] { ctorch::SummaryWriter w(dir / "q", zero); }) ==
        "SummaryWriterOptions::maxQueue must be at least 1 (got 0)");
  ctorch::SummaryWriter w(dir / "ok");
  CHECK_THAT(sw::thrown<ctorch::ConfigError>([&] { w.addScalar("", 1, 1); }), Catch::Contains("the tag is empty"));
}

TEST_CASE("SummaryWriter: a full disk is said once, the loop goes on, the file keeps whole events",
          "[tensorboard][writer][diskfull]") {
  TempDir dir("tb-diskfull");
  std::vector<std::string> warnings;
  ctorch::SummaryWriterOptions options;
  options.maxQueue = 2;
  options.warn = [&](const std::string& m) { warnings.push_back(m); };
  ctorch::SummaryWriter w(dir.path(), options);
  w.addScalar("loss", 1, 1);
  w.addScalar("loss", 2, 2);  // written: 3 events in the file
  const std::string before = ctorch::test::readFile(w.file());
  {
    sw::ScopedFault fault("write:1:ENOSPC:tb-diskfull");
    w.addScalar("loss", 3, 3);
    CHECK_NOTHROW(w.addScalar("loss", 4, 4));  // the write fails: said, not thrown
    CHECK(w.failed());
  }
  w.addScalar("loss", 5, 5);  // the disk has room again: the writer stays off, no gap filled later
  w.addScalar("loss", 6, 6);
  w.close();
  CHECK(ctorch::test::readFile(w.file()) == before);
  CHECK(tbtest::readEventFile(w.file()).size() == 3);
  REQUIRE(warnings.size() == 1);
  CHECK_THAT(warnings[0], Catch::Contains("cannot write the TensorBoard event file " + w.file().string()));
  CHECK_THAT(warnings[0], Catch::Contains("No space left on device"));
  CHECK_THAT(warnings[0], Catch::Contains("training goes on"));

  // A disk full before the first event: the constructor says so and leaves no file.
  TempDir full("tb-fullfirst");
  {
    sw::ScopedFault fault("write:1:ENOSPC:tb-fullfirst");
    const std::string m = sw::thrown<std::system_error>([&] { ctorch::SummaryWriter x(full.path()); });
    CHECK_THAT(m, Catch::StartsWith("cannot write the TensorBoard event file " + full.path().string() + "/events.out.tfevents."));
    CHECK_THAT(m, Catch::Contains("No space left on device"));
  }
  CHECK(tbtest::eventFiles(full.path()).empty());
}

TEST_CASE("SummaryWriter: threads adding at once leave whole events, none lost", "[tensorboard][writer]") {
  TempDir dir("tb-threads");
  ctorch::SummaryWriterOptions options;
  options.maxQueue = 7;
  ctorch::SummaryWriter w(dir.path(), options);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&w, t] {
      for (int i = 0; i < 250; ++i) w.addScalar("thread" + std::to_string(t), i, i);
    });
  for (auto& t : threads) t.join();
  w.close();
  const auto events = tbtest::readEventFile(w.file());
  REQUIRE(events.size() == 1001);
  std::map<std::string, int> perTag;
  for (std::size_t i = 1; i < events.size(); ++i) ++perTag[events[i].values.at(0).first];
  CHECK(perTag == std::map<std::string, int>{{"thread0", 250}, {"thread1", 250}, {"thread2", 250}, {"thread3", 250}});
}

TEST_CASE("SummaryWriter: protobuf's own parser on TensorBoard's messages reads the writer's file (read_events.py), "
          "and a flipped bit fails it",
          "[tensorboard][writer][python]") {
  TempDir dir("tb-python");
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<std::tuple<std::string, double, std::int64_t>> points = {
      {"a/x", 0.5, 1}, {"a/x", -2.25, 2}, {"b", 0.0, 3}, {"b", 3.0e38, std::int64_t{1} << 40}, {"c", inf, 4},
      {"c", 0.1, 5}};
  ctorch::SummaryWriterOptions options;
  options.purgeStep = 1;
  fs::path file;
  {
    ctorch::SummaryWriter w(dir / "run", options);
    for (const auto& [tag, value, step] : points) w.addScalar(tag, value, step, 1700000000.5);
    file = w.file();
  }
  std::string skip;
  const auto r = tbtest::readEventsPy(dir / "run", {"--json", (dir / "events.json").string()}, skip);
  if (!r) CTORCH_SKIP(skip);
  INFO(r->describe() << "\n" << r->output);
  REQUIRE(r->ok());
  CHECK_THAT(r->output, Catch::Contains("read 9 events in 1 file(s): every CRC holds, every record is an Event"));
  const auto j = nlohmann::json::parse(ctorch::test::readFile(dir / "events.json"));
  REQUIRE(j["files"].size() == 1);
  CHECK(j["files"][0]["name"] == file.filename().string());
  const auto& events = j["files"][0]["events"];
  CHECK(events[0]["file_version"] == "brain.Event:2");
  CHECK(events[2]["what"] == "session_log");
  CHECK(events[2]["status"] == "START");
  CHECK(events[2]["step"] == 1);
  for (std::size_t i = 0; i < points.size(); ++i) {
    const auto& [tag, value, step] = points[i];
    const auto& e = events[3 + i];
    INFO("point " << i << ": " << e.dump());
    CHECK(e["step"] == step);
    CHECK(e["wall_time"] == 1700000000.5);
    REQUIRE(e["values"].size() == 1);
    CHECK(e["values"][0]["tag"] == tag);
    char expected[16];
    std::snprintf(expected, sizeof expected, "0x%08x", tbtest::floatBits(static_cast<float>(value)));
    CHECK(e["values"][0]["bits"] == expected);
  }
  CHECK(j["scalars"]["a/x"].size() == 2);  // the run's first START purges nothing

  // The control: a bit flipped in the last event's data fails the reader, naming the record.
  std::string bytes = ctorch::test::readFile(file);
  bytes[bytes.size() - 6] ^= 0x04;
  fs::create_directories(dir / "damaged");
  ctorch::test::writeFile(dir / "damaged" / file.filename(), bytes);
  const auto bad = tbtest::readEventsPy(dir / "damaged", {}, skip);
  REQUIRE(bad);
  CHECK(bad->exitCode == 1);
  CHECK_THAT(bad->output, Catch::Contains("record 8"));
  CHECK_THAT(bad->output, Catch::Contains("the data's CRC"));
}
