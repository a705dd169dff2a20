// Models: output shapes, parameter counts, state-dict names (torchvision / examples/mnist), the
// registry's errors, and equality with the PyTorch twins in models/python on identical weights.
#include "ctorch_catch.hpp"

#include "ctorch/snapshot.hpp"

#include <torch/torch.h>

#include <ctorch/models/linear.hpp>
#include <ctorch/models/mnist_cnn.hpp>
#include <ctorch/models/ops.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/models/resnet.hpp>
#include <ctorch/models/simple_cnn.hpp>

#include "multiproc.hpp"

#include <set>

using namespace ctorch::models;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> keys(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& item : stateDict(m)) out.push_back(item.key());
  return out;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

}  // namespace

TEST_CASE("models: output shapes for their inputs", "[models]") {
  torch::manual_seed(0);
  auto linear = createModel({.name = "linear"});
  CHECK(linear->forward(torch::rand({5, 20})).sizes() == torch::IntArrayRef({5, 1}));
  CHECK(linear->output() == ModelOutput::Values);

  auto cnn = createModel({.name = "mnist-cnn"});
  cnn->eval();
  auto logp = cnn->forward(torch::rand({4, 1, 28, 28}));
  CHECK(logp.sizes() == torch::IntArrayRef({4, 10}));
  CHECK(torch::allclose(logp.exp().sum(1), torch::ones({4}), 1e-5, 1e-5));  // log-probabilities
  CHECK(cnn->output() == ModelOutput::LogProbabilities);
  auto cnn32 = createModel({.name = "mnist-cnn", .inChannels = 3, .numClasses = 7, .imageSize = 32});
  CHECK(cnn32->forward(torch::rand({2, 3, 32, 32})).sizes() == torch::IntArrayRef({2, 7}));

  auto simple = createModel({.name = "simple-cnn", .inChannels = 3, .imageSize = 32});
  CHECK(simple->forward(torch::rand({3, 3, 32, 32})).sizes() == torch::IntArrayRef({3, 10}));
  auto simple28 = createModel({.name = "simple-cnn", .inChannels = 1, .imageSize = 28});
  CHECK(simple28->forward(torch::rand({3, 1, 28, 28})).sizes() == torch::IntArrayRef({3, 10}));
  CHECK(simple->output() == ModelOutput::Logits);

  auto resnet = createModel({.name = "resnet18", .inChannels = 3, .imageSize = 32});
  CHECK(resnet->forward(torch::rand({2, 3, 32, 32})).sizes() == torch::IntArrayRef({2, 10}));
  auto gray = createModel({.name = "resnet18", .inChannels = 1, .numClasses = 10, .imageSize = 28});
  CHECK(gray->forward(torch::rand({2, 1, 28, 28})).sizes() == torch::IntArrayRef({2, 10}));
  CHECK(gray->output() == ModelOutput::Logits);
}

TEST_CASE("models: parameter counts match the published architectures", "[models]") {
  CHECK(parameterCount(*createModel({.name = "resnet18", .inChannels = 3, .numClasses = 10})) == 11173962);
  CHECK(parameterCount(*createModel({.name = "mnist-cnn"})) == 1199882);
  CHECK(parameterCount(*createModel({.name = "simple-cnn", .inChannels = 3, .imageSize = 32})) == 62006);
  CHECK(parameterCount(*createModel({.name = "linear"})) == 21);
}

TEST_CASE("models: state-dict keys are Python's names in Python's order", "[models]") {
  CHECK(keys(*createModel({.name = "linear"})) == std::vector<std::string>{"weight", "bias"});
  CHECK(keys(*createModel({.name = "mnist-cnn"})) ==
        std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight",
                                 "fc1.bias", "fc2.weight", "fc2.bias"});
  auto r = keys(*createModel({.name = "resnet18", .inChannels = 3}));
  CHECK(r.size() == 122);  // torchvision's resnet18().state_dict() has 122 entries too
  CHECK(r.front() == "conv1.weight");
  CHECK(r.back() == "fc.bias");
  for (const char* k : {"bn1.running_mean", "bn1.num_batches_tracked", "layer1.0.conv1.weight",
                        "layer1.1.bn2.running_var", "layer2.0.downsample.0.weight",
                        "layer2.0.downsample.1.bias", "layer4.1.conv2.weight", "fc.weight"}) {
    CHECK(contains(r, k));
  }
  CHECK_FALSE(contains(r, "layer1.0.downsample.0.weight"));  // same shape: identity shortcut
}

TEST_CASE("models: registry rejects unknown names and impossible sizes in one line", "[models][errors]") {
  CHECK(modelNames() == std::vector<std::string>{"linear", "mnist-cnn", "simple-cnn", "resnet18"});
  CHECK_THROWS_MATCHES(createModel({.name = "vgg16"}), ModelOptionsError,
                       Catch::Message("unknown model 'vgg16' (known: linear, mnist-cnn, simple-cnn, resnet18)"));
  CHECK_THROWS_MATCHES(createModel({.name = "mnist-cnn", .imageSize = 5}), ModelOptionsError,
                       Catch::Message("model 'mnist-cnn': image size 5 must be in [6, 4096]"));
  CHECK_THROWS_WITH(createModel({.name = "simple-cnn", .imageSize = 15}), Catch::Contains("image size 15"));
  CHECK_THROWS_WITH(createModel({.name = "resnet18", .numClasses = 0}), Catch::Contains("classes 0"));
  CHECK_THROWS_WITH(createModel({.name = "resnet18", .inChannels = -1}), Catch::Contains("input channels -1"));
  CHECK_THROWS_WITH(createModel({.name = "linear", .inFeatures = 0}), Catch::Contains("in features 0"));
  // The smallest accepted sizes really run.
  CHECK(createModel({.name = "mnist-cnn", .imageSize = 6})->forward(torch::rand({1, 1, 6, 6})).size(1) == 10);
  CHECK(createModel({.name = "simple-cnn", .inChannels = 1, .imageSize = 16})
            ->forward(torch::rand({1, 1, 16, 16})).size(1) == 10);
}

TEST_CASE("models: identical weights give identical outputs in C++ and in PyTorch", "[models][python]") {
  using namespace ctorch::test;
  if (!fs::exists("/usr/bin/python3")) CTORCH_SKIP("no /usr/bin/python3");
  auto probe = run({.argv = {"/usr/bin/python3", "-c", "import torch"}});
  if (!probe.ok()) CTORCH_SKIP("/usr/bin/python3 has no torch: " << probe.output);

  TempDir dir;
  struct Case {
    ModelOptions options;
    std::vector<int64_t> input;
  };
  auto makeCase = [](const std::string& name, int64_t channels, int64_t size, std::vector<int64_t> input) {
    Case c;
    c.options.name = name;
    c.options.inChannels = channels;
    c.options.numClasses = 10;
    c.options.imageSize = size;
    c.input = std::move(input);
    return c;
  };
  std::vector<Case> cases;
  cases.push_back(makeCase("linear", 1, 28, {6, 20}));
  cases.push_back(makeCase("mnist-cnn", 1, 28, {4, 1, 28, 28}));
  cases.push_back(makeCase("simple-cnn", 3, 32, {4, 3, 32, 32}));
  cases.push_back(makeCase("resnet18", 1, 28, {3, 1, 28, 28}));
  std::vector<std::string> argv = {"/usr/bin/python3",
                                   std::string(CTORCH_SOURCE_DIR) + "/tests/models/check_equivalence.py",
                                   dir.path().string()};
  torch::manual_seed(42);
  for (auto& c : cases) {
    auto model = createModel(c.options);
    if (c.options.name == "resnet18") {
      // A few training-mode passes so the BatchNorm running statistics are not their defaults.
      torch::NoGradGuard noGrad;
      for (int i = 0; i < 3; ++i) model->forward(torch::randn(c.input) * 2 + 0.5);
    }
    model->eval();
    auto input = torch::randn(c.input);
    torch::Tensor output;
    {
      torch::NoGradGuard noGrad;
      output = model->forward(input);
    }
    ctorch::saveStateDict(*model, dir / (c.options.name + ".state.pt"));
    c10::Dict<std::string, torch::Tensor> io;
    io.insert("input", input);
    io.insert("output", output);
    auto bytes = torch::pickle_save(c10::IValue(io));
    writeFile(dir / (c.options.name + ".io.pt"), std::string(bytes.begin(), bytes.end()));
    argv.push_back(c.options.name + ":" + std::to_string(c.options.inChannels) + ":" +
                   std::to_string(c.options.numClasses) + ":" + std::to_string(c.options.imageSize));
  }
  auto result = run({.argv = argv,
                     .setEnv = {{"PYTHONPATH", std::string(CTORCH_SOURCE_DIR) + "/models/python"}},
                     .timeout = std::chrono::seconds(120)});
  INFO(result.output);
  CHECK(result.ok());
  for (const auto& c : cases) CHECK_THAT(result.output, Catch::Contains(c.options.name + ": max abs diff"));
  CHECK(std::count(result.output.begin(), result.output.end(), '\n') >= static_cast<long>(cases.size()));
  CHECK(result.output.find("FAIL") == std::string::npos);
}

namespace {

// Bitwise equality (NaN == NaN when the bits agree): what "the same values" means for the pool.
bool sameBits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         torch::equal(a.contiguous().view(torch::kInt32), b.contiguous().view(torch::kInt32));
}

// Activations as the CNN makes them, and worse: ReLU zeros (ties of 0 in most windows), values
// from a handful of levels (ties of positive values), NaNs, -inf and +inf.
torch::Tensor hostile(std::vector<int64_t> shape, std::uint64_t seed) {
  torch::manual_seed(static_cast<int64_t>(seed));
  auto x = torch::relu(torch::randn(shape));
  auto levels = torch::randint(0, 4, shape).to(torch::kFloat) * 0.5;
  x = torch::where(torch::rand(shape) < 0.3, levels, x);
  x.masked_fill_(torch::rand(shape) < 0.02, std::numeric_limits<float>::quiet_NaN());
  x.masked_fill_(torch::rand(shape) < 0.02, -std::numeric_limits<float>::infinity());
  x.masked_fill_(torch::rand(shape) < 0.01, std::numeric_limits<float>::infinity());
  x.view(-1)[1] = std::numeric_limits<float>::quiet_NaN();  // at least one, even in a single window
  return x;
}

}  // namespace

TEST_CASE("models: maxPool2x2 gives max_pool2d's values, indices and gradients bit for bit", "[models][ops]") {
  const std::vector<std::vector<int64_t>> shapes = {
      {64, 64, 24, 24}, {3, 5, 7, 9}, {2, 3, 24, 26}, {1, 1, 2, 2}, {2, 2, 5, 17}, {1, 4, 30, 30}};
  std::uint64_t seed = 1;
  for (const auto& shape : shapes) {
    CAPTURE(shape);
    const auto input = hostile(shape, seed++);
    // The cases the kernel must decide like LibTorch's: a NaN and ties in some window.
    REQUIRE(torch::isnan(input).any().item<bool>());
    auto x1 = input.clone().requires_grad_();
    auto x2 = input.clone().requires_grad_();
    auto [expected, expectedIndex] = torch::max_pool2d_with_indices(x1, 2);
    auto got = ctorch::models::maxPool2x2(x2);
    CHECK(sameBits(got, expected));
    // The indices themselves, through the no-grad path (the same kernel).
    {
      torch::NoGradGuard noGrad;
      auto plain = ctorch::models::maxPool2x2(input);
      CHECK(sameBits(plain, expected.detach()));
    }
    const auto gradOut = torch::randn(expected.sizes());
    expected.backward(gradOut);
    got.backward(gradOut);
    CHECK(sameBits(x2.grad(), x1.grad()));
    CHECK(x2.grad().ne(0).sum().item<int64_t>() > 0);
    // Gradients only reach LibTorch's chosen indices: a different tie-break would move them.
    auto chosen = torch::zeros({input.numel() / (shape[2] * shape[3]), shape[2] * shape[3]});
    chosen.scatter_(1, expectedIndex.reshape({chosen.size(0), -1}), 1.0);
    CHECK(torch::equal(x2.grad().reshape(chosen.sizes()).ne(0).logical_and(chosen.eq(0)).any(),
                       torch::tensor(false)));
  }
}

TEST_CASE("models: maxPool2x2 falls back to max_pool2d for what its kernel does not take", "[models][ops]") {
  torch::manual_seed(3);
  const auto x = torch::randn({2, 3, 8, 8});
  const std::vector<torch::Tensor> inputs = {x.to(torch::kDouble), x.contiguous(torch::MemoryFormat::ChannelsLast),
                                             x[0], x.transpose(2, 3), x.slice(3, 0, 7)};
  for (const auto& in : inputs) {
    const auto got = ctorch::models::maxPool2x2(in);
    const auto expected = torch::max_pool2d(in, 2);
    CHECK(got.sizes() == expected.sizes());
    CHECK(torch::equal(got, expected));
  }
}

TEST_CASE("models: sequential() holds the model's own modules and computes forward() bit for bit, in training and "
          "evaluation, gradients included",
          "[models][pipeline]") {
  for (const std::string name : {"mnist-cnn", "simple-cnn", "resnet18"}) {
    INFO(name);
    ModelOptions options;
    options.name = name;
    options.imageSize = name == "resnet18" ? 16 : 28;
    torch::manual_seed(3);
    auto model = createModel(options);
    torch::nn::Sequential seq = model->sequential();
    REQUIRE(!seq.is_empty());
    // The same tensors, not copies.
    const auto mine = model->parameters(), its = seq->parameters();
    REQUIRE(mine.size() == its.size());
    std::set<const void*> shared;
    for (const auto& p : mine) shared.insert(p.data_ptr());
    for (const auto& p : its) CHECK(shared.count(p.data_ptr()) == 1);
    const auto x = torch::randn({3, 1, options.imageSize, options.imageSize});
    for (const bool training : {true, false}) {
      model->train(training);
      torch::manual_seed(17);
      const auto a = model->forward(x);
      a.sum().backward();
      std::vector<at::Tensor> gradsA;
      for (auto& p : mine) gradsA.push_back(p.grad().clone()), p.mutable_grad().zero_();
      torch::manual_seed(17);
      const auto b = seq->forward(x);
      b.sum().backward();
      CHECK(torch::equal(a, b));
      for (std::size_t i = 0; i < mine.size(); ++i) CHECK(torch::equal(gradsA[i], mine[i].grad()));
      for (auto& p : mine) p.mutable_grad().zero_();
    }
  }
  // A model that is not a sequence says so with an empty holder.
  ModelOptions linear;
  linear.name = "linear";
  CHECK(createModel(linear)->sequential().is_empty());
}
