// ctorch::cuda_graph::decide on recorded signatures (no CUDA needed): warm-up until the same step
// repeated warmupSteps times, then one capture, then replays; shapes, dtypes or devices that change
// run eagerly (warm-up towards a new capture) saying what changed; parameters whose gradients come
// and go between steps of the same shapes (control flow) make every later step eager; a blocker
// (DDP on Gloo, an optimizer counting steps on the host) is the reason. Then what can run on the
// CPU: GradScaler's device skip equals its host skip bit for bit, and CudaGraphStep runs steps
// eagerly without CUDA.
#include "ctorch_catch.hpp"

#include <ctorch/cuda_graph.hpp>

#include <torch/torch.h>

using namespace ctorch::cuda_graph;
using ctorch::CudaGraphOptions;

namespace {

const c10::Device kCuda(c10::DeviceType::CUDA, 0);

TensorSignature sig(std::vector<int64_t> sizes, c10::ScalarType dtype = c10::kFloat, c10::Device device = kCuda) {
  return {std::move(sizes), dtype, device};
}
InputSignature inputs(int64_t batch, c10::ScalarType dtype = c10::kFloat, c10::Device device = kCuda) {
  return {{sig({batch, 10}, dtype, device), sig({batch}, c10::kLong, device)}, {0.1}};
}
StepSignature step(const InputSignature& in, std::vector<bool> grads = {true, true}) { return {in, std::move(grads)}; }

const auto kOptions = CudaGraphOptions().warmupSteps(3);

Decision next(const Record& r, const InputSignature& in, std::optional<std::string> blocker = std::nullopt) {
  return decide(r, in, kOptions, blocker, /*cudaGraphs=*/true);
}

} // namespace

TEST_CASE("cuda_graph: warm-up steps, one capture, then replays of the same signature", "[cuda_graph]") {
  Record r;
  const auto in = inputs(32);
  for (int i = 0; i < 3; ++i) {
    const auto d = next(r, in);
    REQUIRE(d.action == Action::kWarmup);
    CHECK_THAT(d.reason, Catch::Contains("warm-up step " + std::to_string(i + 1) + " of 3"));
    record(r, step(in));
  }
  const auto c = next(r, in);
  REQUIRE(c.action == Action::kCapture);
  CHECK(c.reason.empty());
  recordCapture(r, step(in));
  for (int i = 0; i < 5; ++i) CHECK(next(r, in).action == Action::kReplay);
}

TEST_CASE("cuda_graph: a changed shape, dtype or device runs eagerly, saying what changed", "[cuda_graph]") {
  Record r;
  const auto in = inputs(32);
  for (int i = 0; i < 3; ++i) record(r, step(in));
  recordCapture(r, step(in));
  // The last, smaller batch of an epoch: warm-up (eager) with the reason, the graph kept.
  auto d = next(r, inputs(17));
  REQUIRE(d.action == Action::kWarmup);
  CHECK_THAT(d.reason, Catch::Contains("input 0 is Float[17, 10] on cuda:0, was Float[32, 10] on cuda:0"));
  CHECK_THAT(d.reason, Catch::Contains("the graph holds the other shapes"));
  record(r, step(inputs(17)));
  CHECK(next(r, in).action == Action::kReplay);  // back to the captured shapes: replayed again
  d = next(r, inputs(32, c10::kDouble));
  CHECK(d.action == Action::kWarmup);
  CHECK_THAT(d.reason, Catch::Contains("input 0 is Double[32, 10]"));
  d = next(r, inputs(32, c10::kFloat, c10::Device(c10::DeviceType::CPU)));
  CHECK(d.action == Action::kEager);
  CHECK_THAT(d.reason, Catch::Contains("input 0 is Float[32, 10] on cpu: CUDA graphs need CUDA tensors"));
  // A new shape that keeps coming is captured in its turn.
  Record s = r;
  for (int i = 0; i < 3; ++i) record(s, step(inputs(16)));
  CHECK(next(s, inputs(16)).action == Action::kCapture);
}

TEST_CASE("cuda_graph: a changed baked value (SGD's learning rate) is a new capture", "[cuda_graph]") {
  Record r;
  auto in = inputs(8);
  for (int i = 0; i < 3; ++i) record(r, step(in));
  recordCapture(r, step(in));
  in.baked = {0.01};
  const auto d = next(r, in);
  CHECK(d.action == Action::kWarmup);
  CHECK_THAT(d.reason, Catch::Contains("a value baked into the graph changed (0.1 -> 0.01"));
}

TEST_CASE("cuda_graph: a warm-up interrupted by another shape starts again", "[cuda_graph]") {
  Record r;
  record(r, step(inputs(32)));
  record(r, step(inputs(32)));
  record(r, step(inputs(20)));
  const auto d = next(r, inputs(32));
  CHECK(d.action == Action::kWarmup);
  CHECK_THAT(d.reason, Catch::Contains("warm-up step 1 of 3 (input 0 is Float[32, 10] on cuda:0, was Float[20, 10]"));
}

TEST_CASE("cuda_graph: gradients that come and go between steps of the same shapes: eager from then on",
          "[cuda_graph]") {
  Record r;
  const auto in = inputs(8);
  record(r, step(in, {true, true}));
  record(r, step(in, {true, false}));
  REQUIRE(r.controlFlow);
  for (int i = 0; i < 5; ++i) {
    record(r, step(in, {true, false}));
    const auto d = next(r, in);
    CHECK(d.action == Action::kEager);
    CHECK_THAT(d.reason, Catch::Contains("parameters with gradients changed between two steps of the same shapes "
                                         "(parameter 1 first)"));
  }
  // Different shapes with different gradients are not a change of control flow.
  Record s;
  record(s, step(inputs(8), {true, true}));
  record(s, step(inputs(4), {true, false}));
  CHECK_FALSE(s.controlFlow);
}

TEST_CASE("cuda_graph: a blocker keeps warming up, with its reason; it never stops a replay", "[cuda_graph]") {
  Record r;
  const auto in = inputs(8);
  for (int i = 0; i < 3; ++i) record(r, step(in));
  auto d = next(r, in, std::string("DDP reduces gradients with gloo, which a CUDA graph cannot capture (NCCL can)"));
  CHECK(d.action == Action::kWarmup);
  CHECK(d.reason == "DDP reduces gradients with gloo, which a CUDA graph cannot capture (NCCL can)");
  recordCapture(r, step(in));
  d = next(r, in, std::string("DDP's Reducer times iteration 100"));
  CHECK(d.action == Action::kReplay);
  CHECK(d.reason.empty());
}

TEST_CASE("cuda_graph: off, a CPU-only build, or no inputs: eager", "[cuda_graph]") {
  Record r;
  CHECK(decide(r, inputs(8), CudaGraphOptions().enabled(false), std::nullopt, true).reason == "CUDA graphs are off");
  CHECK_THAT(decide(r, inputs(8), kOptions, std::nullopt, false).reason, Catch::Contains("built without CUDA"));
  CHECK_THAT(next(r, InputSignature{}).reason, Catch::Contains("no input tensors"));
}

TEST_CASE("cuda_graph: signatures of tensors", "[cuda_graph]") {
  const auto s = signatureOf(torch::zeros({2, 3}, torch::kBFloat16));
  CHECK(s.sizes == std::vector<int64_t>{2, 3});
  CHECK(s.dtype == torch::kBFloat16);
  CHECK(s.device.is_cpu());
  CHECK(describe(s) == "BFloat16[2, 3] on cpu");
  CHECK(describe(signatureOf(torch::Tensor())) == "an undefined tensor");
  CHECK(s == signatureOf(torch::ones({2, 3}, torch::kBFloat16)));
  CHECK(s != signatureOf(torch::ones({3, 2}, torch::kBFloat16)));
}

namespace {

// Two identical SGD-with-momentum set-ups; one GradScaler skips on the host, the other on the device.
struct Twin {
  torch::nn::Linear fc{nullptr};
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<ctorch::amp::GradScaler> scaler;
  Twin(bool deviceSkip) {
    torch::manual_seed(3);
    fc = torch::nn::Linear(4, 2);
    sgd = std::make_unique<torch::optim::SGD>(fc->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    scaler = std::make_unique<ctorch::amp::GradScaler>(
        torch::kCPU, ctorch::amp::GradScalerOptions().initScale(1024).growthInterval(2));
    scaler->setDeviceSkip(deviceSkip);
  }
  void step(const torch::Tensor& x, bool poison) {
    sgd->zero_grad();
    auto loss = fc(x).pow(2).mean();
    scaler->scale(loss).backward();
    if (poison) fc->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
    scaler->step(*sgd);
    scaler->update();
  }
};

} // namespace

TEST_CASE("cuda_graph: the GradScaler's device skip equals its host skip bit for bit", "[cuda_graph][amp]") {
  Twin host(false), device(true);
  for (int i = 0; i < 8; ++i) {
    torch::manual_seed(100 + i);
    const auto x = torch::randn({5, 4});
    const bool poison = i == 2 || i == 5;  // a skipped step, also with momentum buffers in place
    host.step(x, poison);
    device.step(x, poison);
  }
  const auto a = host.fc->parameters(), b = device.fc->parameters();
  for (size_t i = 0; i < a.size(); ++i) CHECK(torch::equal(a[i], b[i]));
  CHECK(host.scaler->currentScale() == device.scaler->currentScale());
  CHECK(std::isfinite(b[0].sum().item<double>()));
}

TEST_CASE("cuda_graph: without CUDA, CudaGraphStep runs every step eagerly, saying why", "[cuda_graph]") {
  torch::manual_seed(5);
  torch::nn::Linear fc(3, 1);
  torch::optim::SGD sgd(fc->parameters(), torch::optim::SGDOptions(0.1));
  ctorch::CudaGraphStep graphed(fc->parameters(), CudaGraphOptions().warmupSteps(2));
  graphed.add(ctorch::graphParticipant(sgd));
  auto scope = graphed.sideStream(torch::kCPU);  // a no-op on the CPU
  for (int i = 0; i < 4; ++i) {
    auto out = graphed.run({torch::randn({4, 3})}, [&](const std::vector<at::Tensor>& in) {
      sgd.zero_grad();
      auto loss = fc(in[0]).pow(2).mean();
      loss.backward();
      sgd.step();
      return std::vector<at::Tensor>{loss.detach()};
    });
    REQUIRE(out.size() == 1);
    CHECK(graphed.lastDecision().action == Action::kEager);
  }
  CHECK_THAT(graphed.lastDecision().reason,
             Catch::Contains(ctorch::CudaGraphStep::available() ? "on cpu: CUDA graphs need CUDA tensors"
                                                                : "built without CUDA"));
  CHECK(graphed.replays() == 0);
  CHECK(graphed.captures() == 0);
}

TEST_CASE("cuda_graph: optimizers that count steps on the host are refused, SGD is not", "[cuda_graph]") {
  torch::nn::Linear fc(3, 1);
  torch::optim::Adam adam(fc->parameters());
  torch::optim::SGD sgd(fc->parameters(), torch::optim::SGDOptions(0.1));
  const auto refused = ctorch::graphParticipant(adam)->captureBlocker();
  REQUIRE(refused);
  CHECK_THAT(*refused, Catch::Contains("the optimizer (Adam) counts its steps on the host"));
  auto sgdPart = ctorch::graphParticipant(sgd);
  CHECK_FALSE(sgdPart->captureBlocker());
  CHECK(sgdPart->bakedValues() == std::vector<double>{0.1, 0.0, 0.0, 0.0, 0.0});
}
