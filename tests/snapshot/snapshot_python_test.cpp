// Python interop: a C++ snapshot opens with Python's torch.load (python3-torch 1.13), its keys,
// values, digest, RNG state and optimizer state are right there, Python's optimizer continues from
// it; files Python writes are read back or refused by name.
#include "fixtures.hpp"

#include "multiproc.hpp"

using namespace snaptest;
using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace {

constexpr const char* kPython = "/usr/bin/python3";

ctorch::test::ProcessResult python(std::vector<std::string> args) {
  ctorch::test::SpawnOptions so;
  so.argv = {kPython, CTORCH_SNAPSHOT_PY};
  so.argv.insert(so.argv.end(), args.begin(), args.end());
  so.timeout = std::chrono::seconds(90);
  return ctorch::test::run(so);
}

bool havePythonTorch() {
  static const bool ok = [] {
    if (!fs::exists(kPython)) return false;
    ctorch::test::SpawnOptions so;
    so.argv = {kPython, "-c", "import torch"};
    so.timeout = std::chrono::seconds(60);
    return ctorch::test::run(so).ok();
  }();
  return ok;
}

constexpr double kGrads[] = {0.25, -0.5, 0.125};  // check_snapshot.py's GRADS

void stepWith(torch::nn::Module& model, torch::optim::Optimizer& opt, double grad) {
  for (auto& p : model.parameters()) p.mutable_grad() = torch::full_like(p, grad);
  opt.step();
}

// The snapshot check_snapshot.py's "inspect" expects, written into `path`.
void writeInteropSnapshot(const std::string& optimizer, const fs::path& path) {
  auto model = interopModel();
  fillPattern(*model);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optimizer == "SGD")
    opt = std::make_unique<torch::optim::SGD>(model->parameters(),
                                              torch::optim::SGDOptions(0.05).momentum(0.9));
  else
    opt = std::make_unique<torch::optim::Adam>(
        model->parameters(), torch::optim::AdamOptions(0.01).betas(std::make_tuple(0.8, 0.99)));
  stepWith(*model, *opt, kGrads[0]);
  stepWith(*model, *opt, kGrads[1]);

  ctorch::DistributedSamplerOptions so;
  so.datasetSize = 100;
  so.worldSize = 3;
  so.seed = 7;
  ctorch::DistributedSampler sampler(so);
  sampler.setEpoch(4);
  sampler.next(5);
  torch::manual_seed(42);
  auto snap = ctorch::captureSnapshot({model.ptr().get(), opt.get(), &sampler},
                                      identity("interop-mlp", 3), {4, 5, 2});
  snap.schedulerState.insert("last_epoch", int64_t(4));
  snap.schedulerState.insert("gamma", 0.5);
  snap.userState.insert("rand_after_capture", torch::rand({5}));
  stepWith(*model, *opt, kGrads[2]);
  c10::Dict<std::string, at::Tensor> after;
  for (const auto& p : model->named_parameters()) after.insert(p.key(), p.value().detach().clone());
  snap.userState.insert("params_after_step3", after);
  ctorch::SnapshotSlotOptions slot;
  slot.path = path;
  ctorch::saveSnapshot(snap, slot);
}

} // namespace

TEST_CASE("a C++ snapshot opens in Python and Python's optimizer continues from it",
          "[snapshot][python]") {
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 with torch (python3-torch) is not installed");
  TempDir dir("snap-py");
  writeInteropSnapshot("SGD", dir / "sgd" / "snapshot.pt");
  writeInteropSnapshot("Adam", dir / "adam" / "snapshot.pt");
  const auto r = python({"inspect", (dir / "sgd" / "snapshot.pt").string(),
                         (dir / "adam" / "snapshot.pt").string()});
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("OK SGD"));
  CHECK_THAT(r.output, Catch::Contains("OK Adam"));
}

TEST_CASE("control: the Python check fails on a snapshot that is not what it expects",
          "[snapshot][python]") {
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 with torch (python3-torch) is not installed");
  TempDir dir("snap-py-control");
  const auto path = dir / "snapshot.pt";
  auto model = interopModel();  // random weights, not the pattern; no optimizer state
  auto snap = ctorch::captureSnapshot({model.ptr().get(), nullptr, nullptr},
                                      identity("interop-mlp", 3), {4, 5, 2});
  ctorch::SnapshotSlotOptions slot;
  slot.path = path;
  ctorch::saveSnapshot(snap, slot);
  const auto r = python({"inspect", path.string()});
  CHECK_FALSE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("AssertionError"));
}

TEST_CASE("a snapshot rewritten by Python loads in C++ but Python edits without a new digest do not",
          "[snapshot][python]") {
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 with torch (python3-torch) is not installed");
  TempDir dir("snap-py-resave");
  const auto path = dir / "snapshot.pt";
  // Two parameter groups: Python pickles a one-element list with the APPEND opcode, which
  // LibTorch 1.13's unpickler lacks (see the next test); every list here has two or more elements.
  auto model = torch::nn::Sequential(torch::nn::Linear(3, 2), torch::nn::Linear(2, 2));
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model[0]->parameters());
  groups.emplace_back(model[1]->parameters(), std::make_unique<torch::optim::AdamOptions>(0.5));
  torch::optim::Adam adam(groups, torch::optim::AdamOptions(0.01));
  stepWith(*model, adam, 0.5);
  auto snap = ctorch::captureSnapshot({model.ptr().get(), &adam, nullptr}, identity(), {4, 0, 1});
  ctorch::SnapshotSlotOptions slot;
  slot.path = path;
  ctorch::saveSnapshot(snap, slot);
  const auto original = ctorch::loadSnapshot(path);

  REQUIRE(python({"rewrite", path.string(), (dir / "resaved.pt").string(),
                  (dir / "tampered.pt").string()}).ok());
  const auto resaved = ctorch::loadSnapshot(dir / "resaved.pt");
  CHECK(resaved.header.contentDigest == original.header.contentDigest);
  CHECK(resaved.epochsRun == 4);
  for (const auto& e : original.modelState) CHECK(sameTensorBytes(resaved.modelState.at(e.key()), e.value()));
  std::vector<torch::optim::OptimizerParamGroup> groups2;
  groups2.emplace_back(model[0]->parameters());
  groups2.emplace_back(model[1]->parameters());
  torch::optim::Adam adam2(groups2, torch::optim::AdamOptions(0.001));
  CHECK_NOTHROW(ctorch::restoreSnapshot(resaved, {model.ptr().get(), &adam2, nullptr}));
  CHECK(static_cast<torch::optim::AdamOptions&>(adam2.param_groups()[1].options()).lr() == 0.5);

  try {
    ctorch::loadSnapshot(dir / "tampered.pt");
    FAIL("an edited snapshot was accepted");
  } catch (const ctorch::SnapshotCorrupt& e) {
    CHECK(e.kind() == ctorch::SnapshotCorrupt::Kind::Digest);
    CHECK_THAT(e.what(), Catch::Contains("tampered.pt"));
  }
}

TEST_CASE("a Python rewrite this LibTorch cannot unpickle is named with the reason",
          "[snapshot][python]") {
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 with torch (python3-torch) is not installed");
  TempDir dir("snap-py-append");
  const auto path = dir / "snapshot.pt";
  writeInteropSnapshot("SGD", path);  // one parameter group: a one-element list
  REQUIRE(python({"resave", path.string(), (dir / "resaved.pt").string()}).ok());
  try {
    const auto s = ctorch::loadSnapshot(dir / "resaved.pt");
    CHECK(s.epochsRun == 4);  // a LibTorch with the APPEND opcode reads it
  } catch (const ctorch::SnapshotCorrupt& e) {
    CHECK(e.kind() == ctorch::SnapshotCorrupt::Kind::Foreign);
    CHECK_THAT(e.what(), Catch::Contains("APPEND for a one-element list"));
  }
}

TEST_CASE("files Python writes that are not snapshots are named as foreign", "[snapshot][python]") {
  if (!havePythonTorch()) CTORCH_SKIP("/usr/bin/python3 with torch (python3-torch) is not installed");
  TempDir dir("snap-py-foreign");
  struct Case {
    const char* mode;
    const char* expect;
  };
  REQUIRE(python({"others", dir.path().string()}).ok());
  for (const Case c : {Case{"foreign", "dict with keys [weights, epoch]"},
                       Case{"legacy", "legacy (pre-zip) torch.save"},
                       Case{"module", "global torch.nn.modules.linear.Linear is not one a snapshot holds"}}) {
    INFO(c.mode);
    const auto file = dir / (std::string(c.mode) + ".pt");
    try {
      ctorch::loadSnapshot(file);
      FAIL("accepted a file that is not a snapshot");
    } catch (const ctorch::SnapshotCorrupt& e) {
      CHECK(e.kind() == ctorch::SnapshotCorrupt::Kind::Foreign);
      CHECK_THAT(e.what(), Catch::Contains(file.string()) && Catch::Contains(c.expect));
    }
  }
}
