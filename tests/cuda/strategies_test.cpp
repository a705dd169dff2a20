// Every strategy on CUDA (CTest label cuda; scripts/gpu/run.sh runs them on a GPU machine), against
// DDP as the CPU suites prove them (tests/sharding, tests/parameter_server), with the same models and
// the same claims:
//  - ZeRO-1 (ZeroRedundancyOptimizer), SGD and Adam: bit-identical to DDP with the whole optimizer.
//  - FSDP, full sharding and SHARD_GRAD_OP, SGD and Adam, float32 and bfloat16 autocast: equal to DDP.
//  - The parameter server, 2 workers + 1 server: bit-identical to DDP on 2 ranks.
//  - The flat reduce-scatter and all-gather: the documented order's bits, the concatenation.
//  - A snapshot of an FSDP run on CUDA (its parameter and optimizer shards) resumes on the CPU and
//    back on CUDA with the state equal bit for bit, and training goes on identically.
// Each runs at world 1 on NCCL and at world 2 on one GPU through Gloo with CUDA tensors (NCCL refuses
// two ranks on one GPU). The parameter server has no world 1 (a worker and a server at least): it
// runs 2 workers + 1 server through Gloo. Without a GPU every test skips; CTORCH_CUDA_TESTS_ON_CPU=1
// runs them on the CPU with Gloo (the harness's own check, where the CPU suites' exactness holds).
//
// Tolerances. ZeRO, the parameter server and the collectives: 0, everywhere (a parameter's update is
// the same operations on the same averaged gradient; at 2 ranks a + b is the only sum there is, and
// x/2 + y/2 = (x + y)/2 exactly). FSDP: 0 on the CPU, as tests/sharding proves. On CUDA, FSDP's
// parameters are views into one flat buffer per unit, at other addresses than DDP's separate
// tensors, and cuBLAS(Lt) picks a GEMM kernel partly by the operands' alignment: another kernel may
// sum the same products in another order (last bits). So on CUDA the check is a bound, and whether
// it was 0 is recorded: float32 1e-5 after 4 steps (last-bit differences of gradients of order 1e-1
// carried through 4 updates of lr 0.1 / 1e-2, as tests/sharding's 3-rank bound), bfloat16 2e-3 (a
// flipped rounding of a bfloat16 GEMM output is 2^-8 relative: ~4e-4 in a gradient of order 1e-1,
// times lr 0.1, 4 steps, with margin); the no-synchronisation control differs by >= 1e-3 in float32.
#include "ctorch_catch.hpp"

#include "cuda_test_util.hpp"
#include "multiproc.hpp"
#include "../ddp/ddp_test_util.hpp"
#include "../sharding/fsdp_net.hpp"
#include "../sharding/small_net.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/flat_collectives.hpp>
#include <ctorch/fully_sharded_data_parallel.hpp>
#include <ctorch/parameter_server.hpp>
#include <ctorch/zero_redundancy_optimizer.hpp>

#include <torch/serialize.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

using namespace ctorch::test;
using namespace cudatest;

namespace {

namespace strategies {

// The backend a worker asks for; the CPU standing in for CUDA has only Gloo.
void initGroup(const std::vector<std::string>& args) {
  auto backend = arg(args, "backend", "nccl") == "gloo" ? ctorch::Backend::kGloo : ctorch::Backend::kNccl;
  if (!haveCuda()) backend = ctorch::Backend::kGloo;
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().backend(backend).timeout(std::chrono::seconds(60)));
}

// Rank `rank`'s batch of `step` for the 12-in, 3-out models, made on the CPU (the same numbers
// whatever the device), then moved.
std::pair<at::Tensor, at::Tensor> batch(std::uint64_t seed, const torch::Device& device) {
  torch::manual_seed(seed);
  auto x = torch::randn({8, 12});
  auto y = torch::randn({8, 3});
  return {x.to(device), y.to(device)};
}

double maxAbsDifference(const at::Tensor& a, const at::Tensor& b) {
  if (torch::equal(a, b)) return 0;
  return (a.to(torch::kCPU, torch::kDouble) - b.to(torch::kCPU, torch::kDouble)).abs().max().item<double>() + 1e-300;
}

// ---- ZeRO-1 ------------------------------------------------------------------------------------------
// tests/sharding/zero_test.cpp's twins on `device`: DDP with the whole optimizer, and DDP with a
// ZeroRedundancyOptimizer of the same kind; the same batches go to both.
struct ZeroTwins {
  ZeroTwins(const std::string& kind, const torch::Device& device) {
    torch::manual_seed(11);
    whole = sharding_test::Net();
    sharded = sharding_test::Net();
    {
      torch::NoGradGuard noGrad;
      for (std::size_t i = 0; i < whole->parameters().size(); ++i) sharded->parameters()[i].copy_(whole->parameters()[i]);
    }
    whole->to(device);
    sharded->to(device);
    ddpWhole = std::make_unique<ctorch::DistributedDataParallel<sharding_test::Net>>(whole);
    ddpSharded = std::make_unique<ctorch::DistributedDataParallel<sharding_test::Net>>(sharded);
    reference = sharding_test::makeOptimizer(kind, ddpWhole->parameters());
    zero = std::make_unique<ctorch::ZeroRedundancyOptimizer>(
        ddpSharded->parameters(), [kind](std::vector<at::Tensor> share) { return sharding_test::makeOptimizer(kind, share); });
  }
  sharding_test::Net whole{nullptr}, sharded{nullptr};
  std::unique_ptr<ctorch::DistributedDataParallel<sharding_test::Net>> ddpWhole, ddpSharded;
  std::unique_ptr<torch::optim::Optimizer> reference;
  std::unique_ptr<ctorch::ZeroRedundancyOptimizer> zero;
};

} // namespace strategies
} // namespace

// args: backend=nccl|gloo optimizer=sgd|adam control=0|1 (the local step without the broadcast).
// Prints "zero step k max difference D" per step.
CTORCH_TEST_WORKER(cuda_zero) {
  using namespace strategies;
  deterministic();
  initGroup(args);
  const int rank = ctorch::getRank();
  const auto device = testDevice(ctorch::getLocalRank());
  const bool control = arg(args, "control", "0") == "1";
  ZeroTwins t(arg(args, "optimizer", "sgd"), device);
  for (int step = 0; step < 4; ++step) {
    const auto [x, y] = batch(1000 + 17 * step + rank, device);
    t.reference->zero_grad();
    torch::mse_loss((*t.ddpWhole)(x), y).backward();
    t.reference->step();
    t.zero->zeroGrad();
    torch::mse_loss((*t.ddpSharded)(x), y).backward();
    if (control) t.zero->localOptimizer()->step();
    else t.zero->step();
    double most = 0;
    const auto a = t.whole->parameters(), b = t.sharded->parameters();
    for (std::size_t i = 0; i < a.size(); ++i) most = std::max(most, maxAbsDifference(a[i], b[i]));
    std::cout << "zero step " << step << " max difference " << most << "\n";
  }
  std::cout << "zero on " << device.str() << " backend " << ctorch::getBackendName() << " world "
            << ctorch::getWorldSize() << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

namespace {
namespace strategies {

// ---- FSDP ----------------------------------------------------------------------------------------------
// tests/sharding/fsdp_test.cpp's pair on `device`: the model behind DDP with the whole optimizer, and
// a copy behind FullyShardedDataParallel with the same optimizer over its shards; optionally both
// forwards under the same autocast.
struct FsdpPair {
  FsdpPair(const std::string& kind, bool reshard, const torch::Device& device) {
    torch::manual_seed(11);
    whole = fsdp_test::Net();
    sharded = fsdp_test::Net();
    {
      torch::NoGradGuard noGrad;
      for (std::size_t i = 0; i < whole->parameters().size(); ++i) sharded->parameters()[i].copy_(whole->parameters()[i]);
    }
    whole->to(device);
    sharded->to(device);
    ddp = std::make_unique<ctorch::DistributedDataParallel<fsdp_test::Net>>(whole);
    for (const auto& p : ddp->parameters())  // tiedA.weight is tiedB.weight: one entry for the optimizer
      if (std::none_of(unique.begin(), unique.end(), [&](const at::Tensor& u) { return u.is_same(p); })) unique.push_back(p);
    reference = sharding_test::makeOptimizer(kind, unique);
    fsdp = std::make_unique<ctorch::FullyShardedDataParallel<fsdp_test::Net>>(
        sharded, ctorch::FSDPOptions().autoWrapPolicy(fsdp_test::netPolicy()).reshardAfterForward(reshard));
    optimizer = sharding_test::makeOptimizer(kind, fsdp->parameters());
  }
  double step(int step, int rank, const torch::Device& device, bool bf16, bool control) {
    const auto [x, y] = batch(1000 + 17 * step + rank, device);
    reference->zero_grad();
    optimizer->zero_grad();
    torch::Tensor a, b;
    {
      ctorch::amp::Autocast region(device.type(), torch::kBFloat16, bf16);
      a = torch::mse_loss((*ddp)(x).to(torch::kFloat), y);
    }
    a.backward();
    fsdp->setRequiresGradientSync(!control);
    {
      ctorch::amp::Autocast region(device.type(), torch::kBFloat16, bf16);
      b = torch::mse_loss((*fsdp)(x).to(torch::kFloat), y);
    }
    b.backward();
    reference->step();
    optimizer->step();
    const auto state = fsdp->fullStateDict();
    double most = 0;
    auto compare = [&](const std::string& name, const at::Tensor& expected) {
      const auto* got = state.find(name);
      most = std::max(most, got == nullptr ? std::numeric_limits<double>::infinity() : maxAbsDifference(*got, expected));
    };
    for (const auto& p : whole->named_parameters()) compare(p.key(), p.value().detach());
    for (const auto& buffer : whole->named_buffers()) compare(buffer.key(), buffer.value());
    return most;
  }
  fsdp_test::Net whole{nullptr}, sharded{nullptr};
  std::unique_ptr<ctorch::DistributedDataParallel<fsdp_test::Net>> ddp;
  std::vector<at::Tensor> unique;
  std::unique_ptr<torch::optim::Optimizer> reference, optimizer;
  std::unique_ptr<ctorch::FullyShardedDataParallel<fsdp_test::Net>> fsdp;
};

} // namespace strategies
} // namespace

// args: backend=nccl|gloo optimizer=sgd|adam reshard=1|0 precision=fp32|bf16 control=0|1 (no gradient
// synchronisation). Prints "fsdp step k max difference D" per step.
CTORCH_TEST_WORKER(cuda_fsdp) {
  using namespace strategies;
  deterministic();
  initGroup(args);
  const int rank = ctorch::getRank();
  const auto device = testDevice(ctorch::getLocalRank());
  const bool bf16 = arg(args, "precision", "fp32") == "bf16", control = arg(args, "control", "0") == "1";
  if (bf16 && !ctorch::amp::autocastSupported(device.type(), torch::kBFloat16)) {
    std::cout << "fsdp: bfloat16 autocast is not supported on " << device.str() << " by this LibTorch\n";
    ctorch::destroyProcessGroup();
    return 3;
  }
  FsdpPair pair(arg(args, "optimizer", "sgd"), arg(args, "reshard", "1") == "1", device);
  for (int step = 0; step < 4; ++step)
    std::cout << "fsdp step " << step << " max difference " << pair.step(step, rank, device, bf16, control) << "\n";
  std::cout << "fsdp on " << device.str() << " backend " << ctorch::getBackendName() << " world "
            << ctorch::getWorldSize() << " shard bytes " << pair.fsdp->localParameterBytes() << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// ---- the parameter server ----------------------------------------------------------------------------

// args: mode=ddp|ps optimizer=sgd|adam control=0|1 (worker 1 trains on worker 0's batch). DDP's rank 0
// and the parameter server's worker 0 print "final <hex of the parameters>". Every rank on one GPU.
CTORCH_TEST_WORKER(cuda_ps) {
  using namespace strategies;
  deterministic();
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().backend(ctorch::Backend::kGloo).timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank();
  const auto device = testDevice(ctorch::getLocalRank());
  const std::string kind = arg(args, "optimizer", "sgd");
  const bool control = arg(args, "control", "0") == "1";
  torch::manual_seed(11 + rank);  // replicas differ: DDP and the PS both start from rank 0's weights
  sharding_test::Net net;
  net->to(device);
  auto cpuCopies = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& p : net->parameters()) out.push_back(p.detach().cpu());
    return out;
  };
  if (arg(args, "mode", "ps") == "ddp") {
    ctorch::DistributedDataParallel<sharding_test::Net> ddp(net);
    auto optimizer = sharding_test::makeOptimizer(kind, ddp.parameters());
    for (int step = 0; step < 4; ++step) {
      optimizer->zero_grad();
      const auto [x, y] = batch(1000 + 17 * step + rank, device);
      torch::mse_loss(ddp(x), y).backward();
      optimizer->step();
    }
    if (rank == 0) std::cout << "final " << ddptest::paramsHex(cpuCopies()) << "\n";
  } else {
    ctorch::ParameterServer ps(
        net->parameters(), [&](std::vector<at::Tensor> share) { return sharding_test::makeOptimizer(kind, share); },
        ctorch::ParameterServerOptions().servers(1));
    if (ps.isServer()) {
      ps.serve();
      std::cout << "server on " << device.str() << " served " << ps.steps() << " steps\n";
    } else {
      ps.pull();
      for (int step = 0; step < 4; ++step) {
        ps.zeroGrad();
        const int w = control && ps.workerIndex() == 1 ? 0 : ps.workerIndex();
        const auto [x, y] = batch(1000 + 17 * step + w, device);
        torch::mse_loss(net(x), y).backward();
        ps.step();
      }
      ps.finish();
      if (ps.workerIndex() == 0) std::cout << "final " << ddptest::paramsHex(cpuCopies()) << "\n";
    }
  }
  std::cout << std::flush;
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// ---- the flat collectives ----------------------------------------------------------------------------

// args: backend=nccl|gloo. One line per check: "<collective> <dtype> m=<n>: <verdict>".
CTORCH_TEST_WORKER(cuda_flat) {
  strategies::initGroup(args);
  const auto group = ctorch::getDefaultGroup();
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  const auto device = testDevice(ctorch::getLocalRank());
  for (const auto dtype : {torch::kFloat32, torch::kFloat64})
    for (const std::int64_t m : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1000}, std::int64_t{262147}}) {
      const auto options = ctorch::FlatCollectiveOptions().segmentBytes(m == 7 ? 24 : 1 << 20);
      const std::string tag = std::string(dtype == torch::kFloat32 ? "float32" : "float64") + " m=" + std::to_string(m);
      // Values of widely different magnitudes (another summation order would change the last bits),
      // made on the CPU; the expectation is computed there, in the documented order.
      std::vector<at::Tensor> x;
      for (int r = 0; r < world; ++r) {
        torch::manual_seed(1000 + 31 * r + static_cast<std::uint64_t>(m));
        auto base = torch::randn({world * m}, torch::kFloat64);
        x.push_back((base * torch::exp(3 * torch::randn({world * m}, torch::kFloat64))).to(dtype));
      }
      // Chunk c: starting at rank c+1, around the ring, ending with rank c.
      at::Tensor expected = x[static_cast<std::size_t>((rank + 1) % world)].narrow(0, rank * m, m).clone();
      for (int k = 2; k <= world; ++k) expected = expected + x[static_cast<std::size_t>((rank + k) % world)].narrow(0, rank * m, m);

      at::Tensor out = at::full({m}, -1.0, torch::TensorOptions(dtype).device(device));
      ctorch::reduceScatter(group, x[static_cast<std::size_t>(rank)].to(device), out, options);
      std::cout << "reduceScatter " << tag << ": "
                << (out.device() == device && torch::equal(out.cpu(), expected) ? "bit-identical" : "DIFFERS") << "\n";

      at::Tensor gathered = at::full({world * m}, -1.0, torch::TensorOptions(dtype).device(device));
      const at::Tensor mine = x[static_cast<std::size_t>(rank)].narrow(0, 0, m).to(device);
      ctorch::allGather(group, mine, gathered, options);
      std::vector<at::Tensor> parts;
      for (int r = 0; r < world; ++r) parts.push_back(x[static_cast<std::size_t>(r)].narrow(0, 0, m));
      const at::Tensor concatenation = torch::cat(parts);
      std::cout << "allGather " << tag << ": " << (torch::equal(gathered.cpu(), concatenation) ? "exact" : "DIFFERS") << "\n";

      // In place, as FSDP gathers: the input is the output's own chunk.
      at::Tensor inPlace = at::full({world * m}, -1.0, torch::TensorOptions(dtype).device(device));
      at::Tensor chunk = inPlace.narrow(0, rank * m, m);
      chunk.copy_(mine);
      ctorch::allGather(group, chunk, inPlace, options);
      std::cout << "allGather in place " << tag << ": " << (torch::equal(inPlace.cpu(), concatenation) ? "exact" : "DIFFERS")
                << "\n";
    }
  std::cout << "flat collectives on " << device.str() << " backend " << ctorch::getBackendName() << " world " << world << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// ---- an FSDP snapshot: CUDA -> CPU -> CUDA -----------------------------------------------------------

namespace {
namespace strategies {

// A copy of `value` whose tensors are on the CPU, through the bytes a file would hold.
c10::IValue throughBytes(const c10::IValue& value) {
  std::function<c10::IValue(const c10::IValue&)> cpu = [&](const c10::IValue& v) -> c10::IValue {
    if (v.isTensor()) return v.toTensor().detach().to(torch::kCPU);
    if (v.isGenericDict()) {
      auto d = v.toGenericDict();
      c10::impl::GenericDict out(d.keyType(), d.valueType());
      for (const auto& e : d) out.insert(e.key(), cpu(e.value()));
      return out;
    }
    if (v.isList()) {
      c10::impl::GenericList out(c10::AnyType::get());
      for (const auto& e : v.toListRef()) out.push_back(cpu(e));
      return out;
    }
    return v;
  };
  return torch::pickle_load(torch::pickle_save(cpu(value)));
}

using ShardState = std::pair<c10::IValue, c10::IValue>;  // the model's shards, the optimizer's

struct FsdpRun {
  explicit FsdpRun(const torch::Device& d) : device(d) {
    torch::manual_seed(21);
    net = fsdp_test::Net();
    net->to(device);
    fsdp = std::make_unique<ctorch::FullyShardedDataParallel<fsdp_test::Net>>(
        net, ctorch::FSDPOptions().autoWrapPolicy(fsdp_test::netPolicy()));
    adam = std::make_unique<torch::optim::Adam>(fsdp->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  }
  void train(int from, int count) {
    for (int step = from; step < from + count; ++step) {
      const auto [x, y] = batch(3000 + step, device);
      adam->zero_grad();
      torch::mse_loss((*fsdp)(x), y).backward();
      adam->step();
    }
  }
  ShardState save() {
    return {throughBytes(c10::IValue(fsdp->shardStateDict())), throughBytes(c10::IValue(fsdp->optimizerShardStateDict(*adam)))};
  }
  void load(const ShardState& state) {
    auto dict = [](const c10::IValue& v) { return c10::impl::toTypedDict<std::string, c10::IValue>(v.toGenericDict()); };
    fsdp->loadShardStateDicts({dict(state.first)});
    fsdp->loadOptimizerShardStateDicts(*adam, {dict(state.second)});
  }
  torch::Device device;
  fsdp_test::Net net{nullptr};
  std::unique_ptr<ctorch::FullyShardedDataParallel<fsdp_test::Net>> fsdp;
  std::unique_ptr<torch::optim::Adam> adam;
};

std::string difference(const ShardState& a, const ShardState& b) {
  std::string why;
  if (!ivalueEqual(a.first, b.first, "model shards", why)) return why;
  if (!ivalueEqual(a.second, b.second, "optimizer shards", why)) return why;
  return "";
}

} // namespace strategies
} // namespace

// args: backend=nccl|gloo. World 1. Prints one line per check: "<what>: same" or "<what>: <difference>".
CTORCH_TEST_WORKER(cuda_fsdp_snapshot) {
  using namespace strategies;
  deterministic();
  initGroup(args);
  const auto device = testDevice(ctorch::getLocalRank());
  auto say = [](const std::string& what, const std::string& diff) {
    std::cout << what << ": " << (diff.empty() ? "same" : diff) << "\n";
  };
  FsdpRun gpu(device);
  gpu.train(0, 3);
  const auto written = gpu.save();

  FsdpRun cpu(torch::kCPU);  // other initial weights would not matter: all of it is loaded
  cpu.load(written);
  bool onCpu = true;
  for (const auto& p : cpu.fsdp->parameters()) onCpu = onCpu && p.device().is_cpu();
  std::cout << "cpu shards on the cpu: " << (onCpu ? "yes" : "no") << "\n";
  const auto fromCpu = cpu.save();
  say("cuda -> cpu", difference(written, fromCpu));

  FsdpRun back(device);
  back.load(fromCpu);
  bool onDevice = true;
  for (const auto& p : back.fsdp->parameters()) onDevice = onDevice && p.device() == device;
  std::cout << "shards back on " << device.str() << ": " << (onDevice ? "yes" : "no") << "\n";
  say("cpu -> cuda", difference(written, back.save()));

  gpu.train(3, 2);
  back.train(3, 2);
  const auto after = gpu.save();
  say("trained on after the round trip", difference(after, back.save()));
  // Control: the comparison sees the two extra steps.
  say("control (2 more steps)", difference(after, written));
  std::cout << "fsdp snapshot on " << device.str() << " backend " << ctorch::getBackendName() << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

namespace {

std::vector<ProcessResult> group(const std::string& worker, int world, const std::vector<std::string>& args) {
  return runWorkerGroup({.worker = worker, .worldSize = world, .args = args, .env = workerEnv(),
                         .timeout = std::chrono::seconds(90)});
}

std::vector<double> differences(const std::string& output) {
  std::vector<double> out;
  for (auto at = output.find("max difference "); at != std::string::npos; at = output.find("max difference ", at + 1))
    out.push_back(std::stod(output.substr(at + 15)));
  return out;
}

// World 1 on NCCL, world 2 on one GPU through Gloo with CUDA tensors (on the CPU: Gloo, both).
const std::vector<std::pair<int, std::string>> kWorlds = {{1, "backend=nccl"}, {2, "backend=gloo"}};

} // namespace

TEST_CASE("cuda: ZeRO-1 is bit-identical to DDP with the whole optimizer, world 1 on NCCL and world 2 through Gloo, SGD and Adam",
          "[cuda][strategies]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  for (const auto& [world, backend] : kWorlds)
    for (const char* optimizer : {"optimizer=sgd", "optimizer=adam"}) {
      const auto results = group("cuda_zero", world, {backend, optimizer});
      requireAllOk(results);
      for (const auto& r : results) {
        INFO(world << " rank(s), " << backend << ", " << optimizer << ": " << r.output);
        const auto d = differences(r.output);
        REQUIRE(d.size() == 4);
        for (double x : d) CHECK(x == 0);
      }
    }
  // Control: the local step without the broadcast leaves the other rank's share behind.
  const auto control = group("cuda_zero", 2, {"backend=gloo", "control=1"});
  requireAllOk(control);
  for (const auto& r : control) {
    INFO(r.output);
    CHECK(differences(r.output).front() > 0);
  }
  std::cout << "RECORDED: ZeRO-1 on " << testDevice().str() << ": bit-identical to DDP (world 1 NCCL, world 2 Gloo)" << std::endl;
}

TEST_CASE("cuda: FSDP, full sharding and SHARD_GRAD_OP, SGD and Adam, equals DDP at world 1 on NCCL and world 2 through Gloo",
          "[cuda][strategies]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  const double bound = haveCuda() ? 1e-5 : 0.0;  // the file's opening comment says why
  double most = 0;
  for (const auto& [world, backend] : kWorlds)
    for (const char* reshard : {"reshard=1", "reshard=0"})
      for (const char* optimizer : {"optimizer=sgd", "optimizer=adam"}) {
        const auto results = group("cuda_fsdp", world, {backend, reshard, optimizer});
        requireAllOk(results);
        for (const auto& r : results) {
          INFO(world << " rank(s), " << backend << ", " << reshard << ", " << optimizer << ": " << r.output);
          const auto d = differences(r.output);
          REQUIRE(d.size() == 4);
          for (double x : d) {
            CHECK(x <= bound);
            most = std::max(most, x);
          }
        }
      }
  const auto control = group("cuda_fsdp", 2, {"backend=gloo", "control=1"});
  requireAllOk(control);
  for (const auto& r : control) {
    INFO(r.output);
    const auto d = differences(r.output);
    REQUIRE(d.size() == 4);
    CHECK(d.front() >= 1e-3);
  }
  std::cout << "RECORDED: FSDP on " << testDevice().str() << " vs DDP, float32: max difference " << most
            << (most == 0 ? " (bit-identical)" : " (within the bound, not bit-identical)") << std::endl;
}

TEST_CASE("cuda: FSDP under bfloat16 autocast equals DDP under the same autocast", "[cuda][strategies]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  // The same arithmetic on both sides: autocast casts the gathered float32 weights and DDP's to
  // bfloat16 copies and runs the same kernels on them; the gradients flow back to float32 the same
  // way. Exact on the CPU; on CUDA the bound of the file's opening comment.
  const double bound = haveCuda() ? 2e-3 : 0.0;
  double most = 0;
  for (const auto& [world, backend] : kWorlds)
    for (const char* optimizer : {"optimizer=sgd", "optimizer=adam"}) {
      const auto results = group("cuda_fsdp", world, {backend, "precision=bf16", optimizer});
      if (!haveCuda() && !results.empty() && results[0].exitCode == 3) {
        WARN("bfloat16 autocast is not supported on this LibTorch's CPU");
        return;
      }
      requireAllOk(results);
      for (const auto& r : results) {
        INFO(world << " rank(s), " << backend << ", " << optimizer << ": " << r.output);
        const auto d = differences(r.output);
        REQUIRE(d.size() == 4);
        for (double x : d) {
          CHECK(x <= bound);
          most = std::max(most, x);
        }
      }
    }
  std::cout << "RECORDED: FSDP on " << testDevice().str() << " vs DDP, bfloat16 autocast: max difference " << most
            << (most == 0 ? " (bit-identical)" : " (within the bound, not bit-identical)") << std::endl;
}

TEST_CASE("cuda: the parameter server, 2 workers + 1 server through Gloo with CUDA tensors, is bit-identical to DDP",
          "[cuda][strategies]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  auto finalLine = [](const std::vector<ProcessResult>& results) {
    std::string line;
    for (const auto& r : results)
      if (const auto at = r.output.find("final "); at != std::string::npos)
        line = r.output.substr(at, r.output.find('\n', at) - at);
    return line;
  };
  for (const char* optimizer : {"optimizer=sgd", "optimizer=adam"}) {
    const auto ddp = group("cuda_ps", 2, {"mode=ddp", optimizer});
    requireAllOk(ddp);
    const auto ps = group("cuda_ps", 3, {"mode=ps", optimizer});
    requireAllOk(ps);
    INFO(optimizer << "\nDDP: " << ddp[0].output << "\nPS worker 0: " << ps[0].output << "\nserver: " << ps[2].output);
    REQUIRE_FALSE(finalLine(ddp).empty());
    CHECK(finalLine(ps) == finalLine(ddp));
    CHECK_THAT(ps[2].output, Catch::Contains("served 4 steps"));
  }
  // Control: worker 1 on worker 0's batch.
  const auto ddp = group("cuda_ps", 2, {"mode=ddp"});
  const auto control = group("cuda_ps", 3, {"mode=ps", "control=1"});
  requireAllOk(control);
  CHECK(finalLine(control) != finalLine(ddp));
  std::cout << "RECORDED: parameter server on " << testDevice().str() << " (Gloo, CUDA tensors staged through the host): "
            << "bit-identical to DDP, SGD and Adam" << std::endl;
}

TEST_CASE("cuda: the flat reduce-scatter and all-gather, world 1 on NCCL and world 2 through Gloo with CUDA tensors",
          "[cuda][strategies]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  for (const auto& [world, backend] : kWorlds) {
    const auto results = group("cuda_flat", world, {backend});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(world << " rank(s), " << backend << ": " << r.output);
      CHECK_THAT(r.output, !Catch::Contains("DIFFERS"));
      std::size_t checks = 0;
      for (const char* verdict : {": bit-identical\n", ": exact\n"})
        for (auto at = r.output.find(verdict); at != std::string::npos; at = r.output.find(verdict, at + 1)) ++checks;
      CHECK(checks == 2 * 4 * 3);
    }
  }
}

TEST_CASE("cuda: an FSDP snapshot written on CUDA resumes on the CPU and back on CUDA, state equal", "[cuda][strategies]") {
  REQUIRE_GPU_OR_CPU_STAND_IN();
  const auto results = group("cuda_fsdp_snapshot", 1, {"backend=nccl"});
  requireAllOk(results);
  const auto& out = results[0].output;
  INFO(out);
  CHECK_THAT(out, Catch::Contains("cpu shards on the cpu: yes"));
  CHECK_THAT(out, Catch::Contains("cuda -> cpu: same"));
  CHECK_THAT(out, Catch::Contains(": yes\n"));
  CHECK_THAT(out, Catch::Contains("cpu -> cuda: same"));
  CHECK_THAT(out, Catch::Contains("trained on after the round trip: same"));
  CHECK_THAT(out, !Catch::Contains("control (2 more steps): same"));
}
