// ctorch::amp on the CPU: an autocast region casts what Python's torch.autocast("cpu") casts and
// restores the thread's previous state (nested too); pairs this LibTorch cannot autocast are refused
// with the reason; the GradScaler scales, unscales exactly (powers of two), skips a step with inf/NaN
// gradients, backs off and grows its scale as Python's does, and its state survives a snapshot.
#include "ctorch_catch.hpp"

#include <ctorch/amp.hpp>
#include "core/compat.hpp"
#include <ctorch/snapshot.hpp>

#include <torch/torch.h>

#include <cmath>
#include <limits>

using ctorch::amp::Autocast;
using ctorch::amp::GradScaler;
using ctorch::amp::GradScalerOptions;

TEST_CASE("amp: a CPU autocast region runs Linear in bfloat16 and restores the previous state", "[amp]") {
  torch::manual_seed(1);
  torch::nn::Linear fc(8, 4);
  const auto x = torch::randn({3, 8});
  REQUIRE(fc(x).scalar_type() == torch::kFloat);
  REQUIRE_FALSE(ctorch::compat::autocastEnabled(torch::kCPU));
  const auto before = ctorch::compat::autocastDtype(torch::kCPU);
  {
    Autocast outer(torch::kCPU, torch::kBFloat16);
    CHECK(ctorch::compat::autocastEnabled(torch::kCPU));
    const auto y = fc(x);
    CHECK(y.scalar_type() == torch::kBFloat16);
    // What autocast does: the operands in bfloat16, the product in bfloat16.
    const auto expected = torch::linear(x.to(torch::kBFloat16), fc->weight.to(torch::kBFloat16), fc->bias.to(torch::kBFloat16));
    CHECK(torch::equal(y, expected));
    {
      Autocast off(torch::kCPU, torch::kBFloat16, /*enabled=*/false);  // disabled: changes nothing
      CHECK(fc(x).scalar_type() == torch::kBFloat16);
    }
    CHECK(fc(x).scalar_type() == torch::kBFloat16);
  }
  CHECK_FALSE(ctorch::compat::autocastEnabled(torch::kCPU));
  CHECK(ctorch::compat::autocastDtype(torch::kCPU) == before);
  CHECK(fc(x).scalar_type() == torch::kFloat);
  // CUDA's switch is untouched by a CPU region.
  CHECK_FALSE(ctorch::compat::autocastEnabled(torch::kCUDA));
}

TEST_CASE("amp: dtypes are parsed by name and unsupported pairs are refused with the reason", "[amp]") {
  CHECK(ctorch::amp::parseDtype("bf16") == torch::kBFloat16);
  CHECK(ctorch::amp::parseDtype("BFloat16") == torch::kBFloat16);
  CHECK(ctorch::amp::parseDtype("fp16") == torch::kHalf);
  CHECK(ctorch::amp::parseDtype("float16") == torch::kHalf);
  CHECK_THROWS_WITH(ctorch::amp::parseDtype("int8"), Catch::Contains("'int8'") && Catch::Contains("float16, bfloat16"));
  CHECK(ctorch::amp::dtypeName(torch::kBFloat16) == "bfloat16");

  std::string why;
  CHECK(ctorch::amp::autocastSupported(torch::kCUDA, torch::kHalf));
  CHECK(ctorch::amp::autocastSupported(torch::kCPU, torch::kBFloat16));
  CHECK_FALSE(ctorch::amp::autocastSupported(torch::kCPU, torch::kFloat, &why));
  CHECK_THAT(why, Catch::Contains("float32"));
  CHECK_THROWS_WITH(Autocast(torch::kCPU, torch::kDouble), Catch::Contains("float64"));
  if (!ctorch::compat::kCpuAutocastHalf) {
    CHECK_FALSE(ctorch::amp::autocastSupported(torch::kCPU, torch::kHalf, &why));
    CHECK_THAT(why, Catch::Contains("bfloat16 only"));
    CHECK_THROWS_WITH(Autocast(torch::kCPU, torch::kHalf), Catch::Contains("needs CUDA"));
  }
  CHECK_FALSE(ctorch::compat::autocastEnabled(torch::kCPU));  // a refused region changed nothing
}

namespace {

// One parameter whose gradient the test sets directly.
struct Fixture {
  torch::Tensor p = torch::zeros({4}, torch::requires_grad());
  torch::optim::SGD opt{{p}, torch::optim::SGDOptions(1.0)};
  void grad(std::vector<float> values) { p.mutable_grad() = torch::tensor(values); }
};

}  // namespace

TEST_CASE("amp: the GradScaler unscales exactly, skips inf/NaN steps, backs off and grows as Python's", "[amp]") {
  Fixture f;
  GradScaler scaler(torch::kCPU, GradScalerOptions().initScale(1024).growthInterval(3));
  CHECK(scaler.currentScale() == 1024);
  const auto loss = torch::tensor(0.75f);
  CHECK(scaler.scale(loss).item<float>() == 768.0f);

  // A clean step: gradients divided by the scale exactly (a power of two), the optimizer steps.
  f.grad({1024.0f, -2048.0f, 512.0f, 3.0f});
  CHECK(scaler.step(f.opt));
  CHECK(torch::equal(f.p.grad(), torch::tensor({1.0f, -2.0f, 0.5f, 3.0f / 1024.0f})));
  CHECK(torch::equal(f.p.detach(), -torch::tensor({1.0f, -2.0f, 0.5f, 3.0f / 1024.0f})));
  scaler.update();
  CHECK(scaler.currentScale() == 1024);
  CHECK(scaler.growthTracker() == 1);

  // inf or NaN anywhere: no step, the scale halves, the clean-step count restarts.
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    const auto before = f.p.detach().clone();
    f.grad({1.0f, bad, 1.0f, 1.0f});
    CHECK_FALSE(scaler.step(f.opt));
    CHECK(torch::equal(f.p.detach(), before));
    scaler.update();
    CHECK(scaler.growthTracker() == 0);
  }
  CHECK(scaler.currentScale() == 256);

  // growthInterval clean steps in a row: the scale doubles.
  for (int i = 0; i < 3; ++i) {
    f.grad({1.0f, 1.0f, 1.0f, 1.0f});
    CHECK(scaler.step(f.opt));
    scaler.update();
  }
  CHECK(scaler.currentScale() == 512);
  CHECK(scaler.growthTracker() == 0);

  // unscale() before step(): once per iteration; step() then does not divide again.
  f.grad({512.0f, 512.0f, 512.0f, 512.0f});
  scaler.unscale(f.opt);
  CHECK(torch::equal(f.p.grad(), torch::ones({4})));
  CHECK_THROWS_WITH(scaler.unscale(f.opt), Catch::Contains("already called"));
  CHECK(scaler.step(f.opt));
  CHECK(torch::equal(f.p.grad(), torch::ones({4})));
  scaler.update();
  scaler.unscale(f.opt);  // a new iteration may unscale again
  scaler.update();
}

TEST_CASE("amp: a disabled GradScaler is a pass-through and options are validated", "[amp]") {
  Fixture f;
  GradScaler off(torch::kCPU, GradScalerOptions().enabled(false));
  const auto loss = torch::tensor(2.5f);
  CHECK(off.scale(loss).item<float>() == 2.5f);
  f.grad({std::numeric_limits<float>::infinity(), 0, 0, 0});
  CHECK(off.step(f.opt));  // no check without scaling: Python's enabled=False
  CHECK(off.currentScale() == 1.0);
  auto items = ctorch::newItemDict();
  off.saveTo(items);
  CHECK(items.size() == 0);
  CHECK_THROWS_WITH(GradScaler(torch::kCPU, GradScalerOptions().initScale(-1)), Catch::Contains("initScale"));
  CHECK_THROWS_WITH(GradScaler(torch::kCPU, GradScalerOptions().growthFactor(0.5)), Catch::Contains("growthFactor"));
  CHECK_THROWS_WITH(GradScaler(torch::kCPU, GradScalerOptions().backoffFactor(1.5)), Catch::Contains("backoffFactor"));
  CHECK_THROWS_WITH(GradScaler(torch::kCPU, GradScalerOptions().growthInterval(0)), Catch::Contains("growthInterval"));
}

TEST_CASE("amp: the GradScaler's scale and growth count go through a snapshot", "[amp]") {
  Fixture f;
  GradScaler a(torch::kCPU, GradScalerOptions().initScale(4096).growthInterval(10));
  f.grad({std::numeric_limits<float>::infinity(), 0, 0, 0});
  a.step(f.opt);
  a.update();  // 2048
  f.grad({1, 1, 1, 1});
  a.step(f.opt);
  a.update();  // tracker 1
  auto items = ctorch::newItemDict();
  a.saveTo(items);
  // Through the file format, as USER_STATE.
  torch::nn::Linear model(2, 2);
  ctorch::SnapshotIdentity id;
  id.modelName = "amp";
  auto snap = ctorch::captureSnapshot({model.get()}, id, {});
  snap.userState = items;
  const auto bytes = ctorch::encodeSnapshot(snap);
  const auto back = ctorch::decodeSnapshot(bytes, "amp.pt");

  GradScaler b(torch::kCPU, GradScalerOptions().initScale(4096).growthInterval(10));
  b.loadFrom(back.userState);
  CHECK(b.currentScale() == 2048);
  CHECK(b.growthTracker() == 1);
  // Control: a fresh scaler differs.
  CHECK(GradScaler(torch::kCPU, GradScalerOptions().initScale(4096)).currentScale() != 2048);
}
