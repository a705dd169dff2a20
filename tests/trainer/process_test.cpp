// The real ctorch-train program, alone and under the real ctorchrun: bad input, preemption signals,
// SIGKILL of a worker mid-epoch and the bit-identical resume (toy model and the CNN on a Fashion-MNIST
// subset), a world-size change at an epoch boundary, refusal of another run's snapshot, the error
// file, the hang guard, and the files opened by Python.
#include "trainer_test_util.hpp"

#include <sys/stat.h>

#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/snapshot.hpp>

#include <nlohmann/json.hpp>

using namespace traintest;
using ctorch::test::TempDir;

namespace {

// Sends `signo` to the worker of `rank` running in `dir`, waiting for it to exist.
void signalWorker(const fs::path& dir, int rank, int signo) {
  int pid = -1;
  for (int i = 0; i < 500 && pid < 0; ++i) {
    pid = findWorkerPid(dir, rank);
    if (pid < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, signo) == 0);
}

// A metrics file's records by kind ("train", "epoch", "resume", ...) and global step.
std::map<std::string, std::map<std::int64_t, nlohmann::json>> metricsRecords(const fs::path& file) {
  std::map<std::string, std::map<std::int64_t, nlohmann::json>> byKind;
  std::istringstream lines(ctorch::test::readFile(file));
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    byKind[j["kind"].get<std::string>()][j["step"].get<std::int64_t>()] = j;
  }
  return byKind;
}

// Every train record of `b` has `a`'s loss to the last bit, and both epochs' records their loss over
// all 16 steps (two epochs of 16 steps).
void sameLossRecords(std::map<std::string, std::map<std::int64_t, nlohmann::json>>& a,
                     std::map<std::string, std::map<std::int64_t, nlohmann::json>>& b) {
  REQUIRE(a["train"].size() == b["train"].size());
  for (const auto& [step, rec] : a["train"]) {
    INFO("train record at step " << step);
    REQUIRE(b["train"].count(step) == 1);
    CHECK(b["train"][step]["loss"].get<double>() == rec["loss"].get<double>());
  }
  REQUIRE(b["epoch"].size() == 2);
  for (const auto& [step, rec] : a["epoch"]) {
    INFO("epoch record at step " << step);
    CHECK(b["epoch"][step]["loss"].get<double>() == rec["loss"].get<double>());
    CHECK(b["epoch"][step]["loss_steps"] == 16);
  }
}

std::vector<std::int64_t> stoppedSteps(const std::string& output) {
  std::vector<std::int64_t> steps;
  const std::regex line(R"(rank \d/2 stopped after [^(]*\(global step (\d+)\))");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it)
    steps.push_back(std::stoll((*it)[1]));
  return steps;
}

// Runs `args` under ctorchrun (2 ranks, --max-restarts 1) with snapshots that include global step
// `atStep`, holds every rank after that step (--hold-after-step), kills `victim` with SIGKILL once
// the step's snapshot is written, and lets the launcher restart the group, which resumes from that
// snapshot and finishes. Returns the launcher's result.
ProcessResult killAndResume(const fs::path& dir, const std::vector<std::string>& args, int victim, std::int64_t atStep) {
  Process p(trainUnderLauncher(dir, 2, with(args, {"--log-saves", "--hold-after-step", std::to_string(atStep),
                                                   "--hold-file", (dir / "never-released").string()}),
                               {"--max-restarts", "1"}));
  const std::regex written(R"(snapshot written: \S*snapshot\.pt \([^,]*, global step )" + std::to_string(atStep) + R"(\b)");
  const bool saved = waitForOutput(p, written, std::chrono::seconds(90)).has_value();
  if (saved) signalWorker(dir, victim, SIGKILL);
  auto result = p.wait();
  INFO(show(result));
  REQUIRE(saved);
  return result;
}

// The launcher's line when a worker outlasted its grace period and was killed: a graceful stop
// (gracefulStop()) never shows it.
constexpr const char* kGraceOver = "grace period over";

}  // namespace

TEST_CASE("ctorch-train: bad command-line values are one line on stderr, exit 2", "[trainer][process][cli]") {
  TempDir dir("train-cli");
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--lr", "-1"}, {"--epochs", "zero"}, {"--optimizer", "lamb"}, {"--bogus"}}) {
    const auto r = ctorch::test::run(trainAlone(dir.path(), args));
    INFO(show(r));
    CHECK(r.exitCode == ctorch::contract::kExitUsage);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
    CHECK(r.output.rfind("ctorch-train: error: ", 0) == 0);
    CHECK(r.output.find(args.front()) != std::string::npos);
  }
  const auto help = ctorch::test::run(trainAlone(dir.path(), {"--help"}));
  CHECK(help.exitCode == 0);
  CHECK(help.output.find("--save-every-steps") != std::string::npos);
}

TEST_CASE("ctorch-train: a failure found late is recorded in the error file", "[trainer][process][errors]") {
  TempDir dir("train-errfile");
  fs::create_directories(dir / "empty-data");
  auto spawn = trainAlone(dir.path(), {"--dataset", "mnist", "--data-dir", (dir / "empty-data").string()});
  spawn.setEnv["TORCHELASTIC_ERROR_FILE"] = (dir / "error.json").string();
  const auto r = ctorch::test::run(spawn);
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitUsage);  // a configuration problem: fix the input
  CHECK(r.output.find("ctorch-train: error: ") != std::string::npos);
  CHECK(r.output.find("empty-data") != std::string::npos);
  REQUIRE(fs::exists(dir / "error.json"));
  const auto json = nlohmann::json::parse(ctorch::test::readFile(dir / "error.json"));
  const std::string message = json["message"]["message"];
  CHECK(message.find("DataFileError") != std::string::npos);
  CHECK(message.find("train-images-idx3-ubyte") != std::string::npos);
}

TEST_CASE("ctorch-train: a mistyped flag or value is one line saying what to type", "[trainer][process][cli]") {
  TempDir dir("train-typo");
  const auto typo = ctorch::test::run(trainAlone(dir.path(), {"--epoch", "1"}));
  INFO(show(typo));
  CHECK(typo.exitCode == ctorch::contract::kExitUsage);
  CHECK(typo.output == "ctorch-train: error: unknown option '--epoch' (did you mean --epochs?)\n");
  const auto number = ctorch::test::run(trainAlone(dir.path(), {"--lr", "abc"}));
  INFO(show(number));
  CHECK(number.exitCode == ctorch::contract::kExitUsage);
  CHECK(number.output == "ctorch-train: error: --lr 'abc' is not a number\n");
}

// torchrun users write --amp and expect torch.autocast's choice for the device (issue 42.7).
TEST_CASE("ctorch-train: --amp alone trains on the CPU in bfloat16", "[trainer][process][amp]") {
  TempDir dir("train-amp");
  const auto r = ctorch::test::run(trainAlone(dir.path(), {"--amp", "--train-limit", "64", "--test-limit", "32",
                                                           "--batch-size", "32", "--epochs", "1", "--device", "auto"}));
  INFO(show(r));
  CHECK(r.exitCode == 0);
  CHECK(r.output.find("bfloat16") != std::string::npos);
}

TEST_CASE("ctorch-train: a malformed data file is one line with its message, no C++ type", "[trainer][process][errors]") {
  TempDir dir("train-format");
  fs::create_directories(dir / "bad-data");
  for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                           "t10k-labels-idx1-ubyte"})
    ctorch::test::writeFile(dir / "bad-data" / name, "this is not an IDX file");
  auto spawn = trainAlone(dir.path(), {"--dataset", "mnist", "--data-dir", (dir / "bad-data").string()});
  spawn.setEnv["TORCHELASTIC_ERROR_FILE"] = (dir / "error.json").string();
  const auto r = ctorch::test::run(spawn);
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitUsage);  // bad input: fix the file
  const auto start = r.output.find("ctorch-train: error: ");
  REQUIRE(start != std::string::npos);
  const std::string line = r.output.substr(start);
  CHECK(std::count(line.begin(), line.end(), '\n') == 1);
  CHECK(line.find("train-images-idx3-ubyte") != std::string::npos);
  CHECK(line.find("ctorch::") == std::string::npos);
  CHECK(line.find("DataFormatError") == std::string::npos);
  // The error file keeps the type for the launcher's summary.
  CHECK(ctorch::test::readFile(dir / "error.json").find("ctorch::data::DataFormatError") != std::string::npos);
}

TEST_CASE("ctorch-train: missing CIFAR-10 says where the data comes from", "[trainer][process][errors]") {
  TempDir dir("train-cifar");
  fs::create_directories(dir / "empty");
  const auto r = ctorch::test::run(trainAlone(dir.path(), {"--dataset", "cifar10", "--model", "resnet18",
                                                           "--data-dir", (dir / "empty").string()}));
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitUsage);
  CHECK(r.output.find("data_batch_1.bin") != std::string::npos);
  CHECK(r.output.find("cifar-10-binary.tar.gz") != std::string::npos);
  CHECK(r.output.find("https://www.cs.toronto.edu/~kriz/cifar.html") != std::string::npos);
  CHECK(r.output.find("--data-dir") != std::string::npos);
}

TEST_CASE("ctorch-train: a batch larger than the rank's share of the data is refused before training",
          "[trainer][process][memory]") {
  TempDir dir("train-batch");
  const auto r = ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--batch-size", "1000000"})));
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitUsage);
  CHECK(r.output.find("ctorch-train: error: --batch-size '1000000' is larger than this rank's share of the "
                      "training set (512 of 512 samples over 1 rank): use at most 512") != std::string::npos);
  CHECK(r.output.find("epoch 1/") == std::string::npos);  // refused before the first step
}

TEST_CASE("ctorch-train: ResNet-18 trains on CIFAR-shaped synthetic images (--synthetic-shape 3,32,32)",
          "[trainer][process][data]") {
  TempDir dir("train-shape");
  const auto r = ctorch::test::run(trainAlone(
      dir.path(), {"--model", "resnet18", "--dataset", "synthetic-images", "--synthetic-shape", "3,32,32",
                   "--synthetic-size", "32", "--test-limit", "16", "--batch-size", "16", "--epochs", "1",
                   "--eval-batch-size", "16"}));
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(r.output.find("samples of [3, 32, 32]") != std::string::npos);
  CHECK(r.output.find("model: resnet18") != std::string::npos);
}

TEST_CASE("ctorch-train: weights and metrics land beside the snapshot by default", "[trainer][process][outputs]") {
  TempDir dir("train-beside");
  const auto r = ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--epochs", "1", "--snapshot-path",
                                                                      (dir / "run1" / "snapshot.pt").string()})));
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(fs::exists(dir / "run1" / "snapshot.pt"));
  CHECK(fs::exists(dir / "run1" / "model.pt"));
  CHECK(fs::exists(dir / "run1" / "metrics.jsonl"));
  CHECK_FALSE(fs::exists(dir / "model.pt"));
  CHECK_FALSE(fs::exists(dir / "metrics.jsonl"));
  const auto given = ctorch::test::run(trainAlone(
      dir.path(), with(kToy, {"--epochs", "1", "--snapshot-path", (dir / "run2" / "snapshot.pt").string(),
                              "--model-dir", (dir / "weights").string()})));
  INFO(show(given));
  REQUIRE(given.ok());
  CHECK(fs::exists(dir / "weights" / "model.pt"));
  CHECK(fs::exists(dir / "weights" / "metrics.jsonl"));
  CHECK_FALSE(fs::exists(dir / "run2" / "model.pt"));
}

TEST_CASE("outputs: every place the run writes is checked before anything is loaded, in flag names (issue 28.6)",
          "[trainer][process][outputs]") {
  TempDir dir("train-outputs");
  const fs::path fifo = dir / "fifo", adir = dir / "adir", weights = dir / "weights";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  fs::create_directories(adir);
  fs::create_directories(weights / "model.pt");  // a directory where the final weights go
  std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--snapshot-path", adir.string()},
       "--snapshot-path '" + adir.string() + "' is a directory: name a file in it (e.g. --snapshot-path " +
           (adir / "snapshot.pt").string() + ")"},
      {{"--metrics-file", fifo.string()}, "--metrics-file '" + fifo.string() + "' is not a regular file"},
      {{"--model-dir", fifo.string()}, "--model-dir '" + fifo.string() + "': '" + fifo.string() + "' is not a directory"},
      {{"--model-dir", weights.string()}, "--model-filename '" + (weights / "model.pt").string() + "' is a directory"},
  };
  // A directory nobody may write in, root included (sysfs): as a read-only mount would be.
  if (fs::is_directory("/sys/kernel"))
    cases.push_back({{"--model-dir", "/sys/kernel"}, "--model-dir '/sys/kernel': cannot write in '/sys/kernel': "});
  for (const auto& [args, message] : cases) {
    const auto r = ctorch::test::run(trainAlone(dir.path(), with(kToy, args)));
    INFO(show(r));
    CHECK(r.exitCode == ctorch::contract::kExitUsage);
    CHECK(r.output.find("ctorch-train: error: " + message) != std::string::npos);
    CHECK(r.output.find("data: ") == std::string::npos);  // before the data (and the model) were loaded
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  }
  CHECK(fs::is_fifo(fifo));  // never opened for writing, never replaced
  CHECK(std::distance(fs::directory_iterator(adir), fs::directory_iterator()) == 0);  // no probe file left
}

TEST_CASE("profiler: --profile-steps A:B writes a Chrome trace of those steps on every rank (issue 28.8)",
          "[trainer][process][outputs]") {
  TempDir dir("train-profile");
  const auto r = ctorch::test::run(
      trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "1", "--profile-steps", "3:4", "--model-dir",
                                                    (dir / "out").string()})));
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(r.output.find("profiling global steps 3 to 4") != std::string::npos);
  CHECK(r.output.find("profiler trace written: " + (dir / "out" / "trace-rank0.json").string() +
                      " (through global step 4") != std::string::npos);
  for (int rank : {0, 1}) {
    const fs::path trace = dir / "out" / ("trace-rank" + std::to_string(rank) + ".json");
    INFO(trace);
    REQUIRE(fs::exists(trace));
    const auto events = nlohmann::json::parse(ctorch::test::readFile(trace));  // Chrome's trace format: a list
    REQUIRE(events.is_array());
    std::set<std::string> names;
    for (const auto& e : events) names.insert(e.value("name", ""));
    CHECK(names.count("aten::addmm") + names.count("aten::linear") > 0);  // the forward
    CHECK(names.count("AddmmBackward0") > 0);                             // and the backward
  }
  // Bad values are refused before anything runs, naming the flag.
  for (const std::string bad : {"5:2", "0:3", "x", "3:"}) {
    const auto b = ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--profile-steps", bad})));
    INFO(show(b));
    CHECK(b.exitCode == ctorch::contract::kExitUsage);
    CHECK(b.output.find("--profile-steps '" + bad + "'") != std::string::npos);
  }
}

TEST_CASE("metrics: a classification run stopped before its first evaluation is still classification",
          "[trainer][process][outputs]") {
  TempDir dir("train-task");
  const auto r = ctorch::test::run(trainAlone(
      dir.path(), {"--model", "simple-cnn", "--dataset", "synthetic-images", "--synthetic-size", "64",
                   "--test-limit", "16", "--batch-size", "16", "--max-steps", "2", "--log-interval", "1",
                   "--save-every", "0"}));
  INFO(show(r));
  REQUIRE(r.ok());
  // plot_metrics.py's decision, without matplotlib: from the records' loss kind.
  SpawnOptions py;
  py.argv = {"/usr/bin/python3", "-c",
             "import sys; sys.path.insert(0, sys.argv[1]); import plot_metrics as p; d = p.read(sys.argv[2]); "
             "print('task:', p.task(d.get('train', []), d.get('eval', [])))",
             CTORCH_SOURCE_DIR "/scripts", (dir / "metrics.jsonl").string()};
  py.timeout = std::chrono::seconds(60);
  const auto decided = ctorch::test::run(py);
  INFO(show(decided));
  CHECK(decided.output == "task: classification\n");
  CHECK(ctorch::test::readFile(dir / "metrics.jsonl").find("\"loss_kind\":\"cross_entropy\"") != std::string::npos);
}

TEST_CASE("preemption: SIGTERM to one worker stops both after the same step, exit 75, then resume",
          "[trainer][process][signals]") {
  TempDir dir("train-preempt"), reference("train-preempt-ref");
  const auto args = with(kToy, {"--epochs", "3"});
  const auto ref = ctorch::test::run(trainUnderLauncher(reference.path(), 2, args));
  REQUIRE(ref.ok());

  // Both ranks hold after step 8 until the stop is sent: it lands mid-run however loaded the machine.
  Process p(trainUnderLauncher(dir.path(), 2, with(args, {"--hold-after-step", "8", "--hold-file", (dir / "go").string()}),
                               gracefulStop()));
  REQUIRE(waitForOutput(p, std::regex("rank 1: holding after global step 8"), std::chrono::seconds(90)));
  signalWorker(dir.path(), 1, SIGTERM);
  ctorch::test::writeFile(dir / "go", "");
  const auto r = p.wait();
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitPreempted);  // the workers' code, passed on by ctorchrun
  CHECK(r.output.find(kGraceOver) == std::string::npos);
  const auto steps = stoppedSteps(r.output);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0] == steps[1]);
  CHECK(r.output.find("Terminated here") != std::string::npos);
  CHECK(r.output.find("a stop signal on another rank") != std::string::npos);
  CHECK(r.output.find("run the same command again to resume (exit code 75)") != std::string::npos);
  const auto snap = ctorch::loadSnapshot(dir / "snapshot.pt");
  CHECK(snap.globalStep == steps[0]);
  CHECK(snap.globalStep > 8);
  CHECK(snap.globalStep < 48);

  const auto resumed = ctorch::test::run(trainUnderLauncher(dir.path(), 2, args));
  INFO(show(resumed));
  REQUIRE(resumed.ok());
  CHECK(resumed.output.find("exactly where it stopped") != std::string::npos);
  CHECK(bitDifference(dir / "model.pt", reference / "model.pt").empty());
}

TEST_CASE("metrics: a run stopped by SIGTERM between two logged steps writes, once resumed, the same train and "
          "epoch records as one never stopped (issue 42.3)",
          "[trainer][process][signals][metrics]") {
  TempDir dir("train-stop-metrics"), reference("train-stop-metrics-ref");
  // 16 steps per epoch (2 ranks x 16), losses summed over the ranks only at the logged steps (7, 14,
  // 16) and no scheduled snapshots: a stop soon after step 7 saves steps whose losses each rank
  // holds alone.
  const std::vector<std::string> args = {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                         "512", "--batch-size", "16", "--test-limit", "64", "--lr", "0.05",
                                         "--epochs", "2", "--log-interval", "7"};
  const auto ref = ctorch::test::run(trainUnderLauncher(reference.path(), 2, args));
  INFO(show(ref));
  REQUIRE(ref.ok());
  // Held after step 7 until the stop is sent: the stop is agreed after a step that logs nothing.
  Process p(trainUnderLauncher(dir.path(), 2, with(args, {"--hold-after-step", "7", "--hold-file", (dir / "go").string()}),
                               gracefulStop()));
  REQUIRE(waitForOutput(p, std::regex("rank 1: holding after global step 7"), std::chrono::seconds(90)));
  signalWorker(dir.path(), 1, SIGTERM);
  ctorch::test::writeFile(dir / "go", "");
  const auto stopped = p.wait();
  INFO(show(stopped));
  REQUIRE(stopped.exitCode == ctorch::contract::kExitPreempted);
  CHECK(stopped.output.find(kGraceOver) == std::string::npos);
  const std::int64_t at = ctorch::loadSnapshot(dir / "snapshot.pt").globalStep;
  INFO("stopped at global step " << at);
  const auto resumed = ctorch::test::run(trainUnderLauncher(dir.path(), 2, args));
  INFO(show(resumed));
  REQUIRE(resumed.ok());
  CHECK(resumed.output.find("exactly where it stopped") != std::string::npos);
  auto a = metricsRecords(reference / "metrics.jsonl"), b = metricsRecords(dir / "metrics.jsonl");
  sameLossRecords(a, b);
  // The test means something only when the stop fell between two sums: after step 7, before 14.
  CHECK(at > 7);
  CHECK(at < 14);
}

TEST_CASE("preemption: one stop delivered three times at once (Slurm signals the step, ctorchrun forwards) is one stop",
          "[trainer][process][signals]") {
  TempDir dir("train-preempt-copies");
  Process p(trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "3", "--hold-after-step", "8", "--hold-file",
                                                          (dir / "go").string()}),
                               gracefulStop()));
  REQUIRE(waitForOutput(p, std::regex("rank 1: holding after global step 8"), std::chrono::seconds(90)));
  // scancel --signal=TERM: slurmstepd signals every process of the step and ctorchrun forwards its
  // own copy, so a worker sees the same SIGTERM several times within milliseconds.
  for (int i = 0; i < 3; ++i) signalWorker(dir.path(), 1, SIGTERM);
  ctorch::test::writeFile(dir / "go", "");
  const auto r = p.wait();
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitPreempted);  // not 143: the copies did not kill rank 1
  CHECK(r.output.find(kGraceOver) == std::string::npos);
  const auto steps = stoppedSteps(r.output);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0] == steps[1]);
  CHECK(ctorch::loadSnapshot(dir / "snapshot.pt").globalStep == steps[0]);
}

TEST_CASE("preemption: SIGUSR1 to ctorchrun (Slurm's warning) stops every worker after the same step",
          "[trainer][process][signals]") {
  TempDir dir("train-usr1");
  // Both ranks hold after step 4; the hold file is never made: each rank goes on when the
  // forwarded signal reaches it.
  Process p(trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "3", "--hold-after-step", "4", "--hold-file",
                                                          (dir / "never-released").string()}),
                               gracefulStop()));
  for (int rank : {0, 1})
    REQUIRE(waitForOutput(p, std::regex("rank " + std::to_string(rank) + ": holding after global step 4"),
                          std::chrono::seconds(90)));
  ::kill(p.pid(), SIGUSR1);  // Slurm's preemption warning, as `scancel --signal=USR1` sends it
  const auto r = p.wait();
  INFO(show(r));
  // Every worker saved its state and exited 75 after the forwarded signal: ctorchrun says "requeue me".
  CHECK(r.exitCode == ctorch::contract::kExitPreempted);
  CHECK(r.output.find(kGraceOver) == std::string::npos);
  const auto steps = stoppedSteps(r.output);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0] == steps[1]);
  CHECK(countMatches(r.output, std::regex("User defined signal 1 here")) == 2);
  CHECK(ctorch::loadSnapshot(dir / "snapshot.pt").globalStep == steps[0]);
}

TEST_CASE("resume: the toy model killed mid-epoch (SIGKILL, rank 1) ends bit-identical to an uninterrupted run",
          "[trainer][process][resume]") {
  TempDir dir("train-kill"), reference("train-kill-ref"), other("train-kill-seed");
  const auto args = with(kToy, {"--epochs", "3", "--save-every-steps", "5"});
  REQUIRE(ctorch::test::run(trainUnderLauncher(reference.path(), 2, args)).ok());

  // Killed after the snapshot of step 20 (epoch 2 has steps 17..32): resumes mid-epoch.
  const auto r = killAndResume(dir.path(), args, /*victim=*/1, /*atStep=*/20);
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(r.output.find("attempt 2") != std::string::npos);  // the launcher restarted the group
  const std::regex resumed(R"(resuming from \S*snapshot\.pt after 1 epoch \+ (\d+) steps? \(global step \d+\), exactly)");
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, resumed));
  CHECK(std::stoi(m[1]) > 0);  // mid-epoch
  CHECK(bitDifference(dir / "model.pt", reference / "model.pt").empty());

  // Control: the comparison sees a difference where there is one (another seed).
  REQUIRE(ctorch::test::run(trainUnderLauncher(other.path(), 2, with(args, {"--seed", "2"}))).ok());
  CHECK_FALSE(bitDifference(other / "model.pt", reference / "model.pt").empty());
}

TEST_CASE("metrics: a run killed mid-epoch writes the same train and epoch records as one never interrupted, and "
          "marks the resume (issue 28.5)",
          "[trainer][process][resume][metrics]") {
  TempDir dir("train-kill-metrics"), reference("train-kill-metrics-ref");
  // 16 steps per epoch (2 ranks x 16); losses logged every 3 steps, snapshots every 5: the resume
  // (at step 20) falls inside a log interval and inside epoch 2 (steps 17..32).
  const std::vector<std::string> args = {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                         "512", "--batch-size", "16", "--test-limit", "64", "--lr", "0.05",
                                         "--epochs", "2", "--log-interval", "3", "--save-every-steps", "5"};
  const auto ref = ctorch::test::run(trainUnderLauncher(reference.path(), 2, args));
  INFO(show(ref));
  REQUIRE(ref.ok());
  const auto r = killAndResume(dir.path(), args, /*victim=*/1, /*atStep=*/20);
  INFO(show(r));
  REQUIRE(r.ok());
  auto a = metricsRecords(reference / "metrics.jsonl"), b = metricsRecords(dir / "metrics.jsonl");
  REQUIRE(b["resume"].size() == 1);
  const std::int64_t resumedAt = b["resume"].begin()->first;
  CHECK(resumedAt == 20);
  CHECK(a["resume"].empty());
  // Every loss record, before and after the resume, to the last bit; the epoch's covers all 16 steps.
  sameLossRecords(a, b);
  for (const auto& [step, rec] : a["epoch"]) CHECK(b["epoch"][step]["steps"] == 16);
  CHECK(b["epoch"][32]["steps_run"].get<std::int64_t>() == 32 - resumedAt);
  CHECK(b["epoch"][32]["resumed_at"].get<std::int64_t>() == resumedAt - 16);
  CHECK(r.output.find("(resumed at step " + std::to_string(resumedAt - 16) + ")") != std::string::npos);
  // metrics.png marks it: plot_metrics.py's marks, without matplotlib.
  SpawnOptions py;
  py.argv = {"/usr/bin/python3", "-c",
             "import sys; sys.path.insert(0, sys.argv[1]); import plot_metrics as p; "
             "print('marks:', p.resume_marks(p.read(sys.argv[2])))",
             CTORCH_SOURCE_DIR "/scripts", (dir / "metrics.jsonl").string()};
  py.timeout = std::chrono::seconds(60);
  const auto marks = ctorch::test::run(py);
  INFO(show(marks));
  CHECK(marks.output == "marks: [" + std::string(resumedAt == 20 ? "1.25" : "1.5625") + "]\n");
}

TEST_CASE("resume: the CNN on a Fashion-MNIST subset killed mid-epoch (SIGKILL, rank 0) ends bit-identical",
          "[trainer][process][resume][fashion-mnist]") {
  if (!haveFashionMnist()) CTORCH_SKIP("Debian's dataset-fashion-mnist is not installed");
  TempDir dir("train-cnn-kill"), reference("train-cnn-ref");
  // 512 samples, 2 ranks x 16: 16 steps per epoch; dropout makes every step's random state matter.
  const std::vector<std::string> args = {"--train-limit", "512", "--test-limit", "200", "--batch-size", "16",
                                         "--epochs", "2", "--save-every-steps", "4", "--log-interval", "4"};
  const auto ref = ctorch::test::run(trainUnderLauncher(reference.path(), 2, args));
  INFO(show(ref));
  REQUIRE(ref.ok());
  const auto r = killAndResume(dir.path(), args, /*victim=*/0, /*atStep=*/20);
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(std::regex_search(r.output, std::regex(R"(resuming from \S+ after 1 epoch \+ [1-9]\d* steps? .*exactly)")));
  CHECK(bitDifference(dir / "model.pt", reference / "model.pt").empty());
}

TEST_CASE("resume: another world size continues from the epoch boundary and says what it did",
          "[trainer][process][resume]") {
  // Path A: 2 ranks stop mid-epoch 2 (--max-steps 20; 16 steps per epoch), then 1 rank resumes:
  // the mid-epoch snapshot cannot be used, the epoch-boundary one (end of epoch 1) is.
  // Path B: 2 ranks run exactly 1 epoch, then 1 rank resumes from that boundary.
  // Both continue epoch 2 from the same state under the same world size: bit-identical results.
  TempDir a("train-ws-a"), b("train-ws-b"), fresh("train-ws-fresh");
  const auto first = ctorch::test::run(trainUnderLauncher(a.path(), 2, with(kToy, {"--epochs", "3", "--max-steps", "20"})));
  INFO(show(first));
  REQUIRE(first.ok());
  CHECK(first.output.find("reached --max-steps 20 at 1 epoch + 4 steps (global step 20)") != std::string::npos);
  CHECK(ctorch::loadSnapshot(a / "snapshot.pt").globalStep == 20);
  CHECK(ctorch::loadSnapshot(a / "snapshot-epoch.pt").globalStep == 16);

  const auto second = ctorch::test::run(trainAlone(a.path(), with(kToy, {"--epochs", "3"})));
  INFO(show(second));
  REQUIRE(second.ok());
  CHECK(second.output.find("snapshot.pt stopped mid-epoch after 1 epoch + 4 steps (global step 20) under 2 ranks; a run of "
                           "1 rank can resume only at an epoch boundary") != std::string::npos);
  CHECK(second.output.find("snapshot-epoch.pt after 1 epoch (global step 16)") != std::string::npos);
  CHECK(second.output.find("the 4 steps after it are redone with 1 rank") != std::string::npos);

  REQUIRE(ctorch::test::run(trainUnderLauncher(b.path(), 2, with(kToy, {"--epochs", "1"}))).ok());
  const auto continued = ctorch::test::run(trainAlone(b.path(), with(kToy, {"--epochs", "3"})));
  INFO(show(continued));
  REQUIRE(continued.ok());
  CHECK(continued.output.find("written by 2 ranks at an epoch boundary, continued by 1 rank") != std::string::npos);
  CHECK(bitDifference(a / "model.pt", b / "model.pt").empty());

  // Control: 1 rank from scratch took other steps in epoch 1 and ends elsewhere.
  REQUIRE(ctorch::test::run(trainAlone(fresh.path(), with(kToy, {"--epochs", "3"}))).ok());
  CHECK_FALSE(bitDifference(a / "model.pt", fresh / "model.pt").empty());
}

TEST_CASE("resume: a snapshot of another configuration is refused, naming the difference, unless allowed",
          "[trainer][process][resume]") {
  TempDir dir("train-refuse");
  REQUIRE(ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--epochs", "1"}))).ok());
  const auto refused = ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--epochs", "2", "--lr", "0.1"})));
  INFO(show(refused));
  CHECK(refused.exitCode == ctorch::contract::kExitUsage);
  CHECK(refused.output.find("config 'lr' is '0.05' in the snapshot, '0.1' in this run") != std::string::npos);
  // ... and says how to go on.
  CHECK(refused.output.find("to go on, pass --resume never (start over") != std::string::npos);
  CHECK(refused.output.find("--allow-config-change") != std::string::npos);
  CHECK(refused.output.find("or another --snapshot-path") != std::string::npos);
  const auto allowed = ctorch::test::run(
      trainAlone(dir.path(), with(kToy, {"--epochs", "2", "--lr", "0.1", "--allow-config-change"})));
  INFO(show(allowed));
  CHECK(allowed.ok());
  CHECK(allowed.output.find("resuming from") != std::string::npos);
  const auto model = ctorch::test::run(trainAlone(dir.path(), with(kToy, {"--epochs", "3", "--model", "mnist-cnn"})));
  CHECK(model.exitCode == ctorch::contract::kExitUsage);  // not even the model fits the data
  // --allow-config-change lets the configuration differ, never the model: one line naming both
  // (issue 12: it used to fail later with a DDP bucket message).
  const auto otherModel = ctorch::test::run(trainAlone(
      dir.path(), with(kToy, {"--epochs", "3", "--model", "mnist-cnn", "--dataset", "synthetic-images",
                              "--allow-config-change"})));
  INFO(show(otherModel));
  CHECK(otherModel.exitCode == ctorch::contract::kExitUsage);
  CHECK(otherModel.output.find("model name is 'linear' in the snapshot, 'mnist-cnn' in this run") !=
        std::string::npos);
  CHECK(otherModel.output.find("bucket") == std::string::npos);
}

TEST_CASE("resume: a snapshot whose fields the loop reads back are retyped is set aside and snapshot.pt.1 resumes "
          "(issue 58)",
          "[trainer][process][resume]") {
  // Each with a valid digest. Before: epoch_complete not a bool and train_seconds not a float ended
  // every rank with a c10::Error (INTERNAL ASSERT FAILED), ddp_buckets not a list with "unusable"
  // raised after the search: exit 1, snapshot.pt.1 never tried.
  TempDir dir("train-retyped");
  const auto args = with(kToy, {"--epochs", "2"});
  const auto first = ctorch::test::run(trainUnderLauncher(dir.path(), 2, args));
  INFO(show(first));
  REQUIRE(first.ok());
  REQUIRE(fs::exists(dir / "snapshot.pt.1"));
  fs::copy_file(dir / "snapshot.pt", dir / "good.pt");
  fs::copy_file(dir / "snapshot.pt.1", dir / "good.pt.1");
  const std::vector<std::tuple<std::string, c10::IValue, std::string>> cases = {
      {"epoch_complete", c10::IValue(std::int64_t(7)), "USER_STATE['epoch_complete'] is a Int, expected a bool"},
      {"train_seconds", c10::IValue(std::string("soon")), "USER_STATE['train_seconds'] cannot be restored"},
      {"ddp_buckets", c10::IValue(std::string("none")), "ddp_buckets is not a list"},
      {"best_accuracy", c10::IValue(std::string("high")), "USER_STATE['best_accuracy'] is not a number"},
  };
  // The optimizer's state too (before: SnapshotIncompatible naming the field, exit 2, .1 never tried):
  // OPTIMIZER_STATE['state'] not a dict, a group's learning rate not a number.
  const std::vector<std::tuple<std::string, c10::IValue, std::string>> optimizerCases = {
      {"state", c10::IValue(std::string("none")), "OPTIMIZER_STATE: OPTIMIZER_STATE lacks 'state' (dict)"},
      {"lr", c10::IValue(std::string("fast")), "OPTIMIZER_STATE: param_groups[0]['lr'] is String, expected a number"},
  };
  std::vector<std::tuple<std::string, c10::IValue, std::string>> all = cases;
  all.insert(all.end(), optimizerCases.begin(), optimizerCases.end());
  for (const auto& [key, value, says] : all) {
    for (const auto& name : {"snapshot.pt", "snapshot.pt.1", "snapshot.pt.unusable"}) fs::remove(dir / name);
    ctorch::Snapshot s = ctorch::loadSnapshot(dir / "good.pt");
    if (key == "state") {
      s.optimizerState.insert_or_assign("state", value);
    } else if (key == "lr") {
      auto group = s.optimizerState.at("param_groups").toListRef().at(0).toGenericDict();
      REQUIRE(group.contains("lr"));
      group.insert_or_assign("lr", value);
    } else {
      s.userState.insert_or_assign(key, value);
    }
    ctorch::SnapshotSlotOptions slot;
    slot.path = dir / "snapshot.pt";
    slot.keepPrevious = 0;
    ctorch::saveSnapshot(s, slot);  // a new digest: the file is sound, one field is not
    fs::copy_file(dir / "good.pt.1", dir / "snapshot.pt.1");  // after: a save with K = 0 drops .1
    const auto r = ctorch::test::run(trainUnderLauncher(dir.path(), 2, args));
    INFO(key << ": " << show(r));
    CHECK(r.ok());
    CHECK(r.output.find(says) != std::string::npos);
    CHECK(r.output.find("snapshot.pt.1 after") != std::string::npos);  // "resuming from <slot>.1 after ..."
    CHECK(fs::exists(dir / "snapshot.pt.unusable"));
  }
}

TEST_CASE("hang guard: a stopped peer turns into a timeout error within --timeout", "[trainer][process][errors]") {
  TempDir dir("train-hang");
  // --timeout 10: long enough that no healthy rank of a loaded machine reaches it (it also bounds the
  // set-up's connections); the stopped rank is what makes rank 0 reach it.
  auto spawn = trainUnderLauncher(dir.path(), 2, with(kToy, {"--epochs", "3", "--step-delay-ms", "20", "--timeout", "10"}));
  Process p(spawn);
  REQUIRE(waitForOutput(p, std::regex(R"(epoch 1/3  step  4/16)"), std::chrono::seconds(60)));
  int pid = findWorkerPid(dir.path(), 1);
  REQUIRE(pid > 0);
  ::kill(pid, SIGSTOP);
  const auto r = p.wait();  // ctorchrun SIGKILLs the stopped worker after its shutdown timeout
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitFailure);  // rank 0's error exit is the root cause
  CHECK(std::regex_search(r.output, std::regex(R"(rank 0: step \d+ failed: .*imed out.*after --timeout 10 s\))")));
  CHECK(r.output.find("ctorch::DistributedTimeout") != std::string::npos);  // the launcher shows the error file
}

TEST_CASE("outputs: Python opens the snapshot and the final weights, and the metrics plot", "[trainer][process][python]") {
  if (!haveFashionMnist()) CTORCH_SKIP("Debian's dataset-fashion-mnist is not installed");
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 has no torch (Debian's python3-torch)");
  TempDir dir("train-python");
  const auto r = ctorch::test::run(trainAlone(
      dir.path(), {"--train-limit", "256", "--test-limit", "100", "--batch-size", "32", "--epochs", "2",
                   "--checkpoint-every", "1", "--keep-checkpoints", "1", "--log-interval", "2"}));
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(fs::exists(dir / "checkpoint_epoch_2.pt"));
  CHECK_FALSE(fs::exists(dir / "checkpoint_epoch_1.pt"));  // kept: the newest 1
  SpawnOptions py;
  py.argv = {"/usr/bin/python3", CTORCH_TRAINER_TEST_DIR "/check_outputs.py", dir.path().string(), CTORCH_SOURCE_DIR};
  py.timeout = std::chrono::seconds(120);
  const auto checked = ctorch::test::run(py);
  INFO(show(checked));
  CHECK(checked.ok());
  CHECK(checked.output.find("snapshot ok: EPOCHS_RUN 2") != std::string::npos);
  CHECK(checked.output.find("model.pt loads into ctorch_models.MnistCnn") != std::string::npos);

  SpawnOptions plot;
  plot.argv = {"/usr/bin/python3", CTORCH_SOURCE_DIR "/scripts/plot_metrics.py", (dir / "metrics.jsonl").string(),
               "-o", (dir / "curves.png").string()};
  plot.timeout = std::chrono::seconds(120);
  const auto plotted = ctorch::test::run(plot);
  if (plotted.output.find("No module named 'matplotlib'") != std::string::npos)
    CTORCH_SKIP("python3-matplotlib is not installed (scripts/setup.sh installs it)");
  INFO(show(plotted));
  REQUIRE(plotted.ok());
  const std::string png = ctorch::test::readFile(dir / "curves.png");
  CHECK(png.substr(1, 3) == "PNG");
}

// Issue 28.2: a deterministic failure (a typo on the command line, a snapshot of another
// configuration) fails the same way at every restart: ctorch-train records it as not worth
// retrying, ctorchrun does not restart the group for it, exits with the worker's code 2 and shows
// the message in its summary.
TEST_CASE("deterministic failures: a typo and an incompatible snapshot are not restarted, the summary shows why",
          "[trainer][process]") {
  TempDir dir("no-retry");
  const auto typo = ctorch::test::run(trainUnderLauncher(dir.path(), 2, {"--epoch", "1"}, {"--max-restarts", "3"}));
  INFO(show(typo));
  CHECK(typo.exitCode == ctorch::contract::kExitUsage);
  CHECK(typo.output.find("restarting, restart") == std::string::npos);
  CHECK_THAT(typo.output, Catch::Contains("a restart cannot fix"));
  CHECK(typo.output.find("<no error file>") == std::string::npos);
  CHECK_THAT(typo.output, Catch::Contains("ctorch::train::UsageError"));

  const std::vector<std::string> toy = {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                        "128", "--batch-size", "16", "--epochs", "1"};
  REQUIRE(ctorch::test::run(trainAlone(dir.path(), with(toy, {"--lr", "0.1"}))).ok());
  const auto other = ctorch::test::run(trainUnderLauncher(dir.path(), 2, with(toy, {"--lr", "0.2"}), {"--max-restarts", "2"}));
  INFO(show(other));
  CHECK(other.exitCode == ctorch::contract::kExitUsage);
  CHECK(other.output.find("restarting, restart") == std::string::npos);
  CHECK_THAT(other.output, Catch::Contains("config 'lr' is '0.1' in the snapshot, '0.2' in this run"));
}

TEST_CASE("pipeline: ctorch-train --pipeline-stages 2 on the simple CNN equals one rank accumulating the same "
          "micro-batches, bit for bit, and what a pipeline does not do is refused in one line",
          "[trainer][process][pipeline]") {
  TempDir dir("train-pipeline");
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--pipeline-stages", "2", "--model", "linear"}, "--pipeline-stages 2 with --model linear: the model is one layer"},
           {{"--pipeline-stages", "2", "--sharding", "full"}, "--pipeline-stages 2 with --sharding full"},
           {{"--pipeline-stages", "2", "--grad-accum-steps", "2"}, "--pipeline-stages 2 with --grad-accum-steps 2"},
           {{"--pipeline-stages", "2", "--micro-batches", "65", "--batch-size", "64"}, "--micro-batches 65 and --batch-size 64"},
           {{"--pipeline-stages", "2", "--schedule", "zero-bubble"}, "--schedule 'zero-bubble' is not one of: 1f1b, gpipe"},
           {{"--micro-batches", "4"}, "--micro-batches '4' needs --pipeline-stages 2 or more"},
           {{"--pipeline-stages", "0"}, "--pipeline-stages '0' must be in [1, 1024]"}}) {
    const auto r = ctorch::test::run(trainAlone(dir.path(), args));
    INFO(show(r));
    CHECK(r.exitCode == ctorch::contract::kExitUsage);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
    CHECK(r.output.rfind("ctorch-train: error: ", 0) == 0);
    CHECK(r.output.find(says) != std::string::npos);
  }
  if (!haveFashionMnist()) CTORCH_SKIP("Debian's dataset-fashion-mnist is not installed");
  // No dropout, no BatchNorm: a step of 4 micro-batches of 4 rows is the same arithmetic in a pipeline
  // of 2 processes as in one process accumulating 4 batches of 4 rows.
  TempDir piped("train-pipeline-2"), alone("train-pipeline-ref");
  const std::vector<std::string> common = {"--model", "simple-cnn", "--train-limit", "256", "--test-limit", "100",
                                           "--epochs", "2", "--log-interval", "4"};
  const auto pipeline = ctorch::test::run(trainUnderLauncher(
      piped.path(), 2, with(common, {"--batch-size", "16", "--pipeline-stages", "2", "--micro-batches", "4", "--schedule", "gpipe"})));
  INFO(show(pipeline));
  REQUIRE(pipeline.ok());
  CHECK(pipeline.output.find("a pipeline of 2 stages (this rank: stage 0") != std::string::npos);
  const auto reference = ctorch::test::run(trainAlone(alone.path(), with(common, {"--batch-size", "4", "--grad-accum-steps", "4"})));
  INFO(show(reference));
  REQUIRE(reference.ok());
  // The final weights (the stages gathered on rank 0) and the test accuracy of every epoch.
  CHECK(bitDifference(piped / "model.pt", alone / "model.pt").empty());
  const std::regex accuracy(R"(test: loss \S+, accuracy \S+)");
  auto accuracies = [&](const std::string& text) {
    std::vector<std::string> found;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), accuracy); it != std::sregex_iterator(); ++it) found.push_back(it->str());
    return found;
  };
  CHECK(accuracies(pipeline.output).size() == 2);
  CHECK(accuracies(pipeline.output) == accuracies(reference.output));
}
