// The CUDA / NCCL paths, for a GPU machine (CTest label cuda; scripts/gpu/run.sh runs them there).
// Without a CUDA device every test skips, saying so.
//  - DDP on CUDA ends bit-identical to one process replaying every rank's shard: world 1 on NCCL
//    (fp32, bfloat16 autocast, float16 autocast with the GradScaler), world 2 on one GPU with Gloo on
//    CUDA tensors, world 2 on NCCL (on one GPU NCCL refuses two ranks, "Duplicate GPU detected",
//    unless it is >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1: the test records which happened).
//  - `ctorchrun --nproc-per-node gpu`: one worker per GPU, cuda:LOCAL_RANK its device.
//  - Snapshots: the CUDA generator states go into the file and come back; a snapshot written on CUDA
//    resumes on the CPU and back, bit-identically.
//  - The float16 GradScaler on CUDA (LibTorch's AMP kernels) takes the decisions and produces the
//    values of its CPU twin (tests/amp checks that one against Python's rules).
//  - CUDA graphs of the whole step (ctorch/cuda_graph.hpp): DDP on NCCL, SGD with momentum, fp32,
//    bfloat16 autocast and float16 with the GradScaler (an inf batch among the replays): the graphed
//    replica equals an eager one bit for bit after every step (warm-up, capture, replays, an eager
//    step of another shape, replays again); on Gloo the graph refuses DDP with the reason.
//  - A SIGKILLed worker under NCCL, with --max-restarts 1 (group restart) and --recovery in-place:
//    how long the survivor takes to notice is printed; needs two NCCL ranks (two GPUs, or one that
//    NCCL lets two ranks share).
// Exactness on CUDA needs deterministic kernels: cuDNN deterministic, no benchmark, and
// CUBLAS_WORKSPACE_CONFIG=:4096:8 in every worker. Two ranks' average (g0 + g1) / 2 is exact in
// any order, so 0 is the tolerance everywhere.
// CTORCH_CUDA_TESTS_ON_CPU=1 runs the tests that can on the CPU in place of CUDA (Gloo instead of
// NCCL): the harness's own check on a machine without a GPU. CTest never sets it.
#include "ctorch_catch.hpp"

#include "cuda_test_util.hpp"
#include "multiproc.hpp"
#include "test_models.hpp"
#include "trainer_test_util.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/cuda_graph.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/snapshot.hpp>

#include <ATen/Context.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <regex>
#include <sstream>

using namespace ctorch::test;
using traintest::fs::path;

using namespace cudatest;

namespace {

// ---- models ---------------------------------------------------------------------------------------
using ctorch::test::Mlp;  // tests/support/test_models.hpp

struct ConvBnImpl : torch::nn::Module {
  ConvBnImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 6, 3).padding(1)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(6));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 6, 3).padding(1)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(6));
    fc = register_module("fc", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(bn1(conv1(x)));
    h = torch::relu(bn2(conv2(h)));
    return fc(h.mean({2, 3}));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvBn);

constexpr int kPerRank = 8;

struct Batch {
  torch::Tensor x, y;
};

// The global batch of `step`, the same on every rank (made on the CPU, then moved); rank r's rows.
Batch shard(bool conv, int step, int rank, int world, const torch::Device& device) {
  torch::manual_seed(1000 + step);
  const int64_t n = static_cast<int64_t>(world) * kPerRank;
  auto x = conv ? torch::randn({n, 2, 6, 6}) : torch::randn({n, 10});
  auto y = torch::randn({n, 3});
  auto rows = [&](const torch::Tensor& t) { return t.narrow(0, rank * kPerRank, kPerRank).contiguous().to(device); };
  return {rows(x), rows(y)};
}

void assign(std::vector<torch::Tensor> dst, const std::vector<torch::Tensor>& src) {
  torch::NoGradGuard noGrad;
  for (size_t i = 0; i < dst.size(); ++i) dst[i].copy_(src[i]);
}
std::vector<torch::Tensor> clones(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.defined() ? t.detach().clone() : torch::Tensor());
  return out;
}
std::vector<torch::Tensor> grads(const std::vector<torch::Tensor>& ps) {
  std::vector<torch::Tensor> out;
  for (const auto& p : ps) out.push_back(p.grad().defined() ? p.grad().detach().clone() : torch::Tensor());
  return out;
}
double maxDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i)
    d = std::max(d, (a[i].to(torch::kCPU, torch::kDouble) - b[i].to(torch::kCPU, torch::kDouble)).abs().max().item<double>());
  return d;
}

struct Precision {
  std::optional<torch::ScalarType> autocast;  // none: float32
  bool scaler = false;                        // float16: the GradScaler on both sides
};

Precision precisionFrom(const std::string& name) {
  if (name == "bf16") return {torch::kBFloat16, false};
  if (name == "fp16") return {torch::kHalf, true};
  return {};
}

// DDP on this rank against the reference replaying every rank's shard in this process (gradients
// g_r * (1/N) summed in rank order, as the Reducer does), both on `device`, same precision.
// broadcastBuffers(false): each rank's BatchNorm statistics follow its own shard, as the reference's
// per-rank copies do. Prints the differences; returns whether they are 0.
template <class Net>
bool ddpEqualsOneProcess(const Net& proto, const Precision& precision, int steps, bool conv, bool control) {
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  const auto device = testDevice(ctorch::getLocalRank());
  torch::manual_seed(7 + rank);  // different initial weights on every rank: DDP broadcasts rank 0's
  auto model = proto();
  model->to(device);
  ctorch::DistributedDataParallel ddp(model, ctorch::DDPOptions().broadcastBuffers(false));
  auto ref = proto();
  ref->to(device);
  assign(ref->parameters(), model->parameters());
  assign(ref->buffers(), model->buffers());
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::optim::SGD optDdp(ddp.parameters(), sgd), optRef(ref->parameters(), sgd);
  // A small initial scale that grows every 2 clean steps, so scaling changes during the run.
  const auto scalerOptions =
      ctorch::amp::GradScalerOptions().enabled(precision.scaler).initScale(256).growthInterval(2);
  ctorch::amp::GradScaler scalerDdp(device, scalerOptions), scalerRef(device, scalerOptions);
  const auto autocastType = precision.autocast.value_or(torch::kBFloat16);
  std::vector<std::vector<torch::Tensor>> rankBuffers(world, clones(model->buffers()));

  for (int step = 0; step < steps; ++step) {
    ddp.zeroGrad();
    auto b = shard(conv, step, rank, world, device);
    torch::Tensor loss;
    std::optional<ctorch::NoSyncGuard> noSync;  // the control: gradients never averaged
    if (control) noSync.emplace(ddp.noSync());
    {
      ctorch::amp::Autocast ac(device.type(), autocastType, precision.autocast.has_value());
      loss = torch::mse_loss(ddp(b.x).to(torch::kFloat), b.y);
    }
    scalerDdp.scale(loss).backward();
    noSync.reset();
    scalerDdp.step(optDdp);
    scalerDdp.update();

    auto refParams = ref->parameters();
    std::vector<torch::Tensor> avg(refParams.size());
    for (int r = 0; r < world; ++r) {
      for (auto& p : refParams) p.mutable_grad() = torch::Tensor();
      assign(ref->buffers(), rankBuffers[r]);
      auto u = shard(conv, step, r, world, device);
      torch::Tensor refLoss;
      {
        ctorch::amp::Autocast ac(device.type(), autocastType, precision.autocast.has_value());
        refLoss = torch::mse_loss(ref->forward(u.x).to(torch::kFloat), u.y);
      }
      scalerRef.scale(refLoss).backward();
      rankBuffers[r] = clones(ref->buffers());
      const auto g = grads(refParams);
      for (size_t i = 0; i < g.size(); ++i) {
        auto part = g[i] * (1.0 / world);
        avg[i] = avg[i].defined() ? avg[i] + part : part;
      }
    }
    for (size_t i = 0; i < refParams.size(); ++i) refParams[i].mutable_grad() = avg[i];
    scalerRef.step(optRef);
    scalerRef.update();
  }
  const double params = maxDiff(model->parameters(), ref->parameters());
  const auto mine = model->buffers();
  const double buffers = mine.empty() ? 0.0 : maxDiff(mine, rankBuffers[rank]);
  std::cout << "rank " << rank << "/" << world << " on " << device.str() << " backend " << ctorch::getBackendName()
            << (precision.autocast ? " autocast " + ctorch::amp::dtypeName(*precision.autocast) : std::string(" float32"))
            << ": max difference params " << params << " buffers " << buffers;
  if (precision.scaler) std::cout << " scale " << scalerDdp.currentScale() << " vs " << scalerRef.currentScale();
  std::cout << std::endl;
  return params == 0.0 && buffers == 0.0 && scalerDdp.currentScale() == scalerRef.currentScale();
}

}  // namespace

// args: backend=nccl|gloo, model=mlp|convbn, precision=fp32|bf16|fp16, steps=N, control=1 (DDP never
// averages: the comparison must see it; exits 0 whatever it sees)
CTORCH_TEST_WORKER(cuda_ddp_equal) {
  deterministic();
  auto backend = arg(args, "backend", "nccl") == "gloo" ? ctorch::Backend::kGloo : ctorch::Backend::kNccl;
  if (!haveCuda()) backend = ctorch::Backend::kGloo;  // the CPU standing in: Gloo
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().backend(backend).timeout(std::chrono::seconds(60)));
  const auto precision = precisionFrom(arg(args, "precision", "fp32"));
  const int steps = std::stoi(arg(args, "steps", "4"));
  const bool control = arg(args, "control", "0") == "1";
  const bool ok = arg(args, "model", "mlp") == "convbn"
                      ? ddpEqualsOneProcess([] { return ConvBn(); }, precision, steps, true, control)
                      : ddpEqualsOneProcess([] { return Mlp(); }, precision, steps, false, control);
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return ok || control ? 0 : 1;
}

// One worker of `ctorchrun --nproc-per-node gpu`: what it was given and which device it got.
CTORCH_TEST_WORKER(report_device) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const auto current = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
  std::vector<at::Tensor> ts{torch::ones({1}, torch::TensorOptions().device(current))};
  ctorch::getDefaultGroup()->allreduce(ts)->wait();  // a collective on it
  const auto& t = ts[0];
  std::cout << "report rank " << ctorch::getRank() << " local " << ctorch::getLocalRank() << " world "
            << ctorch::getWorldSize() << " local_world " << ctorch::getLocalWorldSize() << " backend "
            << ctorch::getBackendName() << " device " << current.str() << " sum " << t.item<float>() << std::endl;
  ctorch::destroyProcessGroup();
  return 0;
}

// Two ranks, one NCCL allreduce: does this NCCL let them run here?
CTORCH_TEST_WORKER(nccl_probe) {
  ctorch::initProcessGroup(
      ctorch::ProcessGroupOptions().backend(ctorch::Backend::kNccl).timeout(std::chrono::seconds(30)));
  std::vector<at::Tensor> t{torch::ones({4}, torch::TensorOptions().device(testDevice(ctorch::getLocalRank())))};
  ctorch::getDefaultGroup()->allreduce(t)->wait();
  std::cout << "nccl probe sum " << t[0][0].item<float>() << std::endl;
  ctorch::destroyProcessGroup();
  return 0;
}

namespace {

std::vector<ProcessResult> ddpGroup(int world, const std::vector<std::string>& args,
                                    std::map<std::string, std::string> extraEnv = {}) {
  auto env = workerEnv();
  env.insert(extraEnv.begin(), extraEnv.end());
  return runWorkerGroup({.worker = "cuda_ddp_equal", .worldSize = world, .args = args, .env = env,
                         .timeout = std::chrono::seconds(60)});
}

void requireExact(const std::vector<ProcessResult>& results) {
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("max difference params 0 buffers 0"));
  }
}

bool mentionsDuplicateGpu(const std::string& text) {
  static const std::regex pattern("Duplicate GPU|ncclInvalidUsage|invalid usage", std::regex::icase);
  return std::regex_search(text, pattern);
}

}  // namespace

TEST_CASE("cuda: DDP on NCCL, world 1, is bit-identical to one process (MLP, conv net with BatchNorm)", "[cuda]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  for (const char* model : {"model=mlp", "model=convbn"}) requireExact(ddpGroup(1, {"backend=nccl", model}));
}

TEST_CASE("cuda: bfloat16 autocast and float16 autocast with the GradScaler under DDP equal one process", "[cuda]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  requireExact(ddpGroup(1, {"backend=nccl", "model=mlp", "precision=bf16"}));
  requireExact(ddpGroup(1, {"backend=nccl", "model=convbn", "precision=bf16"}));
  if (!haveCuda() && !ctorch::amp::autocastSupported(torch::kCPU, torch::kHalf)) {
    WARN("float16 autocast: not on this LibTorch's CPU; runs on CUDA");
    return;
  }
  const auto results = ddpGroup(1, {"backend=nccl", "model=mlp", "precision=fp16", "steps=6"});
  requireExact(results);
  CHECK_THAT(results[0].output, Catch::Contains("autocast float16"));
}

TEST_CASE("cuda: DDP, world 2 on one GPU with Gloo on CUDA tensors, is bit-identical to one process", "[cuda]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  for (const char* model : {"model=mlp", "model=convbn"}) requireExact(ddpGroup(2, {"backend=gloo", model}));
  requireExact(ddpGroup(2, {"backend=gloo", "model=mlp", "precision=bf16"}));
  // Control: without averaging, the same comparison sees the ranks' own gradients.
  const auto control = ddpGroup(2, {"backend=gloo", "model=mlp", "control=1"});
  requireAllOk(control);
  for (const auto& r : control) CHECK_THAT(r.output, !Catch::Contains("max difference params 0 "));
}

TEST_CASE("cuda: DDP, world 2 on NCCL: exact, or NCCL's refusal of two ranks on one GPU recorded", "[cuda]") {
  REQUIRE_GPU();
  // NCCL 2.30's experimental switch; older NCCL ignores it and refuses ("Duplicate GPU detected").
  const auto results =
      ddpGroup(2, {"backend=nccl", "model=mlp"}, {{"NCCL_MULTI_RANK_GPU_ENABLE", "1"}, {"NCCL_DEBUG", "WARN"}});
  bool allOk = true;
  std::string all;
  for (const auto& r : results) {
    allOk = allOk && r.ok();
    all += r.describe() + "\n" + r.output + "\n";
    INFO(r.describe() << "\n" << r.output);
    CHECK_FALSE(r.timedOut);  // a refusal must be an error, not a hang
  }
  if (allOk) {
    requireExact(results);
    std::cout << "RECORDED: NCCL ran 2 ranks on " << gpuCount() << " GPU(s), bit-identical to one process" << std::endl;
    return;
  }
  INFO(all);
  REQUIRE(gpuCount() == 1);  // with a GPU per rank, NCCL has no reason to refuse
  REQUIRE(mentionsDuplicateGpu(all));
  std::cout << "RECORDED: NCCL refuses two ranks on one GPU here (Duplicate GPU / invalid usage), as an error, "
               "no hang"
            << std::endl;
  WARN("RECORDED: NCCL refused two ranks on one GPU");
}

TEST_CASE("cuda: ctorchrun --nproc-per-node gpu starts one worker per GPU, each on cuda:LOCAL_RANK", "[cuda]") {
  REQUIRE_GPU();
  TempDir dir("cuda-nproc-gpu");
  SpawnOptions o;
  o.argv = {traintest::launcherExe(), "--standalone", "--nproc-per-node", "gpu", "--log-dir",
            (dir / "logs").string(), selfExe().string(), "--ctorch-worker", "report_device"};
  o.unsetEnv = traintest::launcherVariables();
  o.timeout = std::chrono::seconds(120);
  const auto r = ctorch::test::run(o);
  INFO(traintest::show(r));
  REQUIRE(r.ok());
  const int n = gpuCount();
  const std::regex line(R"(report rank (\d+) local (\d+) world (\d+) local_world (\d+) backend (\w+) device (\S+) sum (\S+))");
  int seen = 0;
  for (auto it = std::sregex_iterator(r.output.begin(), r.output.end(), line); it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    ++seen;
    const int local = std::stoi(m[2]);
    CHECK(std::stoi(m[3]) == n);
    CHECK(std::stoi(m[4]) == n);
    CHECK(m[5] == "nccl");
    CHECK(m[6] == "cuda:" + std::to_string(n == 1 ? 0 : local));
    CHECK(std::stof(m[7]) == static_cast<float>(n));
  }
  CHECK(seen == n);
  std::cout << "RECORDED: --nproc-per-node gpu started " << seen << " worker(s) for " << n << " GPU(s)" << std::endl;
}

TEST_CASE("cuda: the CUDA generator states go into a snapshot and come back from the file", "[cuda]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  const auto device = testDevice();
  torch::manual_seed(5);  // seeds every CUDA generator too
  torch::nn::Linear model(2, 2);
  ctorch::SnapshotIdentity id;
  id.modelName = "rng";
  auto snap = ctorch::captureSnapshot({model.get()}, id, {});
  CHECK(snap.rng.cuda.size() == static_cast<size_t>(gpuCount()));
  const auto a = torch::rand({64}, torch::TensorOptions().device(device));
  const auto back = ctorch::decodeSnapshot(ctorch::encodeSnapshot(snap), "rng.pt");
  REQUIRE(back.rng.cuda.size() == snap.rng.cuda.size());
  const auto moved = torch::rand({64}, torch::TensorOptions().device(device));
  CHECK_FALSE(torch::equal(a, moved));  // control: the generator moved on
  ctorch::restoreRngState(back.rng);
  const auto b = torch::rand({64}, torch::TensorOptions().device(device));
  CHECK(torch::equal(a, b));
}

namespace {

// Model and optimizer state of two snapshots, compared bit for bit.
std::string stateDifference(const ctorch::Snapshot& a, const ctorch::Snapshot& b) {
  std::string why;
  if (!ivalueEqual(c10::IValue(a.modelState), c10::IValue(b.modelState), "MODEL_STATE", why)) return why;
  if (!ivalueEqual(c10::IValue(a.optimizerState), c10::IValue(b.optimizerState), "OPTIMIZER_STATE", why)) return why;
  return "";
}

void trainSteps(ConvBn& model, torch::optim::Optimizer& opt, int from, int count, const torch::Device& device) {
  for (int s = from; s < from + count; ++s) {
    auto b = shard(true, s, 0, 1, device);
    opt.zero_grad();
    torch::mse_loss(model->forward(b.x), b.y).backward();
    opt.step();
  }
}

}  // namespace

TEST_CASE("cuda: a snapshot written on CUDA resumes on the CPU and back on CUDA bit-identically", "[cuda]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  deterministic();
  const auto device = testDevice();
  auto make = [] {
    torch::manual_seed(3);
    return ConvBn();
  };
  const auto adam = torch::optim::AdamOptions(1e-2);
  ctorch::SnapshotIdentity id;
  id.modelName = "convbn";
  auto snapshotOf = [&](ConvBn& m, torch::optim::Optimizer& o) {
    auto snap = ctorch::captureSnapshot({m.get(), &o}, id, {0, 3, 3});
    return ctorch::decodeSnapshot(ctorch::encodeSnapshot(snap), "convbn.pt");
  };

  auto gpu = make();
  gpu->to(device);
  torch::optim::Adam optGpu(gpu->parameters(), adam);
  trainSteps(gpu, optGpu, 0, 3, device);
  const auto written = snapshotOf(gpu, optGpu);

  // On the CPU: the same bytes.
  auto cpu = make();
  torch::optim::Adam optCpu(cpu->parameters(), adam);
  ctorch::restoreSnapshot(written, {cpu.get(), &optCpu}, {.rng = false});
  for (const auto& p : cpu->parameters()) CHECK(p.device().is_cpu());
  const auto onCpu = snapshotOf(cpu, optCpu);
  CHECK(stateDifference(written, onCpu).empty());

  // Back on CUDA from the CPU's snapshot: the same bytes, and training goes on as if never moved.
  auto back = make();
  back->to(device);
  torch::optim::Adam optBack(back->parameters(), adam);
  ctorch::restoreSnapshot(onCpu, {back.get(), &optBack}, {.rng = false});
  for (const auto& p : back->parameters()) CHECK(p.device() == device);
  CHECK(stateDifference(written, snapshotOf(back, optBack)).empty());
  trainSteps(gpu, optGpu, 3, 2, device);
  trainSteps(back, optBack, 3, 2, device);
  const auto after = snapshotOf(gpu, optGpu);
  CHECK(stateDifference(after, snapshotOf(back, optBack)).empty());
  // Control: the comparison sees the two extra steps.
  CHECK_FALSE(stateDifference(after, written).empty());
}

TEST_CASE("cuda: the float16 GradScaler on CUDA takes its CPU twin's decisions and values", "[cuda]") {
  REQUIRE_GPU();
  const auto options = ctorch::amp::GradScalerOptions().initScale(1024).growthInterval(2);
  torch::Tensor pg = torch::zeros({5}, torch::TensorOptions().device(testDevice()).requires_grad(true));
  torch::Tensor pc = torch::zeros({5}, torch::requires_grad());
  torch::optim::SGD og({pg}, torch::optim::SGDOptions(0.5).momentum(0.9)), oc({pc}, torch::optim::SGDOptions(0.5).momentum(0.9));
  ctorch::amp::GradScaler sg(testDevice(), options), sc(torch::kCPU, options);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  torch::manual_seed(9);
  for (int step = 0; step < 10; ++step) {
    auto g = torch::randn({5}) * 1000;
    if (step == 2) g[1] = inf;
    if (step == 5) g[3] = nan;
    pg.mutable_grad() = g.to(pg.device());
    pc.mutable_grad() = g.clone();
    const bool a = sg.step(og), b = sc.step(oc);
    INFO("step " << step);
    CHECK(a == b);
    CHECK(a == (step != 2 && step != 5));
    if (a) CHECK(torch::equal(pg.grad().cpu(), pc.grad()));
    sg.update();
    sc.update();
    CHECK(sg.currentScale() == sc.currentScale());
    CHECK(sg.growthTracker() == sc.growthTracker());
    CHECK(torch::equal(pg.detach().cpu(), pc.detach()));
  }
  std::cout << "RECORDED: GradScaler CUDA == CPU over 10 steps, final scale " << sg.currentScale() << std::endl;
}

// ---- a killed worker under NCCL ----------------------------------------------------------------------

namespace {

const std::vector<std::string> kToyCuda = {
    "--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size", "1024", "--batch-size", "16",
    "--test-limit", "64", "--log-interval", "4", "--lr", "0.05", "--device", "cuda", "--backend", "nccl",
    "--epochs", "2", "--save-every-steps", "5", "--timeout", "20"};

// Whether two NCCL ranks can run on this machine (one GPU each, or one GPU NCCL lets them share).
std::optional<std::string> twoNcclRanksRefused() {
  if (gpuCount() >= 2) return std::nullopt;
  auto env = workerEnv();
  env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1";
  env["NCCL_DEBUG"] = "WARN";
  const auto results = runWorkerGroup({.worker = "nccl_probe", .worldSize = 2, .env = env,
                                       .timeout = std::chrono::seconds(40)});
  bool ok = true;
  std::string all;
  for (const auto& r : results) {
    ok = ok && r.ok();
    all += r.output;
  }
  if (ok) return std::nullopt;
  return "two NCCL ranks cannot run here: one GPU, and this NCCL refuses to share it" +
         std::string(mentionsDuplicateGpu(all) ? " (Duplicate GPU)" : " (" + all.substr(0, 200) + ")");
}

// Kills rank 1 once a snapshot at global step >= 10 is written; returns the launcher's result and
// the seconds from the kill to the end.
std::pair<ProcessResult, double> killOneUnderNccl(const path& dir, const std::vector<std::string>& launcherArgs) {
  std::vector<std::string> args = kToyCuda;
  args.push_back("--log-saves");  // a line for every save, mid-epoch ones included
  Process p(traintest::trainUnderLauncher(dir, 2, args, launcherArgs, std::chrono::seconds(170)));
  std::string seen;
  const auto m = traintest::waitForOutput(
      p, std::regex(R"(snapshot written: \S*snapshot\.pt \([^,]*, global step (1\d|[2-9]\d))"),
      std::chrono::seconds(120), &seen);
  INFO(seen);
  REQUIRE(m);
  int pid = -1;
  for (int i = 0; i < 200 && pid < 0; ++i) {
    pid = traintest::findWorkerPid(dir, 1);
    if (pid < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(pid > 0);
  const auto killedAt = std::chrono::steady_clock::now();
  REQUIRE(::kill(pid, SIGKILL) == 0);
  auto r = p.wait();
  return {r, std::chrono::duration<double>(std::chrono::steady_clock::now() - killedAt).count()};
}

}  // namespace

TEST_CASE("cuda: a SIGKILLed worker under NCCL: the group restarts (--max-restarts 1), or is replaced in place",
          "[cuda]") {
  REQUIRE_GPU();
  if (const auto why = twoNcclRanksRefused()) CTORCH_SKIP(*why);
  TempDir reference("cuda-kill-ref");
  REQUIRE(ctorch::test::run(traintest::trainUnderLauncher(reference.path(), 2, kToyCuda)).ok());

  SECTION("group restart") {
    TempDir dir("cuda-kill-restart");
    const auto [r, seconds] = killOneUnderNccl(dir.path(), {"--max-restarts", "1"});
    INFO(traintest::show(r));
    REQUIRE(r.ok());
    CHECK(r.output.find("attempt 2") != std::string::npos);
    CHECK(traintest::bitDifference(dir / "model.pt", reference / "model.pt").empty());
    std::cout << "RECORDED: NCCL group restart after SIGKILL: run ended " << seconds << " s after the kill" << std::endl;
  }
  SECTION("in place") {
    TempDir dir("cuda-kill-inplace");
    const auto [r, seconds] = killOneUnderNccl(dir.path(), {"--max-restarts", "1", "--recovery", "in-place"});
    INFO(traintest::show(r));
    const bool timedOut = r.output.find("timed out") != std::string::npos ||
                          r.output.find("Watchdog") != std::string::npos;
    std::cout << "RECORDED: NCCL in-place recovery after SIGKILL: " << r.describe() << ", ended " << seconds
              << " s after the kill; the survivor " << (timedOut ? "waited for its collective timeout" : "failed fast")
              << std::endl;
    REQUIRE(r.ok());
    CHECK(traintest::bitDifference(dir / "model.pt", reference / "model.pt").empty());
  }
}

// ---- CUDA graphs of the whole training step ------------------------------------------------------------

namespace {

struct Replica {
  Mlp model;
  std::unique_ptr<ctorch::CudaGraphStep> graphed;  // null: the eager twin
  std::unique_ptr<ctorch::DistributedDataParallel<Mlp>> ddp;
  std::unique_ptr<torch::optim::SGD> sgd;
  std::unique_ptr<ctorch::amp::GradScaler> scaler;
};

std::unique_ptr<Replica> makeReplica(const torch::Device& device, const Precision& precision, bool graphed) {
  torch::manual_seed(11);
  auto r = std::make_unique<Replica>();
  r->model->to(device);
  if (graphed)
    r->graphed = std::make_unique<ctorch::CudaGraphStep>(r->model->parameters(), ctorch::CudaGraphOptions().warmupSteps(11));
  {
    // DDP keeps the gradient accumulators: their backward runs on the stream current here.
    std::optional<ctorch::CudaGraphStep::StreamScope> scope;
    if (graphed) scope.emplace(r->graphed->sideStream(device));
    r->ddp = std::make_unique<ctorch::DistributedDataParallel<Mlp>>(r->model, ctorch::DDPOptions().broadcastBuffers(false));
  }
  r->sgd = std::make_unique<torch::optim::SGD>(r->ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  r->scaler = std::make_unique<ctorch::amp::GradScaler>(
      device, ctorch::amp::GradScalerOptions().enabled(precision.scaler).initScale(256).growthInterval(3));
  if (graphed)
    r->graphed->add(ctorch::graphParticipant(*r->ddp))
        .add(ctorch::graphParticipant(*r->scaler))
        .add(ctorch::graphParticipant(*r->sgd));
  return r;
}

// One step: no host synchronisation inside (it may be captured); the loss comes back detached.
std::vector<torch::Tensor> trainingStep(Replica& r, const Precision& precision, const std::vector<torch::Tensor>& in) {
  r.ddp->zeroGrad();
  torch::Tensor loss;
  {
    ctorch::amp::Autocast ac(in[0].device().type(), precision.autocast.value_or(torch::kBFloat16),
                             precision.autocast.has_value());
    loss = torch::mse_loss((*r.ddp)(in[0]).to(torch::kFloat), in[1]);
  }
  r.scaler->scale(loss).backward();
  r.scaler->step(*r.sgd);
  r.scaler->update();
  return {loss.detach()};
}

} // namespace

// args: backend=nccl|gloo, precision=fp32|bf16|fp16, steps=N. A step's batch is `kPerRank` rows but
// step 15's (a smaller last batch: eager, the graph kept); with fp16, step 13's inputs hold an inf
// (a replayed step the GradScaler must skip). Prints a line per step, then the totals.
CTORCH_TEST_WORKER(cuda_graph_equal) {
  deterministic();
  auto backend = arg(args, "backend", "nccl") == "gloo" || !haveCuda() ? ctorch::Backend::kGloo : ctorch::Backend::kNccl;
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().backend(backend).timeout(std::chrono::seconds(60)));
  const auto device = testDevice(ctorch::getLocalRank());
  const auto precision = precisionFrom(arg(args, "precision", "fp32"));
  const int steps = std::stoi(arg(args, "steps", "20"));
  auto eager = makeReplica(device, precision, false);
  auto graph = makeReplica(device, precision, true);
  double worst = 0.0;
  for (int step = 0; step < steps; ++step) {
    auto b = shard(false, step, ctorch::getRank(), ctorch::getWorldSize(), device);
    if (step == 15) b = {b.x.narrow(0, 0, kPerRank / 2).contiguous(), b.y.narrow(0, 0, kPerRank / 2).contiguous()};
    if (step == 13 && precision.scaler) b.x[0][0] = std::numeric_limits<float>::infinity();
    const auto lossEager = trainingStep(*eager, precision, {b.x, b.y}).at(0);
    const auto lossGraph = graph->graphed->run({b.x, b.y}, [&](const std::vector<torch::Tensor>& in) {
      return trainingStep(*graph, precision, in);
    }).at(0);
    const double params = maxDiff(eager->model->parameters(), graph->model->parameters());
    const bool lossSame = torch::equal(lossEager.cpu(), lossGraph.cpu()) ||
                          (!std::isfinite(lossEager.item<double>()) && !std::isfinite(lossGraph.item<double>()));
    worst = std::max(worst, lossSame ? params : std::numeric_limits<double>::infinity());
    const auto& d = graph->graphed->lastDecision();
    std::cout << "step " << step << " " << ctorch::cuda_graph::toString(d.action) << " loss " << lossGraph.item<double>()
              << " params diff " << params << (lossSame ? "" : " LOSS DIFFERS") << (d.reason.empty() ? "" : " (" + d.reason + ")")
              << std::endl;
  }
  std::cout << "graph totals: captures " << graph->graphed->captures() << " replays " << graph->graphed->replays()
            << " scale " << graph->scaler->currentScale() << " vs " << eager->scaler->currentScale()
            << " max difference " << worst << std::endl;
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return worst == 0.0 && graph->scaler->currentScale() == eager->scaler->currentScale() ? 0 : 1;
}

namespace {
std::vector<ProcessResult> graphGroup(const std::vector<std::string>& args) {
  return runWorkerGroup({.worker = "cuda_graph_equal", .worldSize = 1, .args = args, .env = workerEnv(),
                         .timeout = std::chrono::seconds(90)});
}
} // namespace

TEST_CASE("cuda: CUDA graphs of the whole step (DDP on NCCL, SGD, autocast, GradScaler) equal eager steps bit for bit",
          "[cuda]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  for (const char* precision : {"precision=fp32", "precision=bf16", "precision=fp16"}) {
    if (!haveCuda() && std::string(precision) == "precision=fp16" &&
        !ctorch::amp::autocastSupported(torch::kCPU, torch::kHalf))
      continue;
    const auto results = graphGroup({"backend=nccl", precision});
    requireAllOk(results);
    const auto& out = results.at(0).output;
    INFO(out);
    CHECK_THAT(out, Catch::Contains("max difference 0"));
    if (!haveCuda() || !ctorch::CudaGraphStep::available()) {
      CHECK_THAT(out, Catch::Contains("captures 0 replays 0"));
      continue;
    }
    // 11 warm-up steps, the capture (replayed once) at step 11, replays but for step 15.
    CHECK_THAT(out, Catch::Contains("step 11 capture"));
    CHECK_THAT(out, Catch::Contains("step 15 warm-up"));
    CHECK_THAT(out, Catch::Contains("step 16 replay"));
    CHECK_THAT(out, Catch::Contains("graph totals: captures 1 replays 8"));
    std::cout << "RECORDED: CUDA graph of the whole step, " << precision << ": bit-identical to eager" << std::endl;
  }
}

TEST_CASE("cuda: a CUDA graph refuses DDP on Gloo (CUDA tensors through the host) and says so", "[cuda]") {
  REQUIRE_GPU();
  const auto results = graphGroup({"backend=gloo", "steps=13"});
  requireAllOk(results);
  const auto& out = results.at(0).output;
  INFO(out);
  CHECK_THAT(out, Catch::Contains("step 12 warm-up loss"));
  CHECK_THAT(out, Catch::Contains("DDP reduces gradients with gloo, which a CUDA graph cannot capture"));
  CHECK_THAT(out, Catch::Contains("captures 0 replays 0"));
}
