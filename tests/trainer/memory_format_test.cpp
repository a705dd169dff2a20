// Channels-last memory format (issue 43.2): ctorch::toMemoryFormat on a module, ctorch-train's
// --memory-format (its spellings, its one-line error, the auto decision), and real runs: float32
// training in channels-last against NCHW, DDP at world 2 against world 1 in channels-last, and
// snapshots resumed across the two layouts (and opened by Python).
#include "trainer_test_util.hpp"

#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/memory_format.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/train/options.hpp>
#include <ctorch/train/setup.hpp>

#include <iostream>

using namespace traintest;
using ctorch::test::TempDir;
using ctorch::train::MemoryFormatChoice;

namespace {

// The bound of tests (a), (b) and (c): the largest difference of any weight between two float32 runs
// of 8 SGD steps whose convolutions add the same products in another order (measured and justified
// in docs/performance.md, "Channels-last"). A layout error (an image read in the wrong order, a
// gradient bucket with the wrong strides) moves the weights by the size of a step, 1e-3 and more.
constexpr double kLayoutBound = 1e-5;
// ResNet-18, one step: the stem's gradient comes back through 16 batch norms over 8 samples (the
// last stage's maps are 1x1: 8 values per channel), which magnify the rounding; measured 2.3e-5.
constexpr double kResNetBound = 1e-4;

// The largest difference of two state dicts (same names and shapes), each tensor's relative to its
// own scale where that is above 1: max |a - b| / max(max |a|, 1) (batch norm's running variances
// are in the hundreds, weights in the tenths, biases near 0). Prints the tensor it comes from.
double maxAbsDifference(const fs::path& a, const fs::path& b) {
  const auto x = loadWeights(a), y = loadWeights(b);
  REQUIRE(x.size() == y.size());
  double worst = 0;
  std::string where;
  for (size_t i = 0; i < x.size(); ++i) {
    REQUIRE(x[i].first == y[i].first);
    REQUIRE(x[i].second.sizes() == y[i].second.sizes());
    const auto s = x[i].second.to(torch::kDouble), t = y[i].second.to(torch::kDouble);
    const double scale = std::max(s.abs().max().item<double>(), 1.0);
    const double d = (s - t).abs().max().item<double>() / scale;
    if (d > worst) worst = d, where = x[i].first;
  }
  std::cout << "  (largest relative difference in " << where << ")\n";
  return worst;
}

ProcessResult trainIn(const fs::path& dir, const std::vector<std::string>& args) {
  auto r = ctorch::test::run(trainAlone(dir, args, std::chrono::seconds(240)));
  INFO(show(r));
  REQUIRE(r.ok());
  return r;
}

ctorch::train::ParsedCommandLine parse(std::vector<std::string> args) { return ctorch::train::parseCommandLine(args); }

// 8 steps of a small CNN on 28x28 synthetic images. Not the seeds' mnist-cnn: its dropout after the
// second convolution draws another mask for a channels-last tensor under LibTorch 2.x (which fills
// it in memory order; 1.13 in logical order), another trajectory rather than another rounding.
const std::vector<std::string> kCnn = {"--model", "simple-cnn", "--dataset", "synthetic-images", "--synthetic-size",
                                       "256", "--test-limit", "32", "--batch-size", "32", "--epochs", "1",
                                       "--augment", "off", "--lr", "0.01", "--progress", "none"};
// A convolutional model without dropout or batch norm, whose step is the same function of the global
// batch at any world size: 8 steps of a global batch of 16.
const std::vector<std::string> kSimple = {"--model", "simple-cnn", "--dataset", "synthetic-images",
                                          "--synthetic-size", "128", "--test-limit", "32", "--epochs", "1",
                                          "--augment", "off", "--lr", "0.02", "--progress", "none"};

}  // namespace

TEST_CASE("memory format: toMemoryFormat converts a module's 4-D tensors in place and leaves the rest",
          "[trainer][memory-format]") {
  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3)), torch::nn::BatchNorm2d(8),
                            torch::nn::Flatten(), torch::nn::Linear(8 * 6 * 6, 4));
  const auto before = net->parameters();
  std::vector<at::Tensor> values;
  for (const auto& p : before) values.push_back(p.detach().clone());
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));  // built before

  CHECK(ctorch::hasFourDimensionalTensors(*net));
  CHECK(ctorch::toMemoryFormat(*net, at::MemoryFormat::ChannelsLast) == 1);  // the convolution's weight only
  const auto after = net->parameters();
  REQUIRE(after.size() == before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    INFO("parameter " << i << " of shape " << after[i].sizes());
    CHECK(after[i].unsafeGetTensorImpl() == before[i].unsafeGetTensorImpl());  // the same Tensor objects
    CHECK(torch::equal(after[i], values[i]));
    CHECK(after[i].requires_grad());
    CHECK(after[i].is_leaf());
  }
  const auto& weight = net[0]->as<torch::nn::Conv2d>()->weight;
  CHECK(weight.is_contiguous(at::MemoryFormat::ChannelsLast));
  CHECK_FALSE(weight.is_contiguous());
  CHECK(net[3]->as<torch::nn::Linear>()->weight.is_contiguous());

  // The model trains in the new layout: gradients and the momentum follow the parameter's strides.
  const auto x = ctorch::toMemoryFormat(torch::randn({2, 3, 8, 8}), at::MemoryFormat::ChannelsLast);
  CHECK(x.is_contiguous(at::MemoryFormat::ChannelsLast));
  net->forward(x).sum().backward();
  optimizer.step();
  CHECK(weight.grad().is_contiguous(at::MemoryFormat::ChannelsLast));
  CHECK(weight.is_contiguous(at::MemoryFormat::ChannelsLast));

  // Back to contiguous, gradient included; a 2-D tensor passes through untouched.
  CHECK(ctorch::toMemoryFormat(*net, at::MemoryFormat::Contiguous) == 1);
  CHECK(weight.is_contiguous());
  CHECK(weight.grad().is_contiguous());
  const auto flat = torch::randn({2, 3});
  CHECK(ctorch::toMemoryFormat(flat, at::MemoryFormat::ChannelsLast).unsafeGetTensorImpl() == flat.unsafeGetTensorImpl());

  torch::nn::Linear linear(4, 2);
  CHECK_FALSE(ctorch::hasFourDimensionalTensors(*linear));
  CHECK(ctorch::toMemoryFormat(*linear, at::MemoryFormat::ChannelsLast) == 0);
  CHECK(std::string(ctorch::memoryFormatName(at::MemoryFormat::ChannelsLast)) == "channels-last");
}

TEST_CASE("memory format: --memory-format takes its names and Python's, auto by default, and a bad value is one line",
          "[trainer][memory-format][cli]") {
  CHECK(parse({}).options->memoryFormat == MemoryFormatChoice::kAuto);
  CHECK(parse({"--memory-format", "channels-last"}).options->memoryFormat == MemoryFormatChoice::kChannelsLast);
  CHECK(parse({"--memory_format=channels_last"}).options->memoryFormat == MemoryFormatChoice::kChannelsLast);
  CHECK(parse({"--memory-format", "Contiguous"}).options->memoryFormat == MemoryFormatChoice::kContiguous);
  CHECK(parse({"--memory-format", "auto"}).options->memoryFormat == MemoryFormatChoice::kAuto);

  const auto bad = parse({"--memory-format", "nhwc"});
  CHECK_FALSE(bad.options);
  CHECK(bad.exitCode == ctorch::contract::kExitUsage);
  CHECK(bad.message ==
        "ctorch-train: error: --memory-format 'nhwc' is not one of: auto, contiguous, channels-last (Python's "
        "channels_last is channels-last, contiguous_format is contiguous)\n");
  const auto fsdp = parse({"--memory-format", "channels-last", "--sharding", "full"});
  CHECK_FALSE(fsdp.options);
  CHECK(fsdp.message.find("--memory-format channels-last with --sharding full is not supported") != std::string::npos);

  // The real program: one line on stderr, exit 2, nothing trained.
  TempDir dir("memfmt-cli");
  const auto r = ctorch::test::run(trainAlone(dir.path(), {"--memory-format", "nhwc"}));
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitUsage);
  CHECK(r.output == bad.message);
}

TEST_CASE("memory format: auto is channels-last for a convolutional model on CUDA only", "[trainer][memory-format]") {
  using ctorch::train::chooseMemoryFormat;
  ctorch::train::TrainOptions o;
  const auto cl = at::MemoryFormat::ChannelsLast, nchw = at::MemoryFormat::Contiguous;
  CHECK(chooseMemoryFormat(o, /*cuda=*/true, /*convolutional=*/true).format == cl);
  CHECK(chooseMemoryFormat(o, false, true).format == nchw);
  CHECK(chooseMemoryFormat(o, true, false).format == nchw);
  o.sharding = ctorch::train::ShardingChoice::kGradOp;  // FSDP's flat parameters
  CHECK(chooseMemoryFormat(o, true, true).format == nchw);
  o.sharding = ctorch::train::ShardingChoice::kOptimizer;
  CHECK(chooseMemoryFormat(o, true, true).format == cl);
  o.memoryFormat = MemoryFormatChoice::kContiguous;
  CHECK(chooseMemoryFormat(o, true, true).format == nchw);
  o.memoryFormat = MemoryFormatChoice::kChannelsLast;
  CHECK(chooseMemoryFormat(o, false, true).format == cl);
  const auto linear = chooseMemoryFormat(o, false, false);
  CHECK(linear.format == nchw);
  CHECK(linear.ignored);

  // The run says what it chose: an explicit channels-last on the linear model is a no-op, said once.
  TempDir dir("memfmt-linear");
  const auto r = trainIn(dir.path(), {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                      "64", "--test-limit", "16", "--batch-size", "16", "--epochs", "1",
                                      "--memory-format", "channels-last", "--progress", "none"});
  CHECK(countMatches(r.output, std::regex("--memory-format channels-last ignored: the model has no 4-D weights")) == 1);
  const auto cnn = trainIn(dir.path(), with(kSimple, {"--max-steps", "1", "--snapshot-path", "cnn/snapshot.pt"}));
  CHECK(cnn.output.find(", contiguous (auto: contiguous on the CPU)") != std::string::npos);
}

// (a) The same float32 training in both layouts: within kLayoutBound, and the bound is tight enough
// to see a real change (a learning rate 10% higher moves the weights far beyond it).
TEST_CASE("memory format: 8 float32 steps of a CNN in channels-last end within the bound of NCHW",
          "[trainer][memory-format][process]") {
  TempDir nchw("memfmt-nchw"), cl("memfmt-cl"), other("memfmt-lr");
  trainIn(nchw.path(), with(kCnn, {"--memory-format", "contiguous"}));
  const auto r = trainIn(cl.path(), with(kCnn, {"--memory-format", "channels-last"}));
  CHECK(r.output.find(", channels-last (--memory-format)") != std::string::npos);
  const double layout = maxAbsDifference(nchw / "model.pt", cl / "model.pt");
  std::cout << "measured: simple-cnn, 8 steps, channels-last vs NCHW: max relative difference " << layout << "\n";
  CHECK(layout <= kLayoutBound);
  trainIn(other.path(), with(kCnn, {"--memory-format", "contiguous", "--lr", "0.011"}));
  const double control = maxAbsDifference(nchw / "model.pt", other / "model.pt");
  std::cout << "measured: simple-cnn, 8 steps, lr 0.011 vs 0.01: max relative difference " << control << "\n";
  CHECK(control > 10 * kLayoutBound);
}

// One step only: ResNet-18's batch norm over 8 samples amplifies the layouts' rounding from step to
// step (3 steps: 1.2e-3 apart).
TEST_CASE("memory format: a float32 step of ResNet-18 in channels-last ends within the bound of NCHW",
          "[trainer][memory-format][process]") {
  TempDir nchw("memfmt-rn-nchw"), cl("memfmt-rn-cl");
  const std::vector<std::string> args = {"--model", "resnet18", "--dataset", "synthetic-images", "--synthetic-shape",
                                         "3,32,32", "--synthetic-size", "8", "--test-limit", "8", "--batch-size",
                                         "8", "--eval-batch-size", "8", "--epochs", "1", "--augment", "off", "--lr",
                                         "0.01", "--progress", "none"};
  trainIn(nchw.path(), with(args, {"--memory-format", "contiguous"}));
  trainIn(cl.path(), with(args, {"--memory-format", "channels-last"}));
  const double layout = maxAbsDifference(nchw / "model.pt", cl / "model.pt");
  std::cout << "measured: resnet18, 1 step, channels-last vs NCHW: max relative difference " << layout << "\n";
  CHECK(layout <= kResNetBound);
}

// (b) DDP in channels-last: 2 ranks of 8 against 1 rank of 16 on the same global batches.
TEST_CASE("memory format: DDP at world 2 in channels-last ends within the bound of world 1",
          "[trainer][memory-format][process][ddp]") {
  TempDir one("memfmt-w1"), two("memfmt-w2"), one0("memfmt-w1-nchw"), two0("memfmt-w2-nchw");
  trainIn(one.path(), with(kSimple, {"--batch-size", "16", "--memory-format", "channels-last"}));
  const auto r = ctorch::test::run(
      trainUnderLauncher(two.path(), 2, with(kSimple, {"--batch-size", "8", "--memory-format", "channels-last"})));
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK(countMatches(r.output, std::regex(R"(model: simple-cnn, [0-9,]+ parameters, channels-last \(--memory-format\))")) == 1);
  const double layout = maxAbsDifference(one / "model.pt", two / "model.pt");
  // The same comparison in NCHW: what splitting the batch over two ranks costs in either layout.
  trainIn(one0.path(), with(kSimple, {"--batch-size", "16", "--memory-format", "contiguous"}));
  REQUIRE(ctorch::test::run(trainUnderLauncher(two0.path(), 2,
                                               with(kSimple, {"--batch-size", "8", "--memory-format", "contiguous"})))
              .ok());
  const double nchw = maxAbsDifference(one0 / "model.pt", two0 / "model.pt");
  std::cout << "measured: simple-cnn, 8 steps, world 2 vs world 1: channels-last " << layout << ", NCHW " << nchw
            << "; bit-identical: " << bitDifference(one / "model.pt", two / "model.pt").empty() << "\n";
  CHECK(layout <= kLayoutBound);
  CHECK(nchw <= kLayoutBound);
}

// (c) A snapshot of either layout resumes in the other, exactly where it stopped, with its values.
TEST_CASE("memory format: a snapshot written in channels-last resumes in NCHW and the other way round",
          "[trainer][memory-format][process][resume]") {
  for (const auto& [first, second] : std::vector<std::pair<std::string, std::string>>{
           {"channels-last", "contiguous"}, {"contiguous", "channels-last"}}) {
    INFO(first << " then " << second);
    TempDir dir("memfmt-resume");
    trainIn(dir.path(), with(kSimple, {"--batch-size", "16", "--max-steps", "4", "--memory-format", first}));
    const auto snap = ctorch::loadSnapshot(dir / "snapshot.pt");
    REQUIRE(snap.globalStep == 4);
    // The snapshot's model state restores bit for bit into a model of either layout, which keeps it.
    ctorch::models::ModelOptions mo;
    mo.name = "simple-cnn";
    mo.inChannels = 1;
    mo.imageSize = 28;
    mo.numClasses = 10;
    auto model = ctorch::models::createModel(mo);
    const auto format = second == "channels-last" ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
    ctorch::toMemoryFormat(*model, format);
    REQUIRE(ctorch::restoreModelState(*model, snap.modelState).empty());
    for (const auto& item : model->named_parameters()) {
      INFO(item.key());
      CHECK(torch::equal(item.value(), snap.modelState.at(item.key())));
      if (item.value().dim() == 4) CHECK(item.value().is_contiguous(format));
    }
    const auto r = trainIn(dir.path(), with(kSimple, {"--batch-size", "16", "--memory-format", second}));
    CHECK(r.output.find("resuming from snapshot.pt after 4 steps (global step 4), exactly where it stopped") !=
          std::string::npos);
    CHECK(r.output.find(", " + second + " (--memory-format)") != std::string::npos);
  }
}

TEST_CASE("memory format: Python opens a channels-last run's snapshot and final weights",
          "[trainer][memory-format][process][python]") {
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 has no torch (Debian's python3-torch)");
  TempDir dir("memfmt-python");
  trainIn(dir.path(), with(kSimple, {"--batch-size", "16", "--memory-format", "channels-last"}));
  SpawnOptions py;
  py.argv = {"/usr/bin/python3", "-c", R"(
import sys, torch
load = (lambda p: torch.load(p)) if torch.__version__.startswith("1.") else (lambda p: torch.load(p, weights_only=True))
weights, snap = load(sys.argv[1] + "/model.pt"), load(sys.argv[1] + "/snapshot.pt")
for name, t in snap["MODEL_STATE"].items():
    assert torch.equal(t, weights[name]), name
print("python: the channels-last run's weights equal its snapshot's", len(weights))
)",
             dir.path().string()};
  py.timeout = std::chrono::seconds(120);
  const auto checked = ctorch::test::run(py);
  INFO(show(checked));
  CHECK(checked.ok());
  CHECK(checked.output.find("python: the channels-last run's weights equal its snapshot's") != std::string::npos);
}
