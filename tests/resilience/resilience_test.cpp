// ctorch::ResilientTraining driven the way a user's own loop drives it (tests/consumer is the same
// loop built against the installed package): real worker processes, a real TCPStore and Gloo. A run
// that is stopped (a signal on one rank), crashes, or meets a damaged snapshot must end with final
// weights and tracked values equal to the bit to a run that never stopped. Controls prove the
// comparison bites.
#include "ctorch_catch.hpp"
#include "multiproc.hpp"

#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/resilience.hpp>
#include <ctorch/sharded_snapshot.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/stateful.hpp>
#include <ctorch/fully_sharded_data_parallel.hpp>
#include <ctorch/zero_redundancy_optimizer.hpp>

#include <torch/torch.h>

#include <csignal>
#include <sys/stat.h>
#include <cstdio>
#include <fstream>
#include <unistd.h>

using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace {

std::string arg(const std::vector<std::string>& args, const std::string& name, const std::string& fallback) {
  for (size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--" + name) return args[i + 1];
  return fallback;
}
std::int64_t intArg(const std::vector<std::string>& args, const std::string& name, std::int64_t fallback) {
  return std::stoll(arg(args, name, std::to_string(fallback)));
}

std::string hexDouble(double v) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%a", v);
  return buffer;
}

}  // namespace

// A user's loop: their own model (dropout: randomness matters), SGD with momentum, LibTorch's StepLR,
// the distributed sampler, a tracked double and a tracked tensor. Flags:
//   --dir D --epochs N --stop-at S (rank 1 asks to stop before global step S) --crash-after S (every
//   rank exits 3 after step S once its snapshot is durable) --seeded 0|1 (stepSeed or gathered
//   generator states) --view 0|1 (gradientAsBucketView) --save-every K --lr X --overlap 0|1
//   (overlapAgreement, default on as in the library) --zero 0|1 (the optimizer sharded over the ranks:
//   ctorch::ZeroRedundancyOptimizer, which must end bit-identical to the whole optimizer) --fsdp 0|1
//   (the model sharded: ctorch::FullyShardedDataParallel in place of DDP, its root the only unit)
CTORCH_TEST_WORKER(user_loop) {
  const fs::path dir = arg(args, "dir", ".");
  const std::int64_t epochs = intArg(args, "epochs", 3);
  const std::int64_t stopAt = intArg(args, "stop-at", -1);
  const std::int64_t crashAfter = intArg(args, "crash-after", -1);
  const bool seeded = intArg(args, "seeded", 0) != 0;
  torch::set_num_threads(1);
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();

  torch::manual_seed(99);  // the data set: the same on every rank
  const auto inputs = torch::randn({96, 8});
  const auto targets = inputs.sum(1, true).sin();
  torch::manual_seed(7 + rank);  // each rank's own stream (dropout); DDP broadcasts rank 0's weights
  const auto hidden = intArg(args, "hidden", 32);  // another value: a model changed since its snapshot
  auto model = torch::nn::Sequential(torch::nn::Linear(8, hidden), torch::nn::ReLU(), torch::nn::Dropout(0.3),
                                     torch::nn::Linear(hidden, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  std::unique_ptr<ctorch::DistributedDataParallel<torch::nn::Sequential>> ddp;
  std::unique_ptr<ctorch::FullyShardedDataParallel<torch::nn::Sequential>> fsdp;
  if (intArg(args, "fsdp", 0) != 0)
    fsdp = std::make_unique<ctorch::FullyShardedDataParallel<torch::nn::Sequential>>(model);
  else
    ddp = std::make_unique<ctorch::DistributedDataParallel<torch::nn::Sequential>>(
        model, ctorch::DDPOptions().gradientAsBucketView(intArg(args, "view", 0) != 0).bucketCapMb(0.002).firstBucketCapMb(0.001));
  const auto sgd = torch::optim::SGDOptions(std::stod(arg(args, "lr", "0.05"))).momentum(0.9);
  torch::optim::SGD optimizer(fsdp ? fsdp->parameters() : ddp->parameters(), sgd);
  std::unique_ptr<ctorch::ZeroRedundancyOptimizer> zero;
  if (intArg(args, "zero", 0) != 0)
    zero = std::make_unique<ctorch::ZeroRedundancyOptimizer>(
        ddp->parameters(), [&](std::vector<at::Tensor> share) { return std::make_unique<torch::optim::SGD>(share, sgd); });
  torch::optim::Optimizer& stepping = zero ? *zero->localOptimizer() : optimizer;  // what the scheduler drives
  torch::optim::StepLR scheduler(stepping, /*step_size=*/1, /*gamma=*/0.7);
  ctorch::DistributedSamplerOptions so;
  so.datasetSize = 96;
  so.worldSize = world;
  so.rank = rank;
  so.seed = 5;
  ctorch::DistributedSampler sampler(so);
  double lossSum = 0;
  at::Tensor ema = torch::zeros({1});

  auto options = ctorch::ResilienceOptions()
                     .snapshotPath(dir / "snapshot.pt")
                     .saveEverySteps(intArg(args, "save-every", 0))
                     .config({{"lr", arg(args, "lr", "0.05")}})
                     .runName("user-mlp")
                     .allowConfigChange(intArg(args, "allow-change", 0) != 0)
                     .overlapAgreement(intArg(args, "overlap", 1) != 0)
                     .log([](const std::string& line) { std::cout << "log: " << line << std::endl; });
  if (seeded) options.stepSeed(11);
  ctorch::ResilientTraining training(options);
  if (fsdp) training.track(*fsdp);
  else training.track(*ddp);
  training.track(sampler).track(scheduler).track("loss_sum", lossSum).track("ema", ema);
  if (zero) training.track(*zero);
  else training.track(optimizer);
  if (intArg(args, "stop-at-start", 0) != 0 && rank == 1) ctorch::setStopSignal(SIGTERM);
  const ctorch::ResumePoint start = training.resume();
  std::cout << "start: epoch " << start.epoch << " step " << start.stepInEpoch << " global " << start.globalStep
            << (start.resumed ? " resumed" : " fresh") << std::endl;
  if (training.stopRequested() && intArg(args, "ignore-start-stop", 0) == 0) return training.exitCode();

  for (std::int64_t epoch = start.epoch; epoch < epochs; ++epoch) {
    sampler.setEpoch(epoch);
    while (!sampler.exhausted()) {
      if (rank == 1 && training.globalStep() + 1 == stopAt) ctorch::setStopSignal(SIGUSR1);
      const auto indices = torch::tensor(sampler.next(8));
      if (fsdp) fsdp->zeroGrad();
      else ddp->zeroGrad();
      const auto x = inputs.index_select(0, indices);
      auto loss = torch::mse_loss(fsdp ? (*fsdp)(x) : (*ddp)(x), targets.index_select(0, indices));
      loss.backward();
      if (zero) zero->step();
      else optimizer.step();
      {
        torch::NoGradGuard noGrad;
        ema.mul_(0.9).add_(loss.detach() * 0.1);
      }
      lossSum += loss.item<double>();  // tracked values change before stepDone(), which may save them
      if (training.stepDone()) return training.exitCode();
      if (training.globalStep() == crashAfter) {
        training.wait();
        ctorch::barrier();
        std::cout << "crashing after step " << crashAfter << std::endl;
        std::_Exit(3);  // as if killed: no destructor, no flush of anything else
      }
    }
    scheduler.step();
    if (training.epochDone()) return training.exitCode();
  }
  const int code = training.finish();
  std::vector<at::Tensor> state;
  if (fsdp)  // gathered (a collective), in the module's order
    for (const auto& item : fsdp->fullStateDict()) state.push_back(item.value());
  else
    for (const auto& p : model->parameters()) state.push_back(p.detach().clone());
  if (rank == 0) {
    state.push_back(ema.clone());
    torch::save(state, (dir / "final.pt").string());
    std::cout << "final: loss_sum " << hexDouble(lossSum) << " lr " << hexDouble(stepping.param_groups()[0].options().get_lr())
              << std::endl;
  }
  return code;
}

namespace {

struct Runs {
  TempDir dir{"ctorch-resilience"};
  int world = 2;
  std::vector<std::string> common;

  std::vector<ctorch::test::ProcessResult> run(const std::string& sub, std::vector<std::string> extra) {
    fs::create_directories(dir / sub);
    std::vector<std::string> args{"--dir", (dir / sub).string()};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    ctorch::test::WorkerGroupOptions o;
    o.worker = "user_loop";
    o.worldSize = world;
    o.args = args;
    o.env = {{"OMP_NUM_THREADS", "1"}};
    // The exits these tests ask for (a stop: 75; a crash: 3; a refusal: 1), each checked by the test:
    // a rank that ends so early must not cut short another still saving or refusing.
    o.expectedExitCodes = {1, 3, 75};
    return ctorch::test::runWorkerGroup(o);
  }
};

std::vector<at::Tensor> finalState(const fs::path& dir) {
  std::vector<at::Tensor> state;
  torch::load(state, (dir / "final.pt").string());
  return state;
}

// "" when equal to the bit, else which tensor differs and by how much.
std::string difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return "different tensor counts";
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i]))
      return "tensor " + std::to_string(i) + " differs by up to " + std::to_string((a[i] - b[i]).abs().max().item<double>());
  return "";
}

std::string finalLine(const ctorch::test::ProcessResult& r) {
  const auto at = r.output.find("final: ");
  return at == std::string::npos ? "" : r.output.substr(at, r.output.find('\n', at) - at);
}

void requireExit(const std::vector<ctorch::test::ProcessResult>& results, int code) {
  for (size_t r = 0; r < results.size(); ++r) {
    INFO("rank " << r << ": " << results[r].describe() << "\n" << results[r].output);
    REQUIRE(results[r].exitCode == code);
  }
}

}  // namespace

TEST_CASE("resilience: a user's loop stopped twice by a signal on one rank ends bit-identical (generator states gathered)",
          "[resilience]") {
  // Both ways of agreeing on the stop. Overlapped (the default): the flag of step N is read at step
  // N + 1, so a signal before step 4 stops after step 5, and one before the epoch's last step (12)
  // is read by epochDone(): the run stops at the end of epoch 2. At once (overlapAgreement(false)):
  // a signal before step 5 stops after step 5, one before step 12 after step 12, before epochDone().
  for (const bool overlap : {true, false}) {
    INFO((overlap ? "overlapped agreement" : "agreement at once"));
    Runs runs;
    runs.common = {"--overlap", overlap ? "1" : "0"};
    const auto reference = runs.run("reference", {});
    ctorch::test::requireAllOk(reference);

    const auto first = runs.run("stopped", {"--stop-at", overlap ? "4" : "5"});
    requireExit(first, 75);
    CHECK(first[0].output.find("log: stopped on request after 5 steps (global step 5)") != std::string::npos);
    CHECK(first[1].output.find("ctorch: rank 1/2 stopped after 5 steps (global step 5): User defined signal 1 here") !=
          std::string::npos);
    const auto second = runs.run("stopped", {"--stop-at", "12"});
    requireExit(second, 75);
    CHECK(second[0].output.find("start: epoch 0 step 5 global 5 resumed") != std::string::npos);
    CHECK(second[0].output.find(overlap ? "log: stopped on request after 2 epochs (global step 12)"
                                        : "log: stopped on request after 1 epoch + 6 steps (global step 12)") !=
          std::string::npos);
    const auto last = runs.run("stopped", {});
    ctorch::test::requireAllOk(last);
    CHECK(last[0].output.find(overlap ? "start: epoch 2 step 0 global 12 resumed" : "start: epoch 1 step 6 global 12 resumed") !=
          std::string::npos);

    CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "stopped")) == "");
    CHECK(finalLine(last[0]) == finalLine(reference[0]));  // the tracked double and the scheduler's lr
    CHECK_FALSE(finalLine(reference[0]).empty());

    // Control: the same stop, resumed with per-step seeding instead of the restored generator states,
    // differs (dropout draws other masks): the comparison bites, and the gathered states are what
    // keeps the resumed run identical.
    requireExit(runs.run("control", {"--stop-at", overlap ? "4" : "5"}), 75);
    ctorch::test::requireAllOk(runs.run("control", {"--seeded", "1"}));
    CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "control")) != "");
  }
}

TEST_CASE("resilience: 3 ranks, gradients as bucket views, crash after a durable step snapshot, end bit-identical",
          "[resilience]") {
  Runs runs;
  runs.world = 3;  // a world that is not a power of two: the bucket layout and the averaging must match
  runs.common = {"--view", "1", "--seeded", "1", "--save-every", "2"};
  const auto reference = runs.run("reference", {});
  ctorch::test::requireAllOk(reference);
  const auto crashed = runs.run("crashed", {"--crash-after", "7"});  // last snapshot: step 6
  for (const auto& r : crashed) {
    INFO(r.output);
    REQUIRE(r.exitCode == 3);
  }
  const auto resumed = runs.run("crashed", {});
  ctorch::test::requireAllOk(resumed);
  CHECK(resumed[0].output.find("start: epoch 1 step 2 global 6 resumed") != std::string::npos);
  CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "crashed")) == "");
  CHECK(finalLine(resumed[0]) == finalLine(reference[0]));
}

TEST_CASE("resilience: a damaged newest snapshot is named, set aside, and the one before it resumes bit-identically",
          "[resilience]") {
  Runs runs;
  runs.common = {"--save-every", "3"};
  const auto reference = runs.run("reference", {});
  ctorch::test::requireAllOk(reference);
  requireExit(runs.run("damaged", {"--stop-at", "8"}), 75);  // snapshots at steps 3, 6 and the stop at 8
  const fs::path newest = runs.dir / "damaged" / "snapshot.pt";
  fs::resize_file(newest, fs::file_size(newest) / 2);
  const auto resumed = runs.run("damaged", {});
  ctorch::test::requireAllOk(resumed);
  CHECK(resumed[0].output.find("skipped " + newest.string()) != std::string::npos);
  CHECK(resumed[0].output.find("start: epoch 1 step 0 global 6 resumed") != std::string::npos);
  CHECK(fs::exists(newest.string() + ".unusable"));
  CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "damaged")) == "");
}

TEST_CASE("resilience: another configuration is refused naming the difference, and a stop while starting up saves nothing",
          "[resilience]") {
  Runs runs;
  requireExit(runs.run("run", {"--stop-at", "1"}), 75);  // the agreement of step 1, read at step 2
  const auto refused = runs.run("run", {"--lr", "0.1"});
  for (const auto& r : refused) {
    CHECK(r.exitCode == 1);
    CHECK(r.output.find("lr") != std::string::npos);
    CHECK(r.output.find("0.05") != std::string::npos);
  }
  // A stop while starting up (rank 1, before resume() agrees): every rank ends at once, 75, and
  // the snapshot is left as it was.
  const auto before = ctorch::test::readFile(runs.dir / "run" / "snapshot.pt");
  const auto early = runs.run("run", {"--stop-at-start", "1"});
  requireExit(early, 75);
  CHECK(early[0].output.find("log: stopped on request before the first step; nothing new to save") != std::string::npos);
  CHECK(early[0].output.find("start: epoch 0 step 2 global 2 resumed") != std::string::npos);
  CHECK(ctorch::test::readFile(runs.dir / "run" / "snapshot.pt") == before);
  // A loop that does not look at stopRequested(): its first stepDone() says stop, nothing is saved.
  requireExit(runs.run("run", {"--stop-at-start", "1", "--ignore-start-stop", "1"}), 75);
  CHECK(ctorch::test::readFile(runs.dir / "run" / "snapshot.pt") == before);
}

TEST_CASE("resilience: a model changed since its snapshot is refused before anything says 'resuming', with the ways "
          "forward (issue 28.6)",
          "[resilience]") {
  Runs runs;
  requireExit(runs.run("run", {"--stop-at", "1"}), 75);
  const auto refused = runs.run("run", {"--hidden", "24"});
  for (const auto& r : refused) {
    INFO(r.output);
    CHECK(r.exitCode == 1);
    CHECK(r.output.find("does not fit this run") != std::string::npos);
    CHECK(r.output.find("[24, 8]") != std::string::npos);  // the difference, as before
    CHECK(r.output.find("resume(false) starts over") != std::string::npos);
    CHECK(r.output.find("resumeFrom(<file>)") != std::string::npos);
    // Before: "log: resume: resuming from ... exactly where it stopped", then the refusal.
    CHECK(r.output.find("exactly where it stopped") == std::string::npos);
    CHECK(r.output.find("log: resume: resuming") == std::string::npos);
  }
  // Control: the same model resumes, and says so.
  const auto resumed = runs.run("run", {});
  requireExit(resumed, 0);
  CHECK(resumed[0].output.find("log: resume: resuming from") != std::string::npos);
  CHECK(resumed[0].output.find("exactly where it stopped") != std::string::npos);
}

TEST_CASE("resilience: a crafted snapshot (sound file, digest recomputed) with wrong content is refused in one line",
          "[resilience]") {
  Runs runs;
  requireExit(runs.run("run", {"--stop-at", "4", "--overlap", "0"}), 75);
  const fs::path file = runs.dir / "run" / "snapshot.pt";
  const ctorch::Snapshot good = ctorch::loadSnapshot(file);
  auto craft = [&](const std::string& key, const c10::IValue& value) {
    ctorch::Snapshot s = ctorch::loadSnapshot(file.string() + ".orig");
    s.userState.insert_or_assign(key, value);
    ctorch::SnapshotSlotOptions slot;
    slot.path = file;
    slot.keepPrevious = 0;
    ctorch::saveSnapshot(s, slot);  // a new digest: the file is sound, its content is not this loop's
  };
  fs::copy_file(file, file.string() + ".orig");
  const std::vector<std::pair<std::string, std::string>> cases{
      {"loss_sum", "USER_STATE['loss_sum'] is not a number"},
      {"ema", "USER_STATE['ema'] is not a tensor"},
      {"ddp_buckets", "ddp_buckets is not a list"},
  };
  for (const auto& [key, words] : cases) {
    craft(key, c10::IValue(std::string("not what it should be")));
    const auto r = runs.run("run", {});
    for (const auto& rank : r) {
      INFO(key << ": " << rank.output);
      CHECK(rank.exitCode == 1);
      CHECK(rank.output.find(words) != std::string::npos);
      CHECK(rank.output.find("Exception raised from") == std::string::npos);  // one line, no backtrace
    }
  }
  // A bucket layout that is not a partition of the parameters.
  c10::impl::GenericList buckets(c10::ListType::create(c10::ListType::ofInts()));
  buckets.push_back(c10::List<int64_t>({0, 1, 99}));
  craft("ddp_buckets", buckets);
  for (const auto& rank : runs.run("run", {})) {
    INFO(rank.output);
    CHECK(rank.exitCode == 1);
    CHECK(rank.output.find("names parameter 99") != std::string::npos);
  }
  // The original file resumes and finishes.
  fs::copy_file(file.string() + ".orig", file, fs::copy_options::overwrite_existing);
  ctorch::test::requireAllOk(runs.run("run", {}));
  CHECK(good.globalStep == 4);
}

TEST_CASE("resilience: options and calls in the wrong order are refused with one line naming the value", "[resilience]") {
  CHECK_THROWS_WITH(ctorch::ResilientTraining(ctorch::ResilienceOptions().saveEverySteps(-1)),
                    Catch::Contains("saveEverySteps must be >= 0, got -1"));
  CHECK_THROWS_WITH(ctorch::ResilientTraining(ctorch::ResilienceOptions().keepPrevious(-2)),
                    Catch::Contains("keepPrevious must be between 0 and 100, got -2"));
  TempDir dir("ctorch-resilience-options");
  CHECK_THROWS_WITH(ctorch::ResilientTraining(ctorch::ResilienceOptions().snapshotPath(dir.path())),
                    Catch::Contains("is a directory"));
  const auto fifo = dir.path() / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(ctorch::ResilientTraining(ctorch::ResilienceOptions().snapshotPath(fifo)),
                    Catch::Equals("ResilienceOptions::snapshotPath '" + fifo.string() +
                                  "' is not a regular file (a FIFO, socket or device): name a file"));
  CHECK_THROWS_WITH(ctorch::ResilientTraining(ctorch::ResilienceOptions().runName("")),
                    Catch::Contains("runName is empty"));
}

// ---- capture buffers reused from save to save (ResilienceOptions::reuseCaptureBuffers) -----------------
// Saves after every step, keeping the previous 4; rank 0 records the weights it had at each step.
// --reuse 0|1. With CTORCH_TEST_SNAPSHOT_STALL_MS the writes are slow, so a save captures while the
// previous snapshot is still being written (its buffers must not be reused then).
CTORCH_TEST_WORKER(save_every_step) {
  const fs::path dir = arg(args, "dir", ".");
  torch::set_num_threads(1);
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  const int rank = ctorch::getRank();
  torch::manual_seed(3);
  auto model = torch::nn::Linear(64, 64);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  ctorch::ResilientTraining training(ctorch::ResilienceOptions()
                                         .snapshotPath(dir / "snapshot.pt")
                                         .saveEverySteps(1)
                                         .keepPrevious(4)
                                         .runName("pool")
                                         .reuseCaptureBuffers(intArg(args, "reuse", 1) != 0)
                                         .log([](const std::string&) {}));
  training.track(model).track(optimizer);
  training.resume();
  const auto x = torch::randn({16, 64});
  for (int step = 1; step <= 6; ++step) {
    optimizer.zero_grad();
    model(x).pow(2).mean().backward();
    optimizer.step();
    if (rank == 0)
      torch::save(std::vector<at::Tensor>{model->weight.detach().clone(), model->bias.detach().clone()},
                  (dir / ("step-" + std::to_string(step) + ".pt")).string());
    if (training.stepDone()) return training.exitCode();
  }
  return training.finish();
}

TEST_CASE("resilience: with capture buffers reused, every kept snapshot holds exactly its own step's weights, "
          "also when a save comes while the previous write is still running",
          "[resilience]") {
  const auto [reuse, stallMs] = GENERATE(std::make_pair(1, 0), std::make_pair(1, 150), std::make_pair(0, 150));
  CAPTURE(reuse, stallMs);
  TempDir dir("ctorch-capture-pool");
  ctorch::test::WorkerGroupOptions o;
  o.worker = "save_every_step";
  o.worldSize = 2;
  o.args = {"--dir", dir.path().string(), "--reuse", std::to_string(reuse)};
  o.env = {{"OMP_NUM_THREADS", "1"}};
  if (stallMs > 0) o.env["CTORCH_TEST_SNAPSHOT_STALL_MS"] = std::to_string(stallMs);
  requireExit(ctorch::test::runWorkerGroup(o), 0);
  // snapshot.pt is step 6 (finish() waits), .1 .. .4 the steps before it.
  for (int back = 0; back <= 4; ++back) {
    const fs::path file = back == 0 ? dir / "snapshot.pt" : dir / ("snapshot.pt." + std::to_string(back));
    INFO(file);
    REQUIRE(fs::exists(file));
    const ctorch::Snapshot s = ctorch::loadSnapshot(file);
    const std::int64_t step = 6 - back;
    CHECK(s.globalStep == step);
    std::vector<at::Tensor> expected;
    torch::load(expected, (dir / ("step-" + std::to_string(step) + ".pt")).string());
    CHECK(torch::equal(s.modelState.at("weight"), expected[0]));
    CHECK(torch::equal(s.modelState.at("bias"), expected[1]));
  }
}

TEST_CASE("resilience: recover() rethrows what is not a lost peer, and everything without in-place recovery",
          "[resilience]") {
  TempDir dir("ctorch-resilience-recover");
  ::signal(SIGPIPE, SIG_DFL);
  ctorch::initProcessGroup();  // a world of 1, no launcher: in-place recovery is not on offer
  {
    // A write to a dead peer's socket is an error to recover from, not this process's end.
    struct sigaction pipe {};
    REQUIRE(::sigaction(SIGPIPE, nullptr, &pipe) == 0);
    CHECK(pipe.sa_handler == SIG_IGN);
    auto model = torch::nn::Linear(4, 1);
    ctorch::ResilientTraining training(ctorch::ResilienceOptions()
                                           .snapshotPath(dir.path() / "snapshot.pt")
                                           .handleSignals(false)
                                           .log([](const std::string&) {}));
    training.track(model);
    CHECK_FALSE(training.canRecoverInPlace());
    training.resume();
    auto failWith = [&](auto error) {
      try {
        throw error;
      } catch (const std::exception&) {
        training.recover();
      }
    };
    // Rethrown as they were: the caller's handler sees the original type and text.
    CHECK_THROWS_MATCHES(failWith(std::runtime_error("Connection reset by peer")), std::runtime_error,
                         Catch::Message("Connection reset by peer"));
    CHECK_THROWS_AS(failWith(ctorch::DistributedError("rank 1 is gone")), ctorch::DistributedError);
    CHECK_THROWS_AS(failWith(ctorch::ConfigError("a bad option")), ctorch::ConfigError);
    CHECK_THROWS_WITH(training.recover(), Catch::Contains("while handling the exception"));
    CHECK(training.finish() == 0);
  }
  ctorch::destroyProcessGroup();
}

TEST_CASE("errors: one predicate says what is a lost peer, one helper gives a message without LibTorch's backtrace "
          "(issue 29.2)",
          "[resilience]") {
  CHECK(ctorch::isLostPeer(ctorch::DistributedError("rank 1: allReduce failed")));
  CHECK(ctorch::isLostPeer(ctorch::DistributedTimeout("rank 1: barrier timed out")));
  // Gloo's, NCCL's and the Reducer's own errors, as they reach a loop through autograd.
  const c10::Error gloo({"f", "file.cpp", 1}, "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:1234");
  CHECK(ctorch::isLostPeer(gloo));
  CHECK(ctorch::isLostPeer(c10::Error({"f", "file.cpp", 1}, "NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited")));
  CHECK(ctorch::isLostPeer(std::runtime_error("Timed out waiting 30000ms for send operation to complete")));
  // Not a lost peer: the library's own configuration, snapshot and disk errors, a shape error.
  CHECK_FALSE(ctorch::isLostPeer(ctorch::ConfigError("--lr 'x' is not a number (a peer said so)")));
  CHECK_FALSE(ctorch::isLostPeer(ctorch::WriteFailed("cannot write snapshot.pt: No space left on device")));
  CHECK_FALSE(ctorch::isLostPeer(c10::Error({"f", "file.cpp", 1}, "mat1 and mat2 shapes cannot be multiplied (4x3 and 4x2)")));
  CHECK_FALSE(ctorch::isLostPeer(std::runtime_error("std::bad_alloc")));
  // The message without the backtrace c10::Error's what() carries.
  CHECK(ctorch::errorMessage(gloo).find("Connection closed by peer") != std::string::npos);
  CHECK(ctorch::errorMessage(gloo).size() <= std::string(gloo.what()).size());  // never more than what()
  CHECK(ctorch::errorMessage(gloo).find("Exception raised from f") == std::string::npos);
  CHECK(ctorch::errorMessage(std::runtime_error("plain")) == "plain");
}

// ---- a sharded optimizer (ZeRO-1): each rank writes its own shard --------------------------------

TEST_CASE("resilience: ZeRO-1 stopped twice and resumed ends bit-identical to the whole optimizer, each rank wrote "
          "only its own shard",
          "[resilience][sharding]") {
  Runs runs;
  runs.common = {"--save-every", "3"};
  const auto reference = runs.run("reference", {});
  ctorch::test::requireAllOk(reference);
  requireExit(runs.run("zero", {"--zero", "1", "--stop-at", "5"}), 75);
  // Every rank's shard beside the slot, and the snapshot itself holds no optimizer state.
  for (int r = 0; r < 2; ++r) CHECK(fs::exists(runs.dir / "zero" / "snapshot.pt.shards" / ("rank" + std::to_string(r) + ".pt")));
  CHECK(ctorch::loadSnapshot(runs.dir / "zero" / "snapshot.pt").optimizerType.empty());
  CHECK(ctorch::loadSnapshot(runs.dir / "zero" / "snapshot.pt.shards" / "rank1.pt").optimizerType == "SGD");
  requireExit(runs.run("zero", {"--zero", "1", "--stop-at", "12"}), 75);
  const auto last = runs.run("zero", {"--zero", "1"});
  ctorch::test::requireAllOk(last);
  CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "zero")) == "");
  CHECK(finalLine(last[0]) == finalLine(reference[0]));  // the scheduler's lr on the local optimizer
  CHECK_FALSE(finalLine(reference[0]).empty());

  // Control: the same stop resumed with an unsharded optimizer (its state cannot be read from the
  // shards) is refused with the way forward, before anything is restored.
  requireExit(runs.run("control", {"--zero", "1", "--stop-at", "5"}), 75);
  const auto refused = runs.run("control", {});
  CHECK(refused[0].exitCode != 0);
  CHECK(refused[0].output.find("sharded over 2 ranks (saved with a ZeroRedundancyOptimizer): track one to resume it") !=
        std::string::npos);
}

TEST_CASE("resilience: FSDP stopped twice and resumed ends bit-identical to DDP, each rank wrote its own shards, "
          "which a DDP run refuses by name",
          "[resilience][sharding]") {
  Runs runs;
  runs.common = {"--save-every", "3"};
  const auto reference = runs.run("reference", {});
  ctorch::test::requireAllOk(reference);
  requireExit(runs.run("fsdp", {"--fsdp", "1", "--stop-at", "5"}), 75);
  // Every rank's shard beside the slot; the snapshot itself holds no parameters and no optimizer.
  for (int r = 0; r < 2; ++r) CHECK(fs::exists(runs.dir / "fsdp" / "snapshot.pt.shards" / ("rank" + std::to_string(r) + ".pt")));
  const auto snapshot = ctorch::loadSnapshot(runs.dir / "fsdp" / "snapshot.pt");
  CHECK(snapshot.optimizerType.empty());
  CHECK(snapshot.modelState.empty());
  requireExit(runs.run("fsdp", {"--fsdp", "1", "--stop-at", "12"}), 75);
  const auto last = runs.run("fsdp", {"--fsdp", "1"});
  ctorch::test::requireAllOk(last);
  CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "fsdp")) == "");
  CHECK(finalLine(last[0]) == finalLine(reference[0]));
  CHECK_FALSE(finalLine(reference[0]).empty());

  // Control: the same stop resumed with DDP (no whole model in the snapshot) is refused with the way
  // forward, before anything is restored.
  requireExit(runs.run("control", {"--fsdp", "1", "--stop-at", "5"}), 75);
  const auto refused = runs.run("control", {});
  CHECK(refused[0].exitCode != 0);
  CHECK(refused[0].output.find("its model is sharded over 2 ranks (saved with FullyShardedDataParallel): track one "
                               "to resume it") != std::string::npos);
}

TEST_CASE("resilience: FSDP shards saved on 2 ranks reshard onto 3 at the epoch boundary and train on as DDP does",
          "[resilience][sharding]") {
  // As the ZeRO case below; at 3 ranks FSDP's reduce-scatter and DDP's allreduce add the ranks'
  // gradients in different orders (tests/sharding: within 1e-5 over a few steps), so the two runs
  // are held to that bound, not to the bit.
  Runs runs;
  runs.common = {"--save-every", "3", "--seeded", "1"};
  for (const std::string fsdp : {"0", "1"}) {
    runs.world = 2;
    requireExit(runs.run("f" + fsdp, {"--fsdp", fsdp, "--stop-at", "9"}), 75);
    runs.world = 3;
    const auto resumed = runs.run("f" + fsdp, {"--fsdp", fsdp});
    ctorch::test::requireAllOk(resumed);
    CHECK(resumed[0].output.find("start: epoch 1 step 0 global 6 resumed") != std::string::npos);
  }
  const auto a = finalState(runs.dir / "f0"), b = finalState(runs.dir / "f1");
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) CHECK((a[i] - b[i]).abs().max().item<double>() <= 1e-5);
}

TEST_CASE("resilience: a ZeRO snapshot missing a rank's shard is named, set aside, and the one before resumes "
          "bit-identically",
          "[resilience][sharding]") {
  Runs runs;
  runs.common = {"--save-every", "3", "--zero", "1"};
  const auto reference = runs.run("reference", {});
  ctorch::test::requireAllOk(reference);
  requireExit(runs.run("lost", {"--stop-at", "8"}), 75);  // snapshots at steps 3, 6 and the stop at 8
  fs::remove(runs.dir / "lost" / "snapshot.pt.shards" / "rank1.pt");  // as if rank 1 died before its shard was durable
  const auto resumed = runs.run("lost", {});
  ctorch::test::requireAllOk(resumed);
  const std::string newest = (runs.dir / "lost" / "snapshot.pt").string();
  CHECK(resumed[0].output.find("skipped " + newest) != std::string::npos);
  CHECK(resumed[0].output.find("lacks rank 1's shard") != std::string::npos);
  CHECK(resumed[0].output.find("start: epoch 1 step 0 global 6 resumed") != std::string::npos);
  CHECK(fs::exists(newest + ".unusable"));
  CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "lost")) == "");
}

TEST_CASE("resilience: a shard of another save (another run's, copied in) is refused by name, its snapshot set aside "
          "(issue 42.2)",
          "[resilience][sharding]") {
  Runs runs;
  runs.common = {"--save-every", "3", "--zero", "1"};
  const auto reference = runs.run("reference", {});
  ctorch::test::requireAllOk(reference);
  // Two runs of the same configuration stopped at the same step: their shards match in everything
  // but the save they belong to.
  requireExit(runs.run("mine", {"--stop-at", "8"}), 75);
  requireExit(runs.run("other", {"--stop-at", "8"}), 75);
  const fs::path newest = runs.dir / "mine" / "snapshot.pt";
  const auto mine = ctorch::snapshotShardFiles(newest), theirs = ctorch::snapshotShardFiles(runs.dir / "other" / "snapshot.pt");
  REQUIRE(mine.size() == 2);
  REQUIRE(theirs.size() == 2);
  const auto saveOf = [](const fs::path& file) { return ctorch::loadSnapshot(file).header.saveId; };
  CHECK(saveOf(newest) == saveOf(mine[1]));
  CHECK(saveOf(newest) != saveOf(theirs[1]));
  CHECK(saveOf(newest).substr(saveOf(newest).find('-')) == "-" + std::to_string(ctorch::loadSnapshot(newest).globalStep));
  fs::copy_file(theirs[1], mine[1], fs::copy_options::overwrite_existing);
  const auto resumed = runs.run("mine", {});
  ctorch::test::requireAllOk(resumed);
  CHECK(resumed[0].output.find("skipped " + newest.string()) != std::string::npos);
  CHECK(resumed[0].output.find(mine[1].filename().string() + " belongs to save " + saveOf(theirs[1]) +
                               ", the snapshot to save " + saveOf(newest.string() + ".unusable")) != std::string::npos);
  CHECK(resumed[0].output.find("start: epoch 1 step 0 global 6 resumed") != std::string::npos);
  CHECK(fs::exists(newest.string() + ".unusable"));
  CHECK(difference(finalState(runs.dir / "reference"), finalState(runs.dir / "mine")) == "");
}

TEST_CASE("resilience: ZeRO-1 shards saved on 2 ranks reshard onto 3 at the epoch boundary, as the whole optimizer does",
          "[resilience][sharding]") {
  // A stop mid-epoch 2 on 2 ranks, resumed on 3: both runs go back to the end of epoch 1 (another
  // world size resumes at an epoch boundary) and train on with 3 ranks; the sharded one, resharded
  // from 2 shards to 3, must end where the whole optimizer's run ends.
  Runs runs;
  runs.common = {"--save-every", "3", "--seeded", "1"};
  for (const std::string zero : {"0", "1"}) {
    runs.world = 2;
    requireExit(runs.run("z" + zero, {"--zero", zero, "--stop-at", "9"}), 75);
    runs.world = 3;
    const auto resumed = runs.run("z" + zero, {"--zero", zero});
    ctorch::test::requireAllOk(resumed);
    CHECK(resumed[0].output.find("start: epoch 1 step 0 global 6 resumed") != std::string::npos);
  }
  CHECK(difference(finalState(runs.dir / "z0"), finalState(runs.dir / "z1")) == "");
}

// ---- a user's own Stateful (ctorch/stateful.hpp, issue 59.1) ----------------------------------------
// A strategy of the user's: every rank keeps a counter of its own (a sharded state: each rank writes
// its shard, and takes its own back), and an entry of its own in rank 0's snapshot. It records what
// the library asked of it, in order.
namespace {

class RankCounter final : public ctorch::Stateful {
 public:
  explicit RankCounter(int rank) : rank_(rank) {}
  at::Tensor count = torch::zeros({1}, torch::kFloat64);
  std::vector<std::string> calls;

  std::string stateName() const override { return "RankCounter"; }
  void saveEntries(ctorch::ItemDict& userState) const override { userState.insert("rank_counter_layout", std::int64_t{7}); }
  std::vector<std::string> entryNames() const override { return {"rank_counter_layout"}; }
  void checkEntries(const ctorch::Snapshot& snapshot) const override {
    if (snapshot.userState.contains("rank_counter_layout") && !snapshot.userState.at("rank_counter_layout").isInt())
      throw ctorch::SnapshotCorrupt(snapshot.source, ctorch::SnapshotCorrupt::Kind::BadContent, "rank_counter_layout is not an int");
  }
  bool sharded() const override { return true; }
  ctorch::ItemDict shardState(torch::optim::Optimizer*) const override {
    ctorch::ItemDict shard = ctorch::newItemDict();
    shard.insert("rank_counter", count.clone());
    shard.insert("rank_counter_rank", static_cast<std::int64_t>(rank_));
    return shard;
  }
  void prepareLoad(const ctorch::ItemDict* userState) override {
    calls.push_back(std::string("prepareLoad ") +
                    (userState && userState->contains("rank_counter_layout")
                         ? std::to_string(userState->at("rank_counter_layout").toInt())
                         : "none"));
  }
  void loadState(const ctorch::Snapshot&, const std::vector<ctorch::ItemDict>& shards, ctorch::StateLoad&) override {
    const auto& mine = shards.at(static_cast<std::size_t>(rank_));
    if (mine.at("rank_counter_rank").toInt() != rank_) throw std::runtime_error("another rank's shard");
    count = mine.at("rank_counter").toTensor().clone();
    calls.push_back("loadState of " + std::to_string(shards.size()) + " shards");
  }
  void stepEnded() override { ++steps_; }
  std::int64_t steps() const { return steps_; }

 private:
  int rank_;
  std::int64_t steps_ = 0;
};

} // namespace

// --dir D --steps N: trains N steps (a Linear with DDP and SGD), each adding (rank + 1) to the counter
// of its rank, saving every step; prints what the counter was asked and holds.
CTORCH_TEST_WORKER(own_stateful) {
  const fs::path dir = arg(args, "dir", ".");
  const std::int64_t steps = intArg(args, "steps", 2);
  torch::set_num_threads(1);
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  const int rank = ctorch::getRank();
  torch::manual_seed(5);
  ctorch::DistributedDataParallel<torch::nn::Linear> ddp(torch::nn::Linear(8, 2));
  torch::optim::SGD optimizer(ddp.module()->parameters(), torch::optim::SGDOptions(0.1));
  RankCounter counter(rank);
  ctorch::ResilientTraining training(
      ctorch::ResilienceOptions().snapshotPath(dir / "snapshot.pt").saveEverySteps(1).runName("own").log([](const std::string&) {}));
  training.track(ddp).track(optimizer).track(counter);
  const ctorch::ResumePoint start = training.resume();
  for (const auto& call : counter.calls) std::cout << "call " << call << "\n";
  std::cout << "resumed-at " << start.globalStep << " counter " << counter.count.item<double>() << "\n";
  for (std::int64_t step = start.globalStep; step < steps; ++step) {
    optimizer.zero_grad();
    ddp(torch::ones({4, 8})).sum().backward();
    optimizer.step();
    counter.count += rank + 1;
    if (training.stepDone()) return training.exitCode();
  }
  std::cout << "steps-ended " << counter.steps() << "\n";
  return training.finish();
}

TEST_CASE("resilience: a user's own sharded Stateful is saved by every rank beside the snapshot, its entry in rank 0's, "
          "and each rank gets its own shard back on resume (issue 59.1)",
          "[resilience]") {
  TempDir dir("ctorch-own-stateful");
  ctorch::test::WorkerGroupOptions o;
  o.worker = "own_stateful";
  o.worldSize = 2;
  o.args = {"--dir", dir.path().string(), "--steps", "3"};
  auto first = ctorch::test::runWorkerGroup(o);
  requireExit(first, 0);
  for (int r = 0; r < 2; ++r) {
    INFO(first[static_cast<std::size_t>(r)].output);
    CHECK(first[static_cast<std::size_t>(r)].output.find("call prepareLoad none") != std::string::npos);
    CHECK(first[static_cast<std::size_t>(r)].output.find("steps-ended 3") != std::string::npos);
  }
  // Rank 0's snapshot carries the object's entry and says it is sharded over 2 ranks; each rank's
  // shard file holds its own counter.
  const ctorch::Snapshot snap = ctorch::loadSnapshot(dir / "snapshot.pt");
  CHECK(snap.globalStep == 3);
  REQUIRE(snap.userState.contains("rank_counter_layout"));
  CHECK(snap.userState.at("rank_counter_layout").toInt() == 7);
  CHECK(snap.userState.at("zero_shards").toInt() == 2);
  const auto shards = ctorch::findSnapshotShards(snap);
  REQUIRE(shards.size() == 2);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(shards[static_cast<std::size_t>(r)].usable);
    const ctorch::Snapshot shard = ctorch::loadSnapshot(shards[static_cast<std::size_t>(r)].file);
    CHECK(shard.userState.at("rank_counter").toTensor().item<double>() == 3.0 * (r + 1));
  }
  // The next run resumes every rank's own counter, after the object saw the snapshot's entry.
  o.args = {"--dir", dir.path().string(), "--steps", "5"};
  auto second = ctorch::test::runWorkerGroup(o);
  requireExit(second, 0);
  for (int r = 0; r < 2; ++r) {
    const std::string& out = second[static_cast<std::size_t>(r)].output;
    INFO(out);
    const auto prepared = out.find("call prepareLoad 7"), loaded = out.find("call loadState of 2 shards");
    CHECK(prepared != std::string::npos);
    CHECK(loaded != std::string::npos);
    CHECK(prepared < loaded);
    std::ostringstream expect;
    expect << "resumed-at 3 counter " << 3.0 * (r + 1) << "\n";
    CHECK(out.find(expect.str()) != std::string::npos);
    CHECK(out.find("steps-ended 2") != std::string::npos);
  }
}
