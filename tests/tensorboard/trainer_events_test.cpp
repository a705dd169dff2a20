// ctorch-train --tensorboard-dir: the events of a real run, stopped at --max-steps and resumed from an
// older snapshot, read by read_events.py (protobuf's own parser, TensorBoard's loading rules) and
// compared with the run's metrics.jsonl; a bad directory refused in one line before anything loads;
// a full disk said once while the run finishes.
#ifdef CTORCH_TRAIN_EXE
#include "event_file_reader.hpp"

#include "ctorch_catch.hpp"
#include "multiproc.hpp"

#include <nlohmann/json.hpp>

#include <regex>
#include <set>

using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace trainer_events_test {

// Synthetic 8x8 images through the MNIST CNN (classification: eval/accuracy too), 16 steps an
// epoch, a train record every 3 steps and a snapshot every 5.
const std::vector<std::string> kRun = {
    "--model", "mnist-cnn", "--dataset", "synthetic-images", "--synthetic-size", "256", "--synthetic-shape", "1,8,8",
    "--batch-size", "16", "--test-limit", "32", "--epochs", "2", "--log-interval", "3", "--save-every-steps", "5",
    "--keep-snapshots", "3", "--progress", "lines", "--tensorboard-dir", "tb"};

ctorch::test::SpawnOptions train(const fs::path& dir, std::vector<std::string> more,
                                 std::map<std::string, std::string> env = {}) {
  ctorch::test::SpawnOptions o;
  o.argv = {CTORCH_TRAIN_EXE};
  o.argv.insert(o.argv.end(), kRun.begin(), kRun.end());
  o.argv.insert(o.argv.end(), more.begin(), more.end());
  // A world of 1 whatever launched the tests (CTest under Slurm or torchrun).
  o.unsetEnv = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
                "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID"};
  o.setEnv = std::move(env);
  o.setEnv["OMP_NUM_THREADS"] = "1";
  o.cwd = dir;
  o.timeout = std::chrono::seconds(120);
  return o;
}

std::string show(const ctorch::test::ProcessResult& r) { return r.describe() + "\n--- output ---\n" + r.output; }

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The steps of `tag`'s points in one file's events (read_events.py's JSON).
std::vector<std::int64_t> stepsOf(const nlohmann::json& file, const std::string& tag) {
  std::vector<std::int64_t> steps;
  for (const auto& e : file["events"])
    if (e.contains("values"))
      for (const auto& v : e["values"])
        if (v["tag"] == tag) steps.push_back(e["step"].get<std::int64_t>());
  return steps;
}

}  // namespace trainer_events_test

namespace te = trainer_events_test;

TEST_CASE("ctorch-train --tensorboard-dir: stopped at --max-steps and resumed from an older snapshot, TensorBoard "
          "shows exactly metrics.jsonl, the steps after the snapshot once",
          "[tensorboard][trainer][python]") {
  TempDir dir("tb-train-resume");
  const auto first = ctorch::test::run(te::train(dir.path(), {"--max-steps", "22"}));
  INFO(te::show(first));
  REQUIRE(first.ok());
  fs::copy_file(dir / "metrics.jsonl", dir / "metrics-first.jsonl");
  REQUIRE(tbtest::eventFiles(dir / "tb").size() == 1);

  std::string skip;
  const auto fresh = tbtest::readEventsPy(dir / "tb", {"--metrics", (dir / "metrics-first.jsonl").string()}, skip);
  if (!fresh) CTORCH_SKIP(skip);
  INFO(te::show(*fresh));
  REQUIRE(fresh->ok());
  CHECK_THAT(fresh->output, Catch::Contains("metrics match: "));
  CHECK_THAT(fresh->output, Catch::Contains("eval/accuracy"));

  // snapshot.pt.3 holds global step 15 (the slot after step 22: 22, 20, 16, 15): the stopped
  // process logged steps 16 to 21 and the epoch's end after it.
  const auto resumed = ctorch::test::run(te::train(dir.path(), {"--resume", "snapshot.pt.3"}));
  INFO(te::show(resumed));
  REQUIRE(resumed.ok());
  REQUIRE_THAT(resumed.output, Catch::Contains("resuming from snapshot.pt.3 after 15 steps (global step 15)"));
  const auto files = tbtest::eventFiles(dir / "tb");
  REQUIRE(files.size() == 2);
  for (const auto& f : files) CHECK_NOTHROW(tbtest::readEventFile(f));  // the tests' own reader too

  const auto r = tbtest::readEventsPy(dir / "tb",
                                      {"--metrics", (dir / "metrics.jsonl").string(), "--json", (dir / "tb.json").string()},
                                      skip);
  REQUIRE(r);
  INFO(te::show(*r));
  REQUIRE(r->ok());
  CHECK_THAT(r->output, Catch::Contains("metrics match: "));
  const auto j = nlohmann::json::parse(ctorch::test::readFile(dir / "tb.json"));
  // Each process's file opens with START at its first step: 1, then 16 (the resumed snapshot's 15 + 1).
  CHECK(j["starts"] == nlohmann::json::parse(R"([{"file": 0, "step": 1}, {"file": 1, "step": 16}])"));
  CHECK(j["files"][1]["name"] == files[1].filename().string());
  // The first file holds what the stopped process logged after step 15; TensorBoard's view has
  // every step once, in order, up to the end.
  CHECK(te::stepsOf(j["files"][0], "train/loss") == std::vector<std::int64_t>{3, 6, 9, 12, 15, 16, 18, 21});
  CHECK(te::stepsOf(j["files"][0], "eval/accuracy") == std::vector<std::int64_t>{16});
  CHECK(te::stepsOf(j["files"][1], "train/loss") == std::vector<std::int64_t>{16, 18, 21, 24, 27, 30, 32});
  for (const auto& [tag, points] : j["scalars"].items()) {
    INFO(tag << ": " << points.dump());
    std::vector<std::int64_t> steps;
    for (const auto& p : points) steps.push_back(p[0].get<std::int64_t>());
    CHECK(std::is_sorted(steps.begin(), steps.end()));
    CHECK(std::set<std::int64_t>(steps.begin(), steps.end()).size() == steps.size());
    CHECK(steps.back() == 32);
  }
  CHECK(j["scalars"]["eval/accuracy"].size() == 2);
}

TEST_CASE("ctorch-train --tensorboard-dir: a file where the directory goes is one line, exit 2, before anything "
          "loads",
          "[tensorboard][trainer]") {
  TempDir dir("tb-train-bad");
  ctorch::test::writeFile(dir / "tb", "not a directory");
  const auto r = ctorch::test::run(te::train(dir.path(), {}));
  INFO(te::show(r));
  CHECK(r.exitCode == 2);
  CHECK_THAT(r.output, Catch::Contains("--tensorboard-dir 'tb': 'tb' is not a directory"));
  CHECK(r.output.find("data:") == std::string::npos);  // refused before the data is loaded
  CHECK(ctorch::test::readFile(dir / "tb") == "not a directory");
}

TEST_CASE("ctorch-train --tensorboard-dir: a full disk under the event file is one warning, the run finishes with "
          "its metrics",
          "[tensorboard][trainer][diskfull]") {
  TempDir dir("tb-train-full");
  // The third write to the event file and every later one fail (ENOSPC): the opening events and the
  // first train record are in it.
  const auto r = ctorch::test::run(
      te::train(dir.path(), {"--epochs", "1"}, {{"CTORCH_TEST_IO_FAULT", "write:3:ENOSPC:tfevents"}}));
  INFO(te::show(r));
  REQUIRE(r.ok());
  CHECK(te::count(r.output, "ctorch-train: warning: cannot write the TensorBoard event file") == 1);
  CHECK_THAT(r.output, Catch::Contains("No space left on device"));
  CHECK(fs::exists(dir / "model.pt"));
  CHECK(te::count(ctorch::test::readFile(dir / "metrics.jsonl"), "\"kind\":\"train\"") == 6);
  const auto files = tbtest::eventFiles(dir / "tb");
  REQUIRE(files.size() == 1);
  const auto events = tbtest::readEventFile(files[0]);  // whole events only
  REQUIRE(events.size() == 6);  // version, version and START at step 1, the first record's 3 scalars
  CHECK(events[5].step == 3);
}
#endif
