// The training loop driven in-process (runTraining) by real worker processes: 1 and 2 ranks on
// synthetic data, data-parallel equivalence, gradient accumulation, the preemption path through
// the stop flag, and distributed evaluation against a single-process evaluation.
#include "trainer_test_util.hpp"

#include <ctorch/resilience.hpp>

#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/data/registry.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/sampler.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/train/evaluate.hpp>
#include <ctorch/train/options.hpp>
#include <ctorch/stop_signal.hpp>
#include <ctorch/train/trainer.hpp>

#include <nlohmann/json.hpp>

#include <csignal>
#include <sstream>

using namespace traintest;
using ctorch::test::requireAllOk;
using ctorch::test::runWorkerGroup;
using ctorch::test::TempDir;
using ctorch::test::WorkerGroupOptions;

namespace {

// train <dir> <key=value>...: ctorch-train's options from `--key value` pairs, output to <dir>.
ctorch::train::TrainOptions optionsFrom(const std::vector<std::string>& args) {
  std::vector<std::string> flags;
  for (size_t i = 1; i < args.size(); ++i) {
    const auto eq = args[i].find('=');
    flags.push_back("--" + args[i].substr(0, eq));
    if (eq != std::string::npos) flags.push_back(args[i].substr(eq + 1));
  }
  auto parsed = ctorch::train::parseCommandLine(flags);
  if (!parsed.options) throw std::runtime_error(parsed.message);
  auto o = *parsed.options;
  const fs::path dir = args.at(0);
  o.modelDir = dir;
  o.snapshotPath = dir / "snapshot.pt";
  o.progress = ctorch::train::ProgressMode::kLines;
  return o;
}

}  // namespace

// train <dir> [stop_at=N | stop_after=N] options...: runs the loop; rank 1 gets a stop request during
// global step N, or after step N was agreed on (0: while starting up). Prints "result status=S
// global=G ..." on every rank.
CTORCH_TEST_WORKER(train) {
  std::vector<std::string> rest;
  std::int64_t stopAt = -1, stopAfter = -1;
  for (const auto& a : args)
    if (a.rfind("stop_at=", 0) == 0)
      stopAt = std::stoll(a.substr(8));
    else if (a.rfind("stop_after=", 0) == 0)
      stopAfter = std::stoll(a.substr(11));
    else
      rest.push_back(a);
  const bool rank1 = std::getenv("RANK") && std::string(std::getenv("RANK")) == "1";
  if (stopAfter == 0 && rank1) ctorch::setStopSignal(SIGUSR1);  // while starting up
  const auto options = optionsFrom(rest);
  ctorch::train::RunHooks hooks;
  std::ostringstream quiet;
  hooks.out = &std::cout;
  // Rank 1 alone "receives" the signal during step stopAt: every rank must still stop after it.
  hooks.beforeStep = [&](std::int64_t done) {
    if (stopAt >= 0 && done + 1 == stopAt && rank1) ctorch::setStopSignal(SIGUSR1);
  };
  // ... or after step stopAfter was agreed on (at an epoch's end: during its evaluation).
  hooks.afterStep = [&](std::int64_t done) {
    if (stopAfter > 0 && done == stopAfter && rank1) ctorch::setStopSignal(SIGUSR1);
  };
  const auto result = ctorch::train::runTraining(options, hooks);
  std::cout << "result status=" << static_cast<int>(result.status) << " global=" << result.globalStep
            << " epochs=" << result.epochsRun;
  if (result.lastEval) std::cout << " eval_count=" << result.lastEval->count << " eval_loss=" << result.lastEval->loss();
  std::cout << std::endl;
  return result.exitCode();
}

TEST_CASE("loop: the toy model trains on 1 rank and on 2 ranks to the same parameters", "[trainer][loop]") {
  // 2 ranks x batch 8 see, step for step, the same 16 samples as 1 rank x batch 16 (the
  // DistributedSampler deals rank r every W-th index of one permutation); DDP averages the two
  // rank means, which is the mean over the 16. Tolerance 1e-6: float sums in another order.
  TempDir one("train-one"), two("train-two");
  const std::vector<std::string> common = {"model=linear", "dataset=synthetic-regression", "synthetic-size=512",
                                           "epochs=2", "lr=0.05", "log-interval=8", "test-limit=128"};
  auto args1 = std::vector<std::string>{one.path().string(), "batch-size=16"};
  auto args2 = std::vector<std::string>{two.path().string(), "batch-size=8"};
  args1.insert(args1.end(), common.begin(), common.end());
  args2.insert(args2.end(), common.begin(), common.end());
  WorkerGroupOptions g1{"train", 1, args1};
  WorkerGroupOptions g2{"train", 2, args2};
  const auto r1 = runWorkerGroup(g1);
  requireAllOk(r1);
  const auto r2 = runWorkerGroup(g2);
  requireAllOk(r2);
  CHECK(r1[0].output.find("global=64") != std::string::npos);  // 512 / 16 = 32 steps per epoch
  CHECK(r2[1].output.find("global=64") != std::string::npos);

  const auto a = loadWeights(one / "model.pt"), b = loadWeights(two / "model.pt");
  REQUIRE(a.size() == 2);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK((a[i].second - b[i].second).abs().max().item<double>() < 1e-6);
  }
  // It learned: the test loss after training is below that of the untrained model (1 step of lr ~0).
  const std::regex loss(R"(eval_loss=([0-9.e+-]+))");
  std::smatch m;
  REQUIRE(std::regex_search(r1[0].output, m, loss));
  const double trained = std::stod(m[1]);
  TempDir untrained("train-zero");
  const auto r0 = runWorkerGroup({"train", 1, {untrained.path().string(), "model=linear",
                                               "dataset=synthetic-regression", "synthetic-size=16", "epochs=1",
                                               "batch-size=16", "lr=1e-9", "test-limit=128"}});
  requireAllOk(r0);
  REQUIRE(std::regex_search(r0[0].output, m, loss));
  CHECK(trained < 0.5 * std::stod(m[1]));
  // The metrics file has train, epoch and eval records.
  const std::string metrics = ctorch::test::readFile(one / "metrics.jsonl");
  CHECK(countMatches(metrics, std::regex(R"("kind":"train")")) == 8);
  CHECK(countMatches(metrics, std::regex(R"("kind":"epoch")")) == 2);
  CHECK(countMatches(metrics, std::regex(R"("kind":"eval")")) == 2);
  // Epoch records say where the steps' time went; the phases fit in the epoch's wall time.
  std::istringstream lines(metrics);
  int epochs = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] != "epoch") continue;
    ++epochs;
    double sum = 0;
    for (const char* phase : {"data", "forward_backward", "optimizer", "agreement"}) {
      const double v = j["phase_seconds"][phase].get<double>();
      CHECK(v >= 0.0);
      sum += v;
    }
    CHECK(j["phase_seconds"]["forward_backward"].get<double>() > 0.0);
    CHECK(sum <= j["seconds"].get<double>() + 1e-3);
  }
  CHECK(epochs == 2);
  CHECK(r1[0].output.find("(rank 0's time: data ") != std::string::npos);
}

TEST_CASE("loop: AdamW, RMSprop, Adagrad and --clip-grad-norm train, differ from SGD, and resume bit-identically "
          "(issue 28.8)",
          "[trainer][loop]") {
  const std::vector<std::string> common = {"model=linear", "dataset=synthetic-regression", "synthetic-size=256",
                                           "epochs=2", "batch-size=16", "lr=0.05", "log-interval=8",
                                           "test-limit=64", "save-every-steps=4"};
  auto run = [&](const fs::path& dir, std::vector<std::string> extra) {
    std::vector<std::string> args{dir.string()};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = runWorkerGroup({"train", 1, args});
    requireAllOk(r);
    return r[0].output;
  };
  auto maxDiff = [](const fs::path& a, const fs::path& b) {
    const auto x = loadWeights(a / "model.pt"), y = loadWeights(b / "model.pt");
    double d = 0;
    for (size_t i = 0; i < x.size(); ++i) d = std::max(d, (x[i].second - y[i].second).abs().max().item<double>());
    return d;
  };
  TempDir sgd("train-opt-sgd");
  run(sgd.path(), {});
  for (const std::vector<std::string>& extra : std::vector<std::vector<std::string>>{
           {"optimizer=adamw"}, {"optimizer=rmsprop", "lr=0.005"}, {"optimizer=adagrad"},
           {"optimizer=adamw", "clip-grad-norm=0.05"}, {"clip-grad-norm=0.05"}}) {
    std::string name;
    for (const auto& e : extra) name += e + " ";
    INFO(name);
    TempDir whole("train-opt"), resumed("train-opt-resumed");
    const std::string out = run(whole.path(), extra);
    auto stopped = extra;
    stopped.push_back("max-steps=10");  // mid-epoch 1 (16 steps per epoch), then resumed
    run(resumed.path(), stopped);
    const std::string again = run(resumed.path(), extra);
    CHECK(again.find("exactly where it stopped") != std::string::npos);
    CHECK(maxDiff(whole.path(), resumed.path()) == 0.0);  // the optimizer's state came back exactly
    CHECK(maxDiff(whole.path(), sgd.path()) > 1e-4);      // and it is not SGD's
  }
  // A bound the gradients never reach changes nothing, to the bit; a tight one changes the result.
  TempDir loose("train-clip-loose");
  run(loose.path(), {"clip-grad-norm=1e9"});
  CHECK(maxDiff(loose.path(), sgd.path()) == 0.0);
}

TEST_CASE("loop: --sharding optimizer (ZeRO-1) on 2 ranks ends bit-identical to --sharding none, also stopped and "
          "resumed, and a DDP snapshot resumes sharded",
          "[trainer][loop][sharding]") {
  const std::vector<std::string> common = {"model=linear", "dataset=synthetic-regression", "synthetic-size=256",
                                           "epochs=2", "batch-size=8", "lr=0.05", "log-interval=8",
                                           "test-limit=64", "save-every-steps=4", "optimizer=adam",
                                           "clip-grad-norm=0.5"};
  auto run = [&](const fs::path& dir, std::vector<std::string> extra) {
    std::vector<std::string> args{dir.string()};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = runWorkerGroup({"train", 2, args});
    requireAllOk(r);
    return r[0].output;
  };
  auto same = [](const fs::path& a, const fs::path& b) {
    const auto x = loadWeights(a / "model.pt"), y = loadWeights(b / "model.pt");
    if (x.size() != y.size() || x.empty()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (!torch::equal(x[i].second, y[i].second)) return false;
    return true;
  };
  TempDir ddp("train-shard-none"), zero("train-shard-zero"), stopped("train-shard-stopped"), switched("train-shard-switch");
  run(ddp.path(), {"sharding=none"});
  const std::string out = run(zero.path(), {"sharding=optimizer", "checkpoint-every=1", "keep-checkpoints=1"});
  CHECK(out.find("optimizer state sharded over the ranks (ZeRO-1)") != std::string::npos);
  CHECK(same(ddp.path(), zero.path()));
  for (int r = 0; r < 2; ++r) CHECK(fs::exists(zero.path() / "snapshot.pt.shards" / ("rank" + std::to_string(r) + ".pt")));
  // A pruned checkpoint takes its shards along; the kept one has every rank's.
  CHECK(ctorch::snapshotShardFiles(zero.path() / "checkpoint_epoch_2.pt") ==
        std::vector<fs::path>{zero.path() / "checkpoint_epoch_2.pt.shards" / "rank0.pt",
                              zero.path() / "checkpoint_epoch_2.pt.shards" / "rank1.pt"});
  CHECK_FALSE(fs::exists(zero.path() / "checkpoint_epoch_1.pt"));
  CHECK(ctorch::snapshotShardFiles(zero.path() / "checkpoint_epoch_1.pt").empty());
  CHECK_FALSE(fs::exists(zero.path() / "checkpoint_epoch_1.pt.shards"));  // removed with its last shard

  run(stopped.path(), {"sharding=optimizer", "max-steps=10"});  // mid-epoch 1 (16 steps per epoch)
  CHECK(run(stopped.path(), {"sharding=optimizer"}).find("exactly where it stopped") != std::string::npos);
  CHECK(same(ddp.path(), stopped.path()));

  run(switched.path(), {"sharding=none", "max-steps=10"});  // the whole optimizer's snapshot ...
  run(switched.path(), {"sharding=optimizer"});              // ... read as one shard
  CHECK(same(ddp.path(), switched.path()));

  // Control: another learning rate's run differs, so `same` can fail.
  TempDir other("train-shard-other");
  run(other.path(), {"sharding=optimizer", "lr=0.04"});
  CHECK_FALSE(same(ddp.path(), other.path()));
}

TEST_CASE("loop: --sharding full and grad-op (FSDP) on 2 ranks end bit-identical to --sharding none, also stopped and "
          "resumed and with gradient accumulation, and model.pt holds the whole model",
          "[trainer][loop][sharding]") {
  // simple-cnn: five units (its convolutions and Linears, called through ctorch::unitForward).
  const std::vector<std::string> common = {"model=simple-cnn", "dataset=synthetic-images", "synthetic-shape=3,16,16",
                                           "synthetic-size=128", "epochs=2", "batch-size=4", "log-interval=8",
                                           "test-limit=32", "save-every-steps=4", "optimizer=adam", "lr=0.01",
                                           "grad-accum-steps=2"};
  auto run = [&](const fs::path& dir, std::vector<std::string> extra) {
    std::vector<std::string> args{dir.string()};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = runWorkerGroup({"train", 2, args});
    requireAllOk(r);
    return r[0].output;
  };
  auto same = [](const fs::path& a, const fs::path& b) {
    const auto x = loadWeights(a / "model.pt"), y = loadWeights(b / "model.pt");
    if (x.size() != y.size() || x.empty()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (x[i].first != y[i].first || !torch::equal(x[i].second, y[i].second)) return false;
    return true;
  };
  TempDir ddp("train-fsdp-none"), full("train-fsdp-full"), gradOp("train-fsdp-gradop"), stopped("train-fsdp-stopped");
  run(ddp.path(), {"sharding=none"});
  const std::string out = run(full.path(), {"sharding=full"});
  CHECK(out.find("parameters, gradients and optimizer state sharded over the ranks (FSDP FULL_SHARD)") != std::string::npos);
  CHECK(out.find("reduce-scatter into 5 flat shards") != std::string::npos);
  CHECK(same(ddp.path(), full.path()));
  for (int r = 0; r < 2; ++r) CHECK(fs::exists(full.path() / "snapshot.pt.shards" / ("rank" + std::to_string(r) + ".pt")));
  run(gradOp.path(), {"sharding=grad-op"});
  CHECK(same(ddp.path(), gradOp.path()));

  run(stopped.path(), {"sharding=full", "max-steps=5"});  // mid-epoch 1 (8 steps per epoch)
  CHECK(run(stopped.path(), {"sharding=full"}).find("exactly where it stopped") != std::string::npos);
  CHECK(same(ddp.path(), stopped.path()));

  // Control: another learning rate's run differs, so `same` can fail.
  TempDir other("train-fsdp-other");
  run(other.path(), {"sharding=full", "lr=0.008"});
  CHECK_FALSE(same(ddp.path(), other.path()));
}

TEST_CASE("loop: --sharding full with --fsdp-param-dtype bf16 trains on 2 ranks, stopped and resumed bit-identically, "
          "model.pt in float32, and a resume under another precision is refused",
          "[trainer][loop][sharding][mixed-precision]") {
  const std::vector<std::string> common = {"model=linear", "dataset=synthetic-regression", "synthetic-size=128", "epochs=2",
                                           "batch-size=4", "log-interval=8", "test-limit=32", "save-every-steps=4",
                                           "optimizer=adam", "lr=0.01", "sharding=full"};
  auto run = [&](const fs::path& dir, std::vector<std::string> extra) {
    std::vector<std::string> args{dir.string()};
    args.insert(args.end(), common.begin(), common.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return runWorkerGroup({"train", 2, args});
  };
  auto weights = [](const fs::path& dir) { return loadWeights(dir / "model.pt"); };
  TempDir plain("train-mp-plain"), mixed("train-mp-mixed"), stopped("train-mp-stopped");
  const std::vector<std::string> bf16 = {"fsdp-param-dtype=bf16", "fsdp-reduce-dtype=fp32"};
  requireAllOk(run(plain.path(), {}));
  const auto out = run(mixed.path(), bf16);
  requireAllOk(out);
  CHECK(out[0].output.find("gathered in bfloat16 and reduced in float32") != std::string::npos);
  const auto a = weights(plain.path()), b = weights(mixed.path());
  REQUIRE(a.size() == b.size());
  REQUIRE_FALSE(b.empty());
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(b[i].second.scalar_type() == torch::kFloat);
    differs = differs || !torch::equal(a[i].second, b[i].second);
  }
  CHECK(differs);  // bf16 compute does change the trajectory

  auto stop = run(stopped.path(), {"fsdp-param-dtype=bf16", "fsdp-reduce-dtype=fp32", "max-steps=5"});
  requireAllOk(stop);
  const auto refused = run(stopped.path(), {});  // resumed without the policy: another configuration
  for (const auto& r : refused) {
    INFO(r.output);
    CHECK(r.exitCode != 0);
    CHECK(r.output.find("config 'fsdp_param_dtype' is only in the snapshot ('bfloat16')") != std::string::npos);
  }
  const auto resumed = run(stopped.path(), bf16);
  requireAllOk(resumed);
  CHECK(resumed[0].output.find("exactly where it stopped") != std::string::npos);
  const auto c = weights(stopped.path());
  REQUIRE(c.size() == b.size());
  for (size_t i = 0; i < b.size(); ++i) CHECK(torch::equal(b[i].second, c[i].second));
}

namespace {

// --sharding hybrid's runs: simple-cnn as in the FSDP test above; `perNode` processes per "node" on
// this host (the torchrun environment of nodes numbered node by node: LOCAL_RANK, LOCAL_WORLD_SIZE,
// GROUP_RANK), empty for one node.
const std::vector<std::string> kHybridCommon = {"model=simple-cnn", "dataset=synthetic-images", "synthetic-shape=3,16,16",
                                                "synthetic-size=128", "epochs=2", "batch-size=4", "log-interval=8",
                                                "test-limit=32", "save-every-steps=4", "optimizer=adam", "lr=0.01",
                                                "grad-accum-steps=2"};

std::string hybridRun(const fs::path& dir, int world, int perNode, std::vector<std::string> extra) {
  std::vector<std::string> args{dir.string()};
  args.insert(args.end(), kHybridCommon.begin(), kHybridCommon.end());
  args.insert(args.end(), extra.begin(), extra.end());
  WorkerGroupOptions options{.worker = "train", .worldSize = world, .args = args};
  if (perNode > 0)
    for (int rank = 0; rank < world; ++rank)
      options.rankEnv[rank] = {{"LOCAL_RANK", std::to_string(rank % perNode)},
                               {"LOCAL_WORLD_SIZE", std::to_string(perNode)},
                               {"GROUP_RANK", std::to_string(rank / perNode)}};
  const auto r = runWorkerGroup(options);
  requireAllOk(r);
  return r[0].output;
}

// The largest difference between two runs' model.pt (infinity when they hold other names).
double modelDifference(const fs::path& a, const fs::path& b) {
  const auto x = loadWeights(a / "model.pt"), y = loadWeights(b / "model.pt");
  if (x.size() != y.size() || x.empty()) return std::numeric_limits<double>::infinity();
  double d = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i].first != y[i].first) return std::numeric_limits<double>::infinity();
    d = std::max(d, (x[i].second - y[i].second).abs().max().item<double>());
  }
  return d;
}

}  // namespace

TEST_CASE("loop: --sharding hybrid on 4 ranks as 2 nodes of 2 ends within the 4-rank bound of none, and stopped and "
          "resumed bit-identical to itself",
          "[trainer][loop][sharding][hybrid]") {
  // The node's reduce-scatter and the 2-node allreduce add the 4 ranks' gradients as (x0 + x1) + (x2 + x3),
  // DDP's Gloo allreduce in its ring's order: the last bits of an averaged gradient may differ (as in
  // tests/sharding's hybrid test, < 5e-7 after 4 Adam steps there). 16 Adam steps (lr 0.01) carry such
  // differences along without growing them by much: 1e-4 bounds model.pt's; another learning rate
  // (the control) moves it by > 1e-3.
  TempDir ddp("train-hybrid-none"), hybrid("train-hybrid"), stopped("train-hybrid-stopped"), other("train-hybrid-other");
  hybridRun(ddp.path(), 4, 2, {"sharding=none"});
  const std::string out = hybridRun(hybrid.path(), 4, 2, {"sharding=hybrid"});
  CHECK(out.find("sharded over each node's ranks, replicated across nodes (FSDP HYBRID_SHARD)") != std::string::npos);
  CHECK(out.find("units over each node's 2 ranks, then an allreduce of the shards across 2 nodes") != std::string::npos);
  for (int r = 0; r < 4; ++r) CHECK(fs::exists(hybrid.path() / "snapshot.pt.shards" / ("rank" + std::to_string(r) + ".pt")));
  const double d = modelDifference(ddp.path(), hybrid.path());
  INFO("hybrid against none: " << d);
  CHECK(d <= 1e-4);

  hybridRun(stopped.path(), 4, 2, {"sharding=hybrid", "max-steps=5"});  // mid-epoch 1
  CHECK(hybridRun(stopped.path(), 4, 2, {"sharding=hybrid"}).find("exactly where it stopped") != std::string::npos);
  CHECK(modelDifference(hybrid.path(), stopped.path()) == 0.0);

  hybridRun(other.path(), 4, 2, {"sharding=hybrid", "lr=0.008"});
  CHECK(modelDifference(ddp.path(), other.path()) > 1e-3);
}

TEST_CASE("loop: a --sharding hybrid snapshot of 2 nodes of 2 resumes with --sharding full on 4 ranks",
          "[trainer][loop][sharding][hybrid]") {
  // The resumed run's first steps hold the hybrid run's state exactly; from then on FSDP over 4 ranks
  // sums in its own order: held to the bound of the test above against the uninterrupted hybrid run.
  TempDir hybrid("train-hybrid-whole"), moved("train-hybrid-moved");
  hybridRun(hybrid.path(), 4, 2, {"sharding=hybrid-grad-op"});
  hybridRun(moved.path(), 4, 2, {"sharding=hybrid-grad-op", "max-steps=5"});
  const std::string out = hybridRun(moved.path(), 4, 0, {"sharding=full"});
  CHECK(out.find("exactly where it stopped") != std::string::npos);  // the same world size
  const double d = modelDifference(hybrid.path(), moved.path());
  INFO("resumed with full against hybrid-grad-op throughout: " << d);
  CHECK(d <= 1e-4);
}

TEST_CASE("loop: --sharding hybrid on 2 nodes of 1 rank, and hybrid-grad-op on one node, end bit-identical to none",
          "[trainer][loop][sharding][hybrid]") {
  TempDir ddp("train-hybrid2-none"), nodes("train-hybrid2-nodes"), one("train-hybrid2-one");
  hybridRun(ddp.path(), 2, 0, {"sharding=none"});
  hybridRun(nodes.path(), 2, 1, {"sharding=hybrid"});
  CHECK(modelDifference(ddp.path(), nodes.path()) == 0.0);
  const std::string out = hybridRun(one.path(), 2, 0, {"sharding=hybrid-grad-op"});
  CHECK(out.find("--sharding hybrid-grad-op on one node of 2 ranks: sharded over them as --sharding grad-op") != std::string::npos);
  CHECK(modelDifference(ddp.path(), one.path()) == 0.0);
}

TEST_CASE("loop: gradient accumulation over micro-batches equals one batch of their size", "[trainer][loop]") {
  // 2 ranks x (2 micro-batches of 4, allreduce on the second only) against 2 ranks x 8.
  TempDir accum("train-accum"), plain("train-plain");
  const std::vector<std::string> common = {"model=linear", "dataset=synthetic-regression", "synthetic-size=256",
                                           "epochs=1", "lr=0.05", "test-limit=64", "momentum=0.5"};
  auto a = std::vector<std::string>{accum.path().string(), "batch-size=4", "grad-accum-steps=2"};
  auto b = std::vector<std::string>{plain.path().string(), "batch-size=8"};
  a.insert(a.end(), common.begin(), common.end());
  b.insert(b.end(), common.begin(), common.end());
  const auto ra = runWorkerGroup({"train", 2, a});
  requireAllOk(ra);
  const auto rb = runWorkerGroup({"train", 2, b});
  requireAllOk(rb);
  CHECK(ra[0].output.find("global=16") != std::string::npos);  // 256 / (2 x 8)
  const auto x = loadWeights(accum / "model.pt"), y = loadWeights(plain / "model.pt");
  for (size_t i = 0; i < x.size(); ++i) {
    INFO(x[i].first);
    CHECK((x[i].second - y[i].second).abs().max().item<double>() < 1e-6);
  }
}

TEST_CASE("loop: a stop request on one rank stops every rank after the same step", "[trainer][loop][signals]") {
  // Rank 1 asks before step 5. Step 5 does not log (every 10 steps): its agreement is read at step 6,
  // and every rank stops after step 6.
  TempDir dir("train-stop");
  const auto r = runWorkerGroup({"train", 2, {dir.path().string(), "stop_at=5", "model=linear",
                                              "dataset=synthetic-regression", "synthetic-size=512",
                                              "batch-size=8", "epochs=3", "test-limit=64"}});
  for (int rank = 0; rank < 2; ++rank) {
    INFO("rank " << rank << ": " << show(r[rank]));
    CHECK(r[rank].exitCode == ctorch::contract::kExitPreempted);
    CHECK(r[rank].output.find("result status=1 global=6 ") != std::string::npos);
  }
  CHECK(r[0].output.find("stopped on request after 6 steps (global step 6)") != std::string::npos);
  CHECK(r[1].output.find("rank 1/2 stopped after 6 steps (global step 6): User defined signal 1 here") !=
        std::string::npos);
  CHECK(r[0].output.find("a stop signal on another rank") != std::string::npos);
  const auto snap = ctorch::loadSnapshot(dir / "snapshot.pt");
  CHECK(snap.globalStep == 6);
  CHECK(snap.stepInEpoch == 6);
  CHECK(snap.epochsRun == 0);
  REQUIRE(snap.sampler);
  CHECK(snap.sampler->consumed == 48);
  CHECK_FALSE(fs::exists(dir / "model.pt"));  // not finished: no final weights

  // Resumed, it finishes where an uninterrupted run finishes, bit for bit.
  const auto resumed = runWorkerGroup({"train", 2, {dir.path().string(), "model=linear",
                                                    "dataset=synthetic-regression", "synthetic-size=512",
                                                    "batch-size=8", "epochs=3", "test-limit=64"}});
  requireAllOk(resumed);
  CHECK(resumed[0].output.find("resuming from " + (dir / "snapshot.pt").string() +
                               " after 6 steps (global step 6), exactly where it stopped") != std::string::npos);
  TempDir reference("train-stop-ref");
  const auto uninterrupted = runWorkerGroup({"train", 2, {reference.path().string(), "model=linear",
                                                          "dataset=synthetic-regression", "synthetic-size=512",
                                                          "batch-size=8", "epochs=3", "test-limit=64"}});
  requireAllOk(uninterrupted);
  CHECK(bitDifference(dir / "model.pt", reference / "model.pt").empty());
}

TEST_CASE("loop: a stop request while starting up, or during an epoch's evaluation, stops at that point",
          "[trainer][loop][signals]") {
  TempDir dir("train-stop-points"), reference("train-stop-points-ref");
  // 512 samples, 2 ranks x 16: 16 steps per epoch.
  const std::vector<std::string> toy = {"model=linear", "dataset=synthetic-regression", "synthetic-size=512",
                                        "batch-size=16", "epochs=3", "test-limit=64", "save-every=2"};
  auto run = [&](const fs::path& d, std::vector<std::string> extra) {
    std::vector<std::string> a{d.string()};
    a.insert(a.end(), extra.begin(), extra.end());
    a.insert(a.end(), toy.begin(), toy.end());
    return runWorkerGroup({"train", 2, a});
  };
  const auto early = run(dir.path(), {"stop_after=0"});
  for (const auto& r : early) CHECK(r.exitCode == ctorch::contract::kExitPreempted);
  CHECK(early[0].output.find("stopped on request before the first step; nothing new to save") != std::string::npos);
  CHECK_FALSE(fs::exists(dir / "snapshot.pt"));

  // After the last step of epoch 1 (no snapshot due there: --save-every 2): the stop writes the
  // epoch-end snapshot itself.
  const auto late = run(dir.path(), {"stop_after=16"});
  for (const auto& r : late) {
    INFO(show(r));
    CHECK(r.exitCode == ctorch::contract::kExitPreempted);
    CHECK(r.output.find("result status=1 global=16 epochs=1") != std::string::npos);
  }
  CHECK(late[0].output.find("epoch 1/3 test: loss") != std::string::npos);  // the evaluation ran first
  CHECK(late[0].output.find("stopped on request after 1 epoch (global step 16)") != std::string::npos);
  const auto snap = ctorch::loadSnapshot(dir / "snapshot.pt");
  CHECK(snap.epochsRun == 1);
  CHECK(snap.stepInEpoch == 0);
  CHECK(snap.globalStep == 16);

  requireAllOk(run(dir.path(), {}));
  requireAllOk(run(reference.path(), {}));
  CHECK(bitDifference(dir / "model.pt", reference / "model.pt").empty());
}

// eval <dir> <n> <mode>: evaluates a fixed synthetic-images classifier on the first n test samples.
// mode "split": evaluateDistributed over the group; "padded": a DistributedSampler share (padding
// repeats samples) summed with the same allreduce -- the control that double counts.
CTORCH_TEST_WORKER(eval) {
  const fs::path dir = args.at(0);
  const std::int64_t n = std::stoll(args.at(1));
  const std::string mode = args.at(2);
  torch::set_num_threads(1);
  auto group = ctorch::initProcessGroup();
  ctorch::data::DatasetOptions d;
  d.name = "synthetic-images";
  d.split = ctorch::data::Split::Test;
  d.syntheticSize = n;
  d.seed = 3;
  auto test = std::make_shared<const ctorch::data::InMemoryDataset>(ctorch::data::loadDataset(d));
  ctorch::data::BatchPipeline pipeline(test, {});
  torch::manual_seed(11);  // the same weights on every rank and in the reference
  ctorch::models::ModelOptions m;
  m.name = "simple-cnn";
  m.imageSize = 28;
  m.inChannels = 1;
  auto model = ctorch::models::createModel(m);
  ctorch::train::EvalTotals totals;
  if (mode == "split") {
    totals = ctorch::train::evaluateDistributed(*model, pipeline, 64, torch::kCPU, *group);
  } else {
    ctorch::DistributedSamplerOptions so;
    so.datasetSize = n;
    so.worldSize = group->getSize();
    so.rank = group->getRank();
    so.shuffle = false;
    ctorch::DistributedSampler sampler(so);
    sampler.setEpoch(0);
    ctorch::train::EvalTotals local;
    const auto& idx = sampler.indices();
    local.count = static_cast<std::int64_t>(idx.size());
    model->eval();
    torch::NoGradGuard ng;
    const auto batch = pipeline.batch(idx);
    const auto out = model->forward(batch.inputs);
    local.correct = out.argmax(1).eq(batch.targets).sum().item<std::int64_t>();
    totals = ctorch::train::allReduceTotals(local, *group, torch::kCPU);
  }
  // Single-process reference on rank 0: the whole set in one pass.
  if (group->getRank() == 0) {
    const auto reference = ctorch::train::evaluateRange(*model, pipeline, 0, n, 1000, torch::kCPU);
    std::ofstream(dir / ("eval-" + mode + ".txt"))
        << totals.correct << " " << totals.count << " " << reference.correct << " " << reference.count << " "
        << totals.lossSum << " " << reference.lossSum << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

TEST_CASE("evaluation across ranks counts exactly what one process counts", "[trainer][eval]") {
  TempDir dir("train-eval");
  for (int world : {2, 3}) {
    INFO("world " << world);
    requireAllOk(runWorkerGroup({"eval", world, {dir.path().string(), "1001", "split"}}));
    std::istringstream in(ctorch::test::readFile(dir / "eval-split.txt"));
    std::int64_t correct, count, refCorrect, refCount;
    double loss, refLoss;
    in >> correct >> count >> refCorrect >> refCount >> loss >> refLoss;
    CHECK(count == 1001);
    CHECK(refCount == 1001);
    CHECK(correct == refCorrect);  // exact
    CHECK(correct > 0);
    CHECK(correct < 1001);         // an untrained model: a count that could easily differ
    // Loss sums over other batch boundaries and ranks: float32 per-batch sums in double (1e-5 relative).
    CHECK(loss == Approx(refLoss).epsilon(1e-5));
  }
  // Control: a padded split (DistributedSampler) counts 1002 samples on 2 ranks; the check bites.
  requireAllOk(runWorkerGroup({"eval", 2, {dir.path().string(), "1001", "padded"}}));
  std::istringstream in(ctorch::test::readFile(dir / "eval-padded.txt"));
  std::int64_t correct, count;
  in >> correct >> count;
  CHECK(count == 1002);
}

TEST_CASE("resume: 3 ranks stopped after their first step, then mid-epoch, end bit-identical to an uninterrupted run",
          "[trainer][loop][resume]") {
  // Three ranks are where restarts used to round differently: Gloo's ring adds each gradient element in
  // an order set by its place in the bucket (so the bucket layout after the first step must be the
  // one recorded in the snapshot), and DDP's first step in a process scaled by 1/3 instead of
  // dividing by 3 (so gradients are bucket views from the start). The CNN (two buckets, dropout) on
  // synthetic images: 96 samples, 3 ranks x 8 = 4 steps per epoch; asked to stop during step 1
  // (which does not log: its agreement is read at step 2) and stopped after step 2, resumed, asked
  // during step 6 (which logs: agreed at once) and stopped after it (epoch 2, step 2), resumed to
  // the end.
  const std::vector<std::string> args = {"model=mnist-cnn", "dataset=synthetic-images", "synthetic-size=96",
                                         "test-limit=24", "batch-size=8", "epochs=2", "log-interval=2"};
  auto run = [&](const fs::path& dir, std::vector<std::string> extra) {
    std::vector<std::string> a{dir.string()};
    a.insert(a.end(), extra.begin(), extra.end());
    a.insert(a.end(), args.begin(), args.end());
    return runWorkerGroup({"train", 3, a});
  };
  TempDir reference("train-3-ref"), dir("train-3");
  requireAllOk(run(reference.path(), {}));
  for (const auto& [ask, stop] : std::vector<std::pair<int, int>>{{1, 2}, {6, 6}}) {
    const auto stopped = run(dir.path(), {"stop_at=" + std::to_string(ask)});
    for (const auto& r : stopped) {
      INFO(show(r));
      CHECK(r.exitCode == ctorch::contract::kExitPreempted);
      CHECK(r.output.find("global=" + std::to_string(stop) + " ") != std::string::npos);
    }
  }
  const auto resumed = run(dir.path(), {});
  requireAllOk(resumed);
  CHECK(resumed[0].output.find("after 1 epoch + 2 steps (global step 6), exactly where it stopped") != std::string::npos);
  CHECK(bitDifference(dir / "model.pt", reference / "model.pt").empty());
}

// ddp_buckets: a world of 1; DDP starts from a given bucket layout, refuses a wrong one, and rebuilds
// on request after the first step. Prints "ok" when every check passed.
CTORCH_TEST_WORKER(ddp_buckets) {
  ctorch::initProcessGroup();
  torch::manual_seed(0);
  auto net = torch::nn::Sequential(torch::nn::Linear(600, 600), torch::nn::ReLU(), torch::nn::Linear(600, 10));
  const std::vector<std::vector<size_t>> given{{3, 2}, {1}, {0}};
  ctorch::DistributedDataParallel ddp(net, ctorch::DDPOptions().bucketAssignment(given));
  if (ddp.bucketAssignment() != given) throw std::runtime_error("the given assignment was not used");
  if (ddp.rebuildBuckets()) throw std::runtime_error("rebuilt before any backward");
  ddp(torch::randn({4, 600})).sum().backward();
  if (!ddp.rebuildBuckets()) throw std::runtime_error("no rebuild after the first backward");
  // The rebuild regroups in ready order with a 1 MiB first bucket: all 4 tensors (1.5 MB) in one.
  const auto rebuilt = ddp.bucketAssignment();
  if (rebuilt.size() != 1 || rebuilt[0].size() != 4) throw std::runtime_error("expected 1 bucket after the rebuild");
  if (ddp.rebuildBuckets()) throw std::runtime_error("rebuilt twice");
  for (const auto& bad : std::vector<std::vector<std::vector<size_t>>>{{{0, 1}, {2}}, {{0, 1}, {1, 2, 3}}, {{0, 1, 2, 9}}, {{}, {0, 1, 2, 3}}}) {
    try {
      ctorch::DistributedDataParallel other(net, ctorch::DDPOptions().bucketAssignment(bad));
      throw std::runtime_error("a bad assignment was accepted");
    } catch (const ctorch::ConfigError& e) {
      std::cout << "refused: " << e.what() << "\n";
    }
  }
  ctorch::destroyProcessGroup();
  std::cout << "ok" << std::endl;
  return 0;
}

TEST_CASE("DDP: a given bucket layout is used as is, a wrong one refused, the rebuild runs on request",
          "[trainer][ddp]") {
  WorkerGroupOptions g{"ddp_buckets", 1, {}};
  g.torchrunEnv = false;
  const auto r = runWorkerGroup(g);
  requireAllOk(r);
  CHECK(r[0].output.find("ok") != std::string::npos);
  CHECK(r[0].output.find("refused: DDPOptions::bucketAssignment leaves out parameter 3 (of 4)") != std::string::npos);
  CHECK(r[0].output.find("refused: DDPOptions::bucketAssignment names parameter 1 twice") != std::string::npos);
  CHECK(r[0].output.find("refused: DDPOptions::bucketAssignment names parameter 9, but the module has 4") !=
        std::string::npos);
  CHECK(r[0].output.find("refused: DDPOptions::bucketAssignment has an empty bucket") != std::string::npos);
}
