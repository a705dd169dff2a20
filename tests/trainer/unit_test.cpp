// Pure parts of the trainer, no processes: the command line and its validation, the learning-rate
// schedule, the resume decision, the evaluation split, formatting.
#include "ctorch_catch.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/errors.hpp>
#include <ctorch/process_tuning.hpp>
#include <ctorch/version.hpp>
#include <ctorch/train/evaluate.hpp>
#include <ctorch/train/memory_check.hpp>
#include <ctorch/train/options.hpp>
#include <ctorch/train/report.hpp>
#include <ctorch/train/strategy_table.hpp>
#include "resilience/resume_plan.hpp"
#include "snapshot/slot_layout.hpp"
#include <ctorch/train/schedule.hpp>
#include "snapshot/background_writer.hpp"

#include "multiproc.hpp"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <cmath>
#include <mutex>
#include <thread>
#include <set>

using namespace ctorch::train;
using namespace ctorch;

namespace {

ParsedCommandLine parse(std::vector<std::string> args) { return parseCommandLine(args); }

}  // namespace

TEST_CASE("trainer options: defaults train the seeds' CNN on Fashion-MNIST", "[trainer][options]") {
  const auto p = parse({});
  REQUIRE(p.options);
  const TrainOptions& o = *p.options;
  CHECK(o.model == "mnist-cnn");
  CHECK(o.dataset == "fashion-mnist");
  CHECK(o.dataDir.empty());
  CHECK(o.batchSize == 64);
  CHECK(o.optimizer == OptimizerKind::kSgd);
  CHECK(o.snapshotPath == "snapshot.pt");
  CHECK(o.resume.kind == ResumeChoice::Kind::kAuto);
  CHECK(o.finalModelPath() == std::filesystem::path(".") / "model.pt");
  CHECK(*o.metricsPath() == std::filesystem::path(".") / "metrics.jsonl");
  CHECK(o.tensorboardDir.empty());  // TensorBoard only when asked for
}

TEST_CASE("trainer options: kebab and underscore spellings, values after = or a space", "[trainer][options]") {
  const auto p = parse({"--batch_size=32", "--grad-accum-steps", "2", "--lr", "0.1", "--optimizer", "adam",
                        "--lr_decay", "cosine", "--warmup-epochs", "0.5", "--save_every_steps", "7", "--resume",
                        "never", "--metrics-file", "none", "--no-gradient-as-bucket-view", "--timeout", "9",
                        "--model", "linear", "--dataset", "synthetic-regression", "--max_steps", "11",
                        "--tensorboard_dir", "runs/tb"});
  REQUIRE(p.options);
  const TrainOptions& o = *p.options;
  CHECK(o.batchSize == 32);
  CHECK(o.gradAccumSteps == 2);
  CHECK(o.lr == 0.1);
  CHECK(o.optimizer == OptimizerKind::kAdam);
  CHECK(o.lrDecay == LrDecay::kCosine);
  CHECK(o.warmupEpochs == 0.5);
  CHECK(o.saveEverySteps == 7);
  CHECK(o.resume.kind == ResumeChoice::Kind::kNever);
  CHECK_FALSE(o.metricsPath());
  CHECK_FALSE(o.gradientAsBucketView);
  CHECK(o.timeout == std::chrono::seconds(9));
  CHECK(o.maxSteps == 11);
  CHECK(o.tensorboardDir == "runs/tb");
}

TEST_CASE("trainer options: --help and --version exit 0 with text on stdout", "[trainer][options]") {
  auto help = parse({"--help"});
  CHECK_FALSE(help.options);
  CHECK(help.exitCode == 0);
  CHECK_FALSE(help.toStderr);
  for (const char* flag : {"--epochs", "--batch-size", "--lr", "--momentum", "--optimizer", "--weight-decay",
                           "--warmup-epochs", "--lr-decay", "--seed", "--save-every", "--save-every-steps",
                           "--snapshot-path", "--model-dir", "--model-filename", "--checkpoint-every",
                           "--keep-checkpoints", "--log-interval", "--eval-every", "--max-steps", "--device",
                           "--backend", "--amp", "--bucket-cap-mb", "--find-unused-parameters",
                           "--grad-accum-steps", "--resume", "--timeout", "--tensorboard-dir"})
    CHECK(help.message.find(flag) != std::string::npos);
  CHECK(help.message.find("75") != std::string::npos);  // the preemption exit code is documented
  auto version = parse({"--version"});
  CHECK(version.exitCode == 0);
  CHECK(version.message.find("ctorch") != std::string::npos);
}

namespace {

// One line of a command's output ("" when it fails).
std::string commandLine(const std::string& command) {
  std::string out;
  if (FILE* p = ::popen(command.c_str(), "r")) {
    char buffer[512];
    if (std::fgets(buffer, sizeof buffer, p)) out = buffer;
    if (::pclose(p) != 0) out.clear();
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

}  // namespace

// Debian's LibTorch 1.13.1 says 1.13.0 in its headers; --version names the release that is installed.
TEST_CASE("trainer options: --version names the LibTorch release this process loaded (issue 42.10)", "[trainer][options]") {
  std::string library;  // the libtorch_cpu this test runs with, from its own memory map
  {
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line) && library.empty();)
      if (const auto at = line.find('/'); at != std::string::npos && line.find("/libtorch_cpu.so") != std::string::npos)
        library = line.substr(at);
  }
  REQUIRE_FALSE(library.empty());
  const std::string owner = commandLine("dpkg-query -S '" + library + "' 2>/dev/null");
  if (owner.empty()) CTORCH_SKIP("no package owns " << library << " (not a Debian LibTorch)");
  const std::string package = owner.substr(0, owner.find(':'));
  const std::string version = commandLine("dpkg-query -W -f='${Version}' " + package);
  REQUIRE_FALSE(version.empty());
  std::string upstream = version.substr(version.find(':') == std::string::npos ? 0 : version.find(':') + 1);
  upstream = upstream.substr(0, upstream.find_first_of("+-~"));
  INFO(ctorch::versionString() << " / " << package << " " << version);
  CHECK(ctorch::versionString().find("(LibTorch " + upstream + ",") != std::string::npos);
  CHECK(ctorch::versionString().find(version) != std::string::npos);
}

TEST_CASE("trainer options: every bad value is one line naming the flag and the value", "[trainer][options]") {
  struct Bad {
    std::vector<std::string> args;
    std::string mustContain;
  };
  const std::vector<Bad> cases = {
      {{"--epochs", "0"}, "--epochs '0'"},
      {{"--batch-size", "-3"}, "--batch-size '-3'"},
      {{"--batch-size", "many"}, "many"},
      {{"--lr", "0"}, "--lr '0'"},
      {{"--lr", "nan"}, "--lr 'nan'"},
      {{"--momentum", "1"}, "--momentum '1'"},
      {{"--weight-decay", "-0.1"}, "--weight-decay '-0.1'"},
      {{"--optimizer", "lamb"}, "--optimizer 'lamb'"},
      {{"--clip-grad-norm", "-1"}, "--clip-grad-norm '-1'"},
      {{"--lr-decay", "exponential"}, "--lr-decay 'exponential'"},
      {{"--warmup-epochs", "5", "--epochs", "3"}, "--warmup-epochs '5'"},
      {{"--warmup-start-factor", "0"}, "--warmup-start-factor '0'"},
      {{"--lr-gamma", "2"}, "--lr-gamma '2'"},
      {{"--min-lr", "1", "--lr", "0.1"}, "--min-lr '1'"},
      {{"--grad-accum-steps", "0"}, "--grad-accum-steps '0'"},
      {{"--save-every", "-1"}, "--save-every '-1'"},
      {{"--keep-snapshots", "1000"}, "--keep-snapshots '1000'"},
      {{"--keep-checkpoints", "0"}, "--keep-checkpoints '0'"},
      {{"--log-interval", "0"}, "--log-interval '0'"},
      {{"--eval-batch-size", "0"}, "--eval-batch-size '0'"},
      {{"--model", "vgg"}, "--model 'vgg'"},
      {{"--dataset", "imagenet"}, "--dataset 'imagenet'"},
      {{"--dataset", "mnist"}, "--data-dir"},
      {{"--data-dir", "/nonexistent/dir"}, "--data-dir '/nonexistent/dir'"},
      {{"--device", "tpu"}, "--device 'tpu'"},
      {{"--backend", "mpi"}, "--backend 'mpi'"},
      {{"--device", "cpu", "--backend", "nccl"}, "--backend 'nccl'"},
      {{"--amp-dtype", "int8"}, "--amp-dtype 'int8'"},
      {{"--timeout", "0"}, "--timeout '0'"},
      {{"--threads", "-1"}, "--threads '-1'"},
      {{"--bucket-cap-mb", "0"}, "--bucket-cap-mb '0'"},
      {{"--prefetch", "3"}, "--prefetch '3'"},
      {{"--progress", "fancy"}, "--progress 'fancy'"},
      {{"--augment", "maybe"}, "--augment 'maybe'"},
      {{"--model-filename", "a/b.pt"}, "--model-filename 'a/b.pt'"},
      {{"--resume", "/nonexistent/snapshot.pt"}, "--resume '/nonexistent/snapshot.pt'"},
      {{"--max-steps", "-5"}, "--max-steps '-5'"},
      {{"--step-delay-ms", "-1"}, "--step-delay-ms '-1'"},
      {{"--hold-after-step", "-1", "--hold-file", "go"}, "--hold-after-step '-1'"},
      {{"--hold-after-step", "3"}, "--hold-after-step needs --hold-file"},
      {{"--hold-file", "go"}, "--hold-file 'go' needs --hold-after-step"},
      {{"--no-such-flag"}, "--no-such-flag"},
  };
  for (const auto& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    INFO(joined);
    const auto p = parse(c.args);
    CHECK_FALSE(p.options);
    CHECK(p.exitCode == ctorch::contract::kExitUsage);
    CHECK(p.toStderr);
    CHECK(p.message.find(c.mustContain) != std::string::npos);
    CHECK(p.message.rfind("ctorch-train: error: ", 0) == 0);
    CHECK(std::count(p.message.begin(), p.message.end(), '\n') == 1);  // one line
  }
}

TEST_CASE("trainer options: --cuda-graphs refuses a CPU run and what a captured step cannot hold, in one line",
          "[trainer][options]") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--device", "cpu"}, "--cuda-graphs with --device cpu: CUDA graphs need CUDA"},
      {{"--optimizer", "adam"}, "--cuda-graphs with --optimizer adam"},
      {{"--clip-grad-norm", "1"}, "--cuda-graphs with --clip-grad-norm"},
      {{"--grad-accum-steps", "2"}, "--cuda-graphs with --grad-accum-steps 2"},
      {{"--sharding", "optimizer"}, "--cuda-graphs with --sharding optimizer"},
  };
  for (const auto& [extra, message] : cases) {
    std::vector<std::string> args{"--cuda-graphs"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto p = parse(args);
    INFO(p.message);
    CHECK_FALSE(p.options);
    CHECK(p.exitCode == ctorch::contract::kExitUsage);
    CHECK(p.message.find(message) != std::string::npos);
    CHECK(std::count(p.message.begin(), p.message.end(), '\n') == 1);
  }
  const auto ok = parse({"--cuda-graphs", "--device", "cuda"});
  INFO(ok.message);
  REQUIRE(ok.options);
  CHECK(ok.options->cudaGraphs);
}

TEST_CASE("trainer options: --amp with float16 on the CPU only where LibTorch autocasts the CPU to float16, "
          "bfloat16 everywhere, by any of its names", "[trainer][options]") {
  // --amp alone takes the device's autocast type, as torch.autocast does (issue 42.7).
  const auto natural = parse({"--device", "cpu", "--amp"});
  REQUIRE(natural.options);
  CHECK(natural.options->ampDtype == "bfloat16");
  CHECK(parse({"--device", "cuda", "--amp"}).options->ampDtype == "float16");
  auto deferred = parse({"--amp"});  // --device auto: known once the run looks for a GPU
  REQUIRE(deferred.options);
  CHECK(deferred.options->ampDtype == "auto");
  deferred.options->resolveAmpDtype(false);
  CHECK(deferred.options->ampDtype == "bfloat16");
  deferred.options->resolveAmpDtype(true);  // made concrete once, not again
  CHECK(deferred.options->ampDtype == "bfloat16");
  const auto half = parse({"--device", "cpu", "--amp", "--amp-dtype", "float16"});
  if (ctorch::amp::autocastSupported(torch::kCPU, torch::kHalf)) {
    CHECK(half.options);
  } else {
    REQUIRE_FALSE(half.options);
    CHECK_THAT(half.message, Catch::Contains("--amp with float16 needs CUDA") && Catch::Contains("bfloat16"));
  }
  for (const char* name : {"bf16", "bfloat16", "BFloat16"}) {
    const auto bf = parse({"--device", "cpu", "--amp", "--amp-dtype", name});
    REQUIRE(bf.options);
    CHECK(bf.options->ampDtype == "bfloat16");
    CHECK(bf.options->bindingConfig().at("amp") == "bfloat16");  // recorded by its canonical name
  }
  CHECK(parse({}).options->bindingConfig().at("amp") == "off");
}

TEST_CASE("trainer options: --fsdp-param-dtype and --fsdp-reduce-dtype (FSDP mixed precision) by canonical name, bound to the snapshot, refused without FSDP",
          "[trainer][options][sharding]") {
  const auto mp = parse({"--sharding", "full", "--fsdp-param-dtype", "bf16", "--fsdp_reduce_dtype", "fp32"});
  REQUIRE(mp.options);
  CHECK(mp.options->fsdpParamDtype == "bfloat16");
  CHECK(mp.options->fsdpReduceDtype == "float32");
  CHECK(mp.options->bindingConfig().at("fsdp_param_dtype") == "bfloat16");  // a resume with another policy is noticed
  CHECK(mp.options->bindingConfig().at("fsdp_reduce_dtype") == "float32");
  CHECK(parse({"--sharding", "hybrid", "--fsdp-param-dtype", "BFloat16"}).options->fsdpParamDtype == "bfloat16");
  CHECK(parse({"--sharding", "grad-op", "--fsdp-reduce-dtype", "float16"}).options->fsdpReduceDtype == "float16");
  CHECK(parse({"--sharding", "full"}).options->bindingConfig() == parse({}).options->bindingConfig());  // unset: as before
  const auto ddp = parse({"--fsdp-param-dtype", "bf16"});
  REQUIRE_FALSE(ddp.options);
  CHECK_THAT(ddp.message, Catch::Contains("--fsdp-param-dtype bfloat16 is FSDP's mixed precision, and --sharding none does not "
                                          "shard the model (use --sharding grad-op, full, hybrid or hybrid-grad-op)"));
  CHECK_THAT(parse({"--sharding", "optimizer", "--fsdp-reduce-dtype", "fp16"}).message,
             Catch::Contains("--fsdp-reduce-dtype float16 is FSDP's mixed precision, and --sharding optimizer does not"));
  CHECK_THAT(parse({"--sharding", "full", "--fsdp-param-dtype", "int8"}).message,
             Catch::Contains("--fsdp-param-dtype 'int8' is not one of: bf16, bfloat16, fp16, float16, fp32, float32"));
}

TEST_CASE("trainer options: --sharding none, optimizer, grad-op, full, hybrid or hybrid-grad-op, not bound to the snapshot, and not with float16 loss scaling",
          "[trainer][options][sharding]") {
  CHECK(parse({}).options->sharding == ctorch::train::ShardingChoice::kNone);
  const auto zero = parse({"--sharding", "optimizer"});
  REQUIRE(zero.options);
  CHECK(zero.options->sharding == ctorch::train::ShardingChoice::kOptimizer);
  CHECK(zero.options->bindingConfig() == parse({}).options->bindingConfig());  // resumes either way
  CHECK(parse({"--sharding", "full"}).options->sharding == ctorch::train::ShardingChoice::kFull);
  CHECK(parse({"--sharding", "grad-op"}).options->sharding == ctorch::train::ShardingChoice::kGradOp);
  CHECK(parse({"--sharding", "hybrid"}).options->sharding == ctorch::train::ShardingChoice::kHybrid);
  CHECK(parse({"--sharding", "hybrid-grad-op"}).options->sharding == ctorch::train::ShardingChoice::kHybridGradOp);
  CHECK(parse({"--sharding", "HYBRID_SHARD"}).options->sharding == ctorch::train::ShardingChoice::kHybrid);
  CHECK(parse({"--sharding", "_HYBRID_SHARD_ZERO2"}).options->sharding == ctorch::train::ShardingChoice::kHybridGradOp);
  CHECK(parse({"--sharding", "hybrid"}).options->bindingConfig() == parse({}).options->bindingConfig());
  CHECK_THAT(parse({"--sharding", "hybrid", "--memory-format", "channels-last"}).message,
             Catch::Contains("--memory-format channels-last with --sharding hybrid is not supported"));
  CHECK_THAT(parse({"--sharding", "zero3"}).message, Catch::Contains("--sharding") && Catch::Contains("'zero3'"));
  const auto fullScaled = parse({"--sharding", "full", "--amp", "--device", "cuda"});
  REQUIRE_FALSE(fullScaled.options);
  CHECK_THAT(fullScaled.message, Catch::Contains("--sharding full with --amp float16 (loss scaling) is not supported"));
  const auto scaled = parse({"--sharding", "optimizer", "--amp", "--device", "cuda"});
  REQUIRE_FALSE(scaled.options);
  CHECK_THAT(scaled.message, Catch::Contains("--sharding optimizer with --amp float16 (loss scaling) is not supported"));
  CHECK(parse({"--sharding", "optimizer", "--amp", "--amp-dtype", "bfloat16", "--device", "cpu"}).options);
}

TEST_CASE("trainer options: a mistyped flag or value says what to type instead", "[trainer][options]") {
  struct Bad {
    std::vector<std::string> args;
    std::string message;  // the whole line after "ctorch-train: error: "
  };
  const std::vector<Bad> cases = {
      {{"--epoch", "1"}, "unknown option '--epoch' (did you mean --epochs?)"},
      {{"--lr-deacy", "cosine"}, "unknown option '--lr-deacy' (did you mean --lr-decay?)"},
      {{"--batch_sise", "8"}, "unknown option '--batch_sise' (did you mean --batch-size?)"},
      {{"--save-ev", "2"}, "unknown option '--save-ev' (did you mean --save-every or --save-every-steps?)"},
      {{"--zzzzzz"}, "unknown option '--zzzzzz' (see ctorch-train --help)"},
      {{"--lr", "abc"}, "--lr 'abc' is not a number"},
      {{"--lr=1e-3x"}, "--lr '1e-3x' is not a number"},
      {{"--epochs", "2.5"}, "--epochs '2.5' is not a whole number in range"},
      {{"--prefetch", "99999999999"}, "--prefetch '99999999999' is not a whole number in range"},
      {{"--seed", "one"}, "--seed 'one' is not a number"},
      {{"--lr"}, "--lr needs a value (see ctorch-train --help)"},
      {{"--lr", "--epochs", "2"}, "--lr needs a value (see ctorch-train --help)"},
      {{"--epochs", "2", "3"}, "unexpected argument '3': ctorch-train takes options only (a value needs its flag "
                               "before it, e.g. --epochs 3)"},
  };
  for (const auto& c : cases) {
    INFO(c.message);
    const auto p = parse(c.args);
    CHECK_FALSE(p.options);
    CHECK(p.exitCode == ctorch::contract::kExitUsage);
    CHECK(p.message == "ctorch-train: error: " + c.message + "\n");
  }
  // Negative values still reach the range check that explains them.
  CHECK(parse({"--lr", "-1"}).message.find("--lr '-1' must be in") != std::string::npos);
}

TEST_CASE("trainer options: --synthetic-shape C,H,W for synthetic images, validated", "[trainer][options]") {
  const auto p = parse({"--model", "resnet18", "--dataset", "synthetic-images", "--synthetic-shape", "3,32,32"});
  REQUIRE(p.options);
  CHECK(p.options->syntheticShape == std::vector<std::int64_t>{3, 32, 32});
  CHECK(p.options->bindingConfig().at("synthetic_shape") == "3,32,32");
  CHECK(parse({"--dataset", "synthetic-images"}).options->bindingConfig().count("synthetic_shape") == 0);
  for (const char* bad : {"3,32", "3,32,32,1", "0,32,32", "3,-1,32", "a,b,c", "3,,32", "", "65,8,8", "3,5000,32"}) {
    INFO(bad);
    const auto q = parse({"--dataset", "synthetic-images", "--synthetic-shape", bad});
    CHECK_FALSE(q.options);
    CHECK(q.message.find("--synthetic-shape '" + std::string(bad) + "' must be C,H,W") != std::string::npos);
  }
  const auto other = parse({"--synthetic-shape", "3,32,32"});
  CHECK(other.message.find("--synthetic-shape applies to --dataset synthetic-images only") != std::string::npos);
}

TEST_CASE("trainer options: weights and metrics go beside the snapshot unless --model-dir says otherwise",
          "[trainer][options]") {
  namespace fs = std::filesystem;
  const auto beside = parse({"--snapshot-path", "/shared/run1/snapshot.pt"});
  REQUIRE(beside.options);
  CHECK(beside.options->finalModelPath() == fs::path("/shared/run1/model.pt"));
  CHECK(*beside.options->metricsPath() == fs::path("/shared/run1/metrics.jsonl"));
  const auto given = parse({"--snapshot-path", "/shared/run1/snapshot.pt", "--model-dir", "out"});
  REQUIRE(given.options);
  CHECK(given.options->finalModelPath() == fs::path("out/model.pt"));
  CHECK(*given.options->metricsPath() == fs::path("out/metrics.jsonl"));
  // CLI11 2.4+ (the modern lane) wraps descriptions: compare with the line breaks folded.
  std::string help;
  for (char c : parse({"--help"}).message) {
    const bool blank = c == ' ' || c == '\n';
    if (!(blank && !help.empty() && help.back() == ' ')) help.push_back(blank ? ' ' : c);
  }
  CHECK(help.find("default: the --snapshot-path's directory") != std::string::npos);
}

TEST_CASE("batch size: larger than the rank's share, or than the memory left, is refused with the numbers",
          "[trainer][memory]") {
  BatchMemoryInputs in;
  in.batchSize = 64;
  in.shardSize = 30000;
  in.datasetSize = 60000;
  in.worldSize = 2;
  in.inputBytes = 28 * 28 * 4;
  in.activationBytes = 500 * 1024;
  in.availableBytes = std::int64_t{8} << 30;
  in.availableSource = "MemAvailable";
  CHECK(checkBatchSize(in).empty());

  in.batchSize = 1000000;
  CHECK(checkBatchSize(in) ==
        "--batch-size '1000000' is larger than this rank's share of the training set (30000 of 60000 samples "
        "over 2 ranks): use at most 30000");

  in.batchSize = 30000;  // 30000 x (2 x 3136 B + 500 KiB) = 14.5 GiB > 8 GiB
  const std::string refused = checkBatchSize(in);
  INFO(refused);
  CHECK(refused.rfind("--batch-size '30000' needs about 14.5 GiB of memory (3.1 KiB of input x 2 copies + 500.0 "
                      "KiB of activations per sample), but 8.0 GiB is available (MemAvailable): use at most "
                      "--batch-size 16574",
                      0) == 0);
  in.batchSize = 16574;
  CHECK(checkBatchSize(in).empty());
  in.localRanks = 2;  // two ranks share the node's memory
  CHECK(checkBatchSize(in).find("x 2 ranks on this node") != std::string::npos);
  in.availableBytes.reset();  // unknown: only the share is checked
  CHECK(checkBatchSize(in).empty());

  CHECK(parseMemAvailable("MemTotal:  16 kB\nMemFree: 1 kB\nMemAvailable:    2048 kB\n") == 2048 * 1024);
  CHECK_FALSE(parseMemAvailable("MemTotal: 16 kB\n"));
}

TEST_CASE("strategy table: the flags choose one entry, which names how recovery and the model line speak of it, "
          "and every refusal is one filled-in line (issue 59.2)", "[trainer][options][strategy]") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> chosen = {
      {{}, "DDP"},
      {{"--sharding", "optimizer"}, "ZeRO-1"},
      {{"--sharding", "full"}, "FSDP"},
      {{"--sharding", "grad-op"}, "FSDP"},
      {{"--sharding", "hybrid-grad-op"}, "hybrid FSDP"},
      {{"--sync", "parameter-server"}, "parameter server"},
      {{"--pipeline-stages", "2"}, "pipeline"}};
  for (const auto& [args, name] : chosen) {
    const auto p = parse(args);
    INFO(p.message);
    REQUIRE(p.options);
    CHECK(std::string(chosenStrategy(*p.options).name) == name);
  }
  CHECK(inPlaceRecoveryOffWith(*parse({}).options).empty());
  CHECK(inPlaceRecoveryOffWith(*parse({"--sharding", "full"}).options) == "--sharding full --shard-copies 0");
  CHECK(inPlaceRecoveryOffWith(*parse({"--sharding", "optimizer", "--shard-copies", "1"}).options).empty());
  CHECK(inPlaceRecoveryOffWith(*parse({"--sync", "parameter-server"}).options) == "--sync parameter-server");
  CHECK(inPlaceRecoveryOffWith(*parse({"--pipeline-stages", "3"}).options) == "--pipeline-stages 3");
  CHECK(std::string(chosenStrategy(*parse({"--sync", "parameter-server"}).options).dataRankNoun) == "worker");

  // Every entry's flags with each feature, and two entries at once: refused or not, never a
  // placeholder left in the line.
  const std::vector<std::vector<std::string>> strategies = {
      {}, {"--sharding", "optimizer"}, {"--sharding", "full"}, {"--sharding", "hybrid"},
      {"--sync", "parameter-server"}, {"--pipeline-stages", "2"}, {"--pipeline-stages", "2", "--sharding", "full"},
      {"--sync", "parameter-server", "--sharding", "optimizer"}, {"--pipeline-stages", "2", "--sync", "parameter-server"}};
  const std::vector<std::vector<std::string>> features = {
      {}, {"--cuda-graphs"}, {"--amp"}, {"--amp", "--amp-dtype", "bfloat16"}, {"--clip-grad-norm", "1"},
      {"--grad-accum-steps", "2"}, {"--memory-format", "channels-last"}, {"--shard-copies", "1"},
      {"--fsdp-param-dtype", "bf16"}, {"--fsdp-reduce-dtype", "fp16"}};
  int refused = 0;
  for (const auto& strategy : strategies)
    for (const auto& feature : features) {
      std::vector<std::string> args{"--device", "cuda"};
      args.insert(args.end(), strategy.begin(), strategy.end());
      args.insert(args.end(), feature.begin(), feature.end());
      const auto p = parse(args);
      INFO(p.message);
      if (p.options) continue;
      ++refused;
      CHECK(p.exitCode == ctorch::contract::kExitUsage);
      CHECK(p.message.rfind("ctorch-train: error: --", 0) == 0);
      CHECK(p.message.find('{') == std::string::npos);
      CHECK(std::count(p.message.begin(), p.message.end(), '\n') == 1);
    }
  CHECK(refused > 30);
  CHECK_THAT(parse({"--device", "cuda", "--sharding", "hybrid", "--shard-copies", "1"}).message,
             Catch::Contains("--shard-copies 1 with --sharding hybrid is not supported: hybrid sharding's node and replica "
                             "groups are not re-formed in place"));
  CHECK_THAT(parse({"--device", "cuda", "--sync", "parameter-server", "--cuda-graphs"}).message,
             Catch::Contains("--cuda-graphs with --sync parameter-server: its push and pull run on the host"));
  CHECK_THAT(parse({"--device", "cpu", "--sync", "parameter-server", "--cuda-graphs"}).message,
             Catch::Contains("--cuda-graphs with --device cpu: CUDA graphs need CUDA"));
  CHECK_THAT(parse({"--pipeline-stages", "2", "--sync", "parameter-server"}).message,
             Catch::Contains("--pipeline-stages 2 with --sync parameter-server: the stages' replicas average by allreduce"));
}

TEST_CASE("trainer options: the binding configuration holds what shapes training, not logging", "[trainer][options]") {
  TrainOptions a;
  TrainOptions b = a;
  b.logInterval = 99;
  b.evalEvery = 3;
  b.snapshotPath = "elsewhere.pt";
  b.epochs = 10;  // extending a run without a cosine schedule is fine
  b.maxSteps = 5;
  CHECK(a.bindingConfig() == b.bindingConfig());
  b.lr = 0.1;
  CHECK(a.bindingConfig() != b.bindingConfig());
  CHECK(b.bindingConfig().at("lr") == "0.1");
  TrainOptions c;
  c.lrDecay = LrDecay::kCosine;
  TrainOptions d = c;
  d.epochs = 10;  // a cosine schedule spans the run: its length matters
  CHECK(c.bindingConfig() != d.bindingConfig());
}

TEST_CASE("learning rate: warmup, then constant, step or cosine decay", "[trainer][schedule]") {
  LrSchedule s;
  s.peak = 0.4;
  s.epochs = 10;
  CHECK(s.at(0.0) == 0.4);
  CHECK(s.at(9.9) == 0.4);

  s.warmupEpochs = 2.0;
  s.warmupStartFactor = 0.25;
  CHECK(s.at(0.0) == Approx(0.1));
  CHECK(s.at(1.0) == Approx(0.25));
  CHECK(s.at(2.0) == Approx(0.4));
  CHECK(s.at(5.0) == Approx(0.4));

  s.decay = LrDecay::kStep;
  s.stepEpochs = 3;
  s.gamma = 0.5;
  CHECK(s.at(2.5) == Approx(0.4));
  CHECK(s.at(3.0) == Approx(0.2));
  CHECK(s.at(6.5) == Approx(0.1));

  s.decay = LrDecay::kCosine;
  s.minLr = 0.01;
  CHECK(s.at(2.0) == Approx(0.4));
  CHECK(s.at(6.0) == Approx(0.01 + 0.39 * 0.5));  // half way through the cosine
  CHECK(s.at(10.0) == Approx(0.01));
  CHECK(s.at(12.0) == Approx(0.01));  // past the end (a run extended without changing epochs)
  for (double p = 2.0; p < 9.9; p += 0.1) CHECK(s.at(p + 0.1) <= s.at(p));

  CHECK(epochProgress(2, 30, 120) == 2.25);
  CHECK(epochProgress(0, 0, 0) == 0.0);
}

TEST_CASE("learning rate: linear decay, and one-cycle (a cosine up, a cosine down) (issue 28.8)", "[trainer][schedule]") {
  LrSchedule s;
  s.peak = 0.4;
  s.epochs = 10;
  s.minLr = 0.04;
  s.warmupEpochs = 2.0;
  s.warmupStartFactor = 0.25;
  s.decay = LrDecay::kLinear;
  CHECK(s.at(1.0) == Approx(0.25));  // the linear warmup as for every decay
  CHECK(s.at(2.0) == Approx(0.4));
  CHECK(s.at(6.0) == Approx(0.22));  // half way from 0.4 to 0.04
  CHECK(s.at(10.0) == Approx(0.04));
  CHECK(s.at(11.0) == Approx(0.04));
  for (double p = 2.0; p < 9.9; p += 0.1) CHECK(s.at(p + 0.1) < s.at(p));

  // torch's OneCycleLR shape (anneal_strategy='cos'): from peak x start factor up to the peak over the
  // warmup epochs, then down to min-lr at the last epoch; both halves cosines.
  s.decay = LrDecay::kOneCycle;
  CHECK(s.at(0.0) == Approx(0.1));
  CHECK(s.at(1.0) == Approx(0.1 + 0.3 * 0.5));  // half way up: the cosine's midpoint
  CHECK(s.at(2.0) == Approx(0.4));
  CHECK(s.at(6.0) == Approx(0.04 + 0.36 * 0.5));
  CHECK(s.at(10.0) == Approx(0.04));
  CHECK(s.at(0.5) < 0.1 + 0.3 * 0.25);  // a cosine starts slower than a line
  for (double p = 0.0; p < 1.95; p += 0.1) CHECK(s.at(p + 0.1) > s.at(p));
  for (double p = 2.0; p < 9.9; p += 0.1) CHECK(s.at(p + 0.1) < s.at(p));
  // Without warmup epochs: up over the first 30 % of the run (torch's pct_start 0.3).
  s.warmupEpochs = 0.0;
  CHECK(s.at(3.0) == Approx(0.4));
  CHECK(s.at(1.5) == Approx(0.1 + 0.3 * 0.5));
}

TEST_CASE("evaluation split: contiguous shares, no sample twice, none missing", "[trainer][eval]") {
  for (std::int64_t n : {0, 1, 7, 10, 1001, 10000})
    for (std::int64_t w : {1, 2, 3, 4, 7}) {
      std::int64_t next = 0, smallest = n, largest = 0;
      for (std::int64_t r = 0; r < w; ++r) {
        const auto [b, e] = evalShard(n, r, w);
        CHECK(b == next);
        next = e;
        smallest = std::min(smallest, e - b);
        largest = std::max(largest, e - b);
      }
      CHECK(next == n);
      CHECK(largest - smallest <= 1);
    }
}

namespace {

SnapshotPoint point(std::int64_t world, std::int64_t epochsRun, std::int64_t step, std::int64_t global,
                    bool complete = false, const char* file = "run/snapshot.pt") {
  SnapshotPoint p;
  p.file = file;
  p.worldSize = world;
  p.epochsRun = epochsRun;
  p.stepInEpoch = step;
  p.globalStep = global;
  p.epochComplete = complete;
  return p;
}

}  // namespace

TEST_CASE("resume decision: exact continuation under the same world size", "[trainer][resume]") {
  const auto plan = planResume(point(2, 1, 30, 130), std::nullopt, 2, "run/snapshot-epoch.pt");
  CHECK(plan.source == ResumeSource::kNewest);
  CHECK(plan.exact);
  CHECK(plan.message.find("after 1 epoch + 30 steps (global step 130)") != std::string::npos);
  CHECK_FALSE(needsEpochBoundary(point(2, 1, 30, 130), 2));

  const auto fresh = planResume(std::nullopt, std::nullopt, 4, "run/snapshot-epoch.pt");
  CHECK(fresh.source == ResumeSource::kNone);
  CHECK(fresh.message.find("from scratch") != std::string::npos);
}

TEST_CASE("resume decision: another world size continues at an epoch boundary and says so", "[trainer][resume]") {
  // The newest snapshot is itself a boundary (end of epoch 2, or every index of epoch 3 consumed).
  for (const auto& p : {point(2, 2, 0, 200), point(2, 2, 100, 300, /*complete=*/true)}) {
    CHECK_FALSE(needsEpochBoundary(p, 3));
    const auto plan = planResume(p, std::nullopt, 3, "run/snapshot-epoch.pt");
    CHECK(plan.source == ResumeSource::kNewest);
    CHECK_FALSE(plan.exact);
    CHECK(plan.message.find("written by 2 ranks at an epoch boundary, continued by 3 ranks") != std::string::npos);
  }
  // Mid-epoch: the boundary slot is used, and the message names both files and the redone steps.
  const auto mid = point(2, 2, 40, 240);
  CHECK(needsEpochBoundary(mid, 1));
  const auto plan = planResume(mid, point(2, 2, 0, 200, false, "run/snapshot-epoch.pt"), 1, "run/snapshot-epoch.pt");
  CHECK(plan.source == ResumeSource::kBoundary);
  CHECK(plan.message.find("run/snapshot.pt stopped mid-epoch after 2 epochs + 40 steps (global step 240)") != std::string::npos);
  CHECK(plan.message.find("resuming from run/snapshot-epoch.pt after 2 epochs (global step 200)") != std::string::npos);
  CHECK(plan.message.find("the 40 steps after it are redone with 1 rank") != std::string::npos);
}

TEST_CASE("resume decision: mid-epoch under another world size without a boundary", "[trainer][resume]") {
  // In the first epoch the boundary is the initial state: a fresh start with the same seed.
  const auto first = planResume(point(2, 0, 17, 17), std::nullopt, 4, "run/snapshot-epoch.pt");
  CHECK(first.source == ResumeSource::kNone);
  CHECK(first.message.find("starting from scratch") != std::string::npos);
  // Later, refusing is the only correct answer; the message says how to proceed.
  try {
    planResume(point(2, 3, 17, 300), std::nullopt, 4, "run/snapshot-epoch.pt");
    FAIL("no exception");
  } catch (const ctorch::ConfigError& e) {
    const std::string m = e.what();
    CHECK(m.find("run/snapshot-epoch.pt does not exist") != std::string::npos);
    CHECK(m.find("Resume with 2 ranks, or start over from scratch") != std::string::npos);
  }
  // A stale boundary file (newer than the snapshot it should precede) is not used.
  CHECK_THROWS_AS(planResume(point(2, 3, 17, 300), point(2, 5, 0, 500), 4, "x"), ctorch::ConfigError);
}

TEST_CASE("resume decision: the boundary slot sits next to the snapshot slot", "[trainer][resume]") {
  CHECK(ctorch::detail::boundarySlot("run/snapshot.pt") == std::filesystem::path("run/snapshot-epoch.pt"));
  CHECK(ctorch::detail::boundarySlot("snap") == std::filesystem::path("snap-epoch"));
}

TEST_CASE("snapshot slot layout: every file name derived from a slot's path, as docs/snapshot.md lists them",
          "[trainer][resume]") {
  namespace d = ctorch::detail;
  const std::filesystem::path slot = "run/snapshot.pt";
  CHECK(d::keptFile(slot, 2) == std::filesystem::path("run/snapshot.pt.2"));
  CHECK(d::lockFile(slot) == std::filesystem::path("run/snapshot.pt.lock"));
  CHECK(d::shardFile(slot, 3) == std::filesystem::path("run/snapshot.pt.shards/rank3.pt"));
  CHECK(d::shardFile(d::keptFile(slot, 1), 0) == std::filesystem::path("run/snapshot.pt.1.shards/rank0.pt"));
  CHECK(d::legacyShardFile(slot, 3) == std::filesystem::path("run/snapshot.pt.optim-rank3"));
  CHECK(d::legacyShardPrefix(slot) == "snapshot.pt.optim-rank");
  CHECK(d::unusableFile(slot) == std::filesystem::path("run/snapshot.pt.unusable"));
  CHECK(d::temporaryPrefix(slot) == "snapshot.pt.tmp-");
}

TEST_CASE("durations read naturally", "[trainer][report]") {
  CHECK(formatDuration(0.36) == "0.4 s");
  CHECK(formatDuration(42.4) == "42 s");
  CHECK(formatDuration(187) == "3:07");
  CHECK(formatDuration(3723) == "1:02:03");
  CHECK(formatDuration(-1) == "?");
  CHECK(formatDuration(std::nan("")) == "?");
}

TEST_CASE("snapshot writer: a failed background write is reported at once and seen by the loop",
          "[trainer][snapshot]") {
  // Issue 12: the error used to surface only at the next save, possibly an epoch later.
  ctorch::test::TempDir dir("writer-fail");
  ctorch::test::writeFile(dir / "not-a-dir", "a file where the snapshot directory should be");
  SnapshotWriter writer(/*background=*/true);
  std::mutex mutex;
  std::vector<std::string> lines;
  SnapshotJob job;
  job.snapshot.header.modelName = "tiny";
  ctorch::SnapshotSlotOptions slot;
  slot.path = dir / "not-a-dir" / "snapshot.pt";
  job.slots.push_back(slot);
  job.label = "epoch 1, step 3";
  job.reportError = [&](const std::string& line) {
    std::lock_guard<std::mutex> lock(mutex);
    lines.push_back(line);
  };
  writer.submit(std::move(job));
  // Nobody calls wait() or submit(): the failure must show by itself.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!writer.failed() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(writer.failed());
  {
    std::lock_guard<std::mutex> lock(mutex);
    REQUIRE(lines.size() == 1);
    CHECK_THAT(lines[0], Catch::Contains("snapshot write failed (epoch 1, step 3)") &&
                             Catch::Contains("not-a-dir"));
  }
  CHECK_THROWS(writer.wait());  // the loop stops with it
}

// A 1-rank run on a busy 2-core host took 54 s with 2 automatic threads, 5.2 s with one (issue 42.10).
TEST_CASE("configureThreads: a busy host is named when several threads per rank would share it", "[trainer][threads]") {
  CHECK(ctorch::busyHostWarning(2, 1, 3.9, 2) ==
        "the host is busy (load 3.9 over the last minute on 2 CPUs): 2 threads per rank for 1 local rank will wait "
        "for each other; OMP_NUM_THREADS=1 (or fewer threads) may run much faster. A resumed run is bit-identical "
        "only with the same number of threads");
  CHECK(ctorch::busyHostWarning(4, 2, 8.0, 8).find("4 threads per rank for 2 local ranks") != std::string::npos);
  CHECK(ctorch::busyHostWarning(1, 1, 10.0, 2).empty());        // one thread waits for nobody of its own
  CHECK(ctorch::busyHostWarning(2, 1, 1.5, 2).empty());         // room left
  CHECK(ctorch::busyHostWarning(2, 1, std::nan(""), 2).empty());  // no reading, no claim
  CHECK(ctorch::busyHostWarning(2, 1, 5.0, 0).empty());
}

TEST_CASE("configureThreads: requested, OMP_NUM_THREADS, else CPUs over LOCAL_WORLD_SIZE, OpenBLAS at one", "[trainer][threads]") {
  const int before = at::get_num_threads();
  const char* omp = std::getenv("OMP_NUM_THREADS");
  const std::string savedOmp = omp ? omp : "";
  const char* lws = std::getenv("LOCAL_WORLD_SIZE");
  const std::string savedLws = lws ? lws : "";
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  const int cpus = CPU_COUNT(&set);

  auto three = ctorch::configureThreads(3);
  CHECK(three.threads == 3);
  CHECK(three.reason == "requested");
  CHECK(at::get_num_threads() == 3);

  ::unsetenv("OMP_NUM_THREADS");
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  auto shared = ctorch::configureThreads();
  CHECK(shared.threads == std::max(1, cpus / 2));
  CHECK(shared.reason == std::to_string(cpus) + " CPUs / 2 local ranks");
  CHECK(at::get_num_threads() == shared.threads);
  ::setenv("LOCAL_WORLD_SIZE", "junk", 1);  // not a number: one local rank
  CHECK(ctorch::configureThreads().threads == cpus);
  CHECK(ctorch::configureThreads(0, 4 * cpus).threads == 1);  // never 0

  // OpenBLAS (LibTorch's BLAS wherever the system's libblas is OpenBLAS): one thread under LibTorch's
  // pool, whatever the intra-op count, unless the user set OPENBLAS_NUM_THREADS.
  using GetThreads = int (*)();
  using SetThreads = void (*)(int);
  auto* blasGet = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  auto* blasSet = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const char* blasEnv = std::getenv("OPENBLAS_NUM_THREADS");
  const std::string savedBlasEnv = blasEnv ? blasEnv : "";
  const char* gotoEnv = std::getenv("GOTO_NUM_THREADS");
  const std::string savedGotoEnv = gotoEnv ? gotoEnv : "";
  ::unsetenv("OPENBLAS_NUM_THREADS");
  ::unsetenv("GOTO_NUM_THREADS");
  if (blasGet && blasSet) {
    const int blasBefore = blasGet();
    blasSet(2);
    auto many = ctorch::configureThreads(3);
    CHECK(many.blasThreads == 1);
    CHECK(many.blasReason == "one per calling thread");
    CHECK(blasGet() == 1);
    blasSet(2);  // what OpenBLAS read from the user's OPENBLAS_NUM_THREADS=2 at load
    ::setenv("OPENBLAS_NUM_THREADS", "2", 1);
    auto user = ctorch::configureThreads(1);
    CHECK(user.blasThreads == 2);
    CHECK(user.blasReason == "OPENBLAS_NUM_THREADS=2");
    CHECK(blasGet() == 2);
    CHECK(ctorch::setBlasThreads(3) == 3);  // from code, after configureThreads
    CHECK(blasGet() == 3);
    CHECK(ctorch::setBlasThreads(0) == 3);  // only reads
    blasSet(blasBefore);
  } else {
    auto none = ctorch::configureThreads(1);
    CHECK(none.blasThreads == 0);  // not OpenBLAS: nothing to set, nothing claimed
    CHECK(ctorch::setBlasThreads(2) == 0);
  }
  if (blasEnv) ::setenv("OPENBLAS_NUM_THREADS", savedBlasEnv.c_str(), 1);
  else ::unsetenv("OPENBLAS_NUM_THREADS");
  if (gotoEnv) ::setenv("GOTO_NUM_THREADS", savedGotoEnv.c_str(), 1);

  if (omp) ::setenv("OMP_NUM_THREADS", savedOmp.c_str(), 1);
  if (lws) ::setenv("LOCAL_WORLD_SIZE", savedLws.c_str(), 1);
  else ::unsetenv("LOCAL_WORLD_SIZE");
  at::set_num_threads(before);
}
