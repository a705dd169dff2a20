// FullyShardedDataParallel with a MixedPrecisionPolicy (Python FSDP2's MixedPrecisionPolicy), with
// real processes, TCPStore and Gloo on 127.0.0.1, against a single-process reference that does
// Python's semantics by hand: the float32 master cast to bfloat16, each rank's forward and backward
// with those parameters (inputs cast too), the gradients cast to the reduce dtype, summed over the
// ranks in the order the reduce-scatter sums them and divided by the ranks, cast back to float32, and
// the optimizer stepped on the float32 master.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "pickle_files.hpp"
#include "small_net.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/fully_sharded_data_parallel.hpp"
#include "ctorch/hybrid_shard_groups.hpp"
#include "ctorch/snapshot.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <string>

using namespace ctorch::test;
using ddptest::arg;
using namespace sharding_test;

namespace fsdp_mp_test {

// What a unit's forward saw of its own weight the last time it ran: its dtype and whether its memory
// was there (gathered).
struct Seen {
  at::ScalarType dtype = at::kFloat;
  bool gathered = false;
  at::ScalarType input = at::kFloat;
};
Seen seen;

struct BlockImpl : torch::nn::Module {
  BlockImpl(int in, int out) { fc = register_module("fc", torch::nn::Linear(in, out)); }
  torch::Tensor forward(torch::Tensor x) {
    seen = {fc->weight.scalar_type(), fc->weight.storage().nbytes() > 0, x.scalar_type()};
    return torch::tanh(fc(x));
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Block);

// Two units, a frozen unit and a head left in the root.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    a = register_module("a", Block(12, 40));
    b = register_module("b", Block(40, 16));
    frozen = register_module("frozen", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 3));
    frozen->weight.requires_grad_(false);
    frozen->bias.requires_grad_(false);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = ctorch::unitForward(a, x);
    x = ctorch::unitForward(b, x);
    x = torch::relu(ctorch::unitForward(frozen, x));
    return head(x);
  }
  Block a{nullptr}, b{nullptr};
  torch::nn::Linear frozen{nullptr}, head{nullptr};
};
TORCH_MODULE(Net);

ctorch::WrapPolicy policy() {
  return [](const std::string& name, const torch::nn::Module&) { return name == "a" || name == "b" || name == "frozen"; };
}

at::ScalarType dtypeOf(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp32") return at::kFloat;
  throw std::invalid_argument("dtype " + name);
}

// Rank r's micro-batch m of global step s (the same on the reference).
std::pair<at::Tensor, at::Tensor> batch(int step, int micro, int rank) {
  torch::manual_seed(1000 + 17 * step + 5 * micro + rank);
  auto x = torch::randn({8, 12});
  auto y = torch::randn({8, 3});
  return {x, y};
}

// Python FSDP2's semantics by hand, in one process, for `world` ranks (`hybrid` ranks per node: the
// sum is associated as the node's reduce-scatter and then the nodes' allreduce add it).
struct Reference {
  Reference(const std::string& kind, at::ScalarType paramDtype, at::ScalarType reduceDtype, int world, int hybrid)
      : param(paramDtype), reduce(reduceDtype), world(world), hybrid(hybrid) {
    torch::manual_seed(11);
    master = Net();
    replica = Net();
    for (const auto& p : master->parameters())
      if (p.requires_grad()) trainable.push_back(p);
    optimizer = makeOptimizer(kind, trainable);
  }
  void step(int step, int micro) {
    {
      torch::NoGradGuard noGrad;
      auto from = master->parameters();
      auto to = replica->parameters();
      for (std::size_t i = 0; i < from.size(); ++i) to[i].set_data(from[i].detach().to(param));
    }
    // Each rank's gradient in the reduce dtype, accumulated over its micro-batches as FSDP2 does:
    // upcast and summed in the reduce dtype when it differs from the parameters', else summed by
    // autograd in the parameters' dtype (then cast).
    std::vector<std::vector<at::Tensor>> perRank;
    for (int r = 0; r < world; ++r) {
      std::vector<at::Tensor> sums;
      for (auto& p : replica->parameters()) p.mutable_grad() = at::Tensor();
      for (int m = 0; m < micro; ++m) {
        auto [x, y] = batch(step, m, r);
        torch::mse_loss(replica->forward(x.to(param)).to(at::kFloat), y).backward();
        if (reduce != param) {
          std::size_t k = 0;
          for (auto& p : replica->parameters()) {
            if (!p.requires_grad()) continue;
            if (m == 0) sums.push_back(p.grad().to(reduce));
            else sums[k].add_(p.grad());
            ++k;
            p.mutable_grad() = at::Tensor();
          }
        }
      }
      if (reduce == param)
        for (auto& p : replica->parameters())
          if (p.requires_grad()) sums.push_back(p.grad().to(reduce));
      perRank.push_back(std::move(sums));
    }
    const int nodeSize = hybrid > 0 ? hybrid : world;
    for (std::size_t k = 0; k < trainable.size(); ++k) {
      at::Tensor total;
      for (int node = 0; node < world / nodeSize; ++node) {
        at::Tensor partial = perRank[node * nodeSize][k].clone();
        for (int r = 1; r < nodeSize; ++r) partial = partial + perRank[node * nodeSize + r][k];
        total = total.defined() ? total + partial : partial;
      }
      trainable[k].mutable_grad() = total.div(world).to(at::kFloat);
    }
    optimizer->step();
  }
  at::ScalarType param, reduce;
  int world, hybrid;
  Net master{nullptr}, replica{nullptr};
  std::vector<at::Tensor> trainable;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

double maxDifference(const torch::OrderedDict<std::string, at::Tensor>& sharded, Net& whole) {
  double most = 0;
  for (const auto& p : whole->named_parameters()) {
    const auto* got = sharded.find(p.key());
    if (got == nullptr || got->scalar_type() != at::kFloat || !got->sizes().equals(p.value().sizes())) return 1e300;
    if (!torch::equal(*got, p.value().detach()))
      most = std::max(most, (*got - p.value().detach()).abs().max().item<double>() + 1e-300);
  }
  return most;
}

ctorch::FSDPOptions optionsFor(const std::vector<std::string>& args) {
  ctorch::FSDPOptions options;
  options.autoWrapPolicy(policy()).reshardAfterForward(arg(args, "reshard", "1") == "1");
  if (arg(args, "mp", "1") == "1")
    options.mixedPrecision(ctorch::MixedPrecisionPolicy()
                               .paramDtype(dtypeOf(arg(args, "param", "bf16")))
                               .reduceDtype(dtypeOf(arg(args, "reduce", "fp32"))));
  if (const int hybrid = std::stoi(arg(args, "hybrid", "0")); hybrid > 0) {
    const auto groups = ctorch::hybridShardGroups(ctorch::HybridShardOptions().shardSize(hybrid));
    options.processGroup(groups.shard);
    options.replicateGroup(groups.replicate);
  }
  return options;
}

// args: optimizer=<sgd|adam> param=<bf16|fp32> reduce=<fp32|bf16> accumulate=<0|1> hybrid=<0|2>
// reshard=<1|0> mp=<1|0> other=<bf16|fp32: also train a second FSDP with this reduce dtype and print
// its distance>. Prints what the unit saw inside its forward, the bytes, and "step k max difference D"
// (0 = bit-identical to the reference) after each of 4 steps.
CTORCH_TEST_WORKER(fsdp_mp_vs_reference) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  const int micro = arg(args, "accumulate", "0") == "1" ? 2 : 1;
  const bool mp = arg(args, "mp", "1") == "1";
  const auto param = mp ? dtypeOf(arg(args, "param", "bf16")) : at::kFloat;
  const auto reduce = mp ? dtypeOf(arg(args, "reduce", "fp32")) : at::kFloat;
  Reference reference(arg(args, "optimizer", "sgd"), param, reduce, world, std::stoi(arg(args, "hybrid", "0")));
  torch::manual_seed(11);
  Net sharded;
  ctorch::FullyShardedDataParallel<Net> fsdp(sharded, optionsFor(args));
  auto optimizer = makeOptimizer(arg(args, "optimizer", "sgd"), fsdp.parameters());
  // A second run differing only in its reduce dtype (test (b)).
  const std::string other = arg(args, "other", "");
  torch::manual_seed(11);
  Net otherNet;
  std::unique_ptr<ctorch::FullyShardedDataParallel<Net>> otherFsdp;
  std::unique_ptr<torch::optim::Optimizer> otherOptimizer;
  if (!other.empty()) {
    auto options = optionsFor(args);
    options.mixedPrecision().reduceDtype(dtypeOf(other));
    otherFsdp = std::make_unique<ctorch::FullyShardedDataParallel<Net>>(otherNet, options);
    otherOptimizer = makeOptimizer(arg(args, "optimizer", "sgd"), otherFsdp->parameters());
  }
  double moved = 0;
  for (int step = 0; step < 4; ++step) {
    optimizer->zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = batch(step, m, rank);
      fsdp.setRequiresGradientSync(m == micro - 1);
      torch::mse_loss(fsdp(x).to(at::kFloat), y).backward();
      if (m == 0 && step == 0)
        std::cout << "in forward: weight " << c10::toString(seen.dtype) << (seen.gathered ? " gathered" : " not gathered")
                  << ", input " << c10::toString(seen.input) << "\n";
      if (otherFsdp) {
        otherFsdp->setRequiresGradientSync(m == micro - 1);
        torch::mse_loss((*otherFsdp)(x).to(at::kFloat), y).backward();
      }
    }
    optimizer->step();
    if (otherOptimizer) {
      otherOptimizer->step();
      otherOptimizer->zero_grad();
    }
    reference.step(step, micro);
    if (step == 2) {
      // Inside summonFullParameters the module's parameters are the float32 master; training goes on
      // after it (the gradient hooks survive the parameters' round trip).
      const auto state = fsdp.fullStateDict();
      bool master = true;
      fsdp.summonFullParameters([&] {
        for (const auto& p : sharded->named_parameters())
          master = master && p.value().scalar_type() == at::kFloat && torch::equal(p.value(), state[p.key()]);
      });
      std::cout << (master ? "summoned the float32 master" : "summoned something else") << "\n";
    }
    std::cout << "step " << step << " max difference " << maxDifference(fsdp.fullStateDict(), reference.master) << "\n";
    if (otherFsdp) {
      const auto mine = fsdp.fullStateDict(), theirs = otherFsdp->fullStateDict();
      double most = 0;
      for (const auto& item : mine) most = std::max(most, (item.value() - theirs[item.key()]).abs().max().item<double>());
      std::cout << "step " << step << " reduce dtype distance " << most << "\n";
    }
  }
  {
    torch::manual_seed(11);
    Net initial;
    for (const auto& p : initial->named_parameters())
      moved = std::max(moved, (p.value() - reference.master->named_parameters()[p.key()]).abs().max().item<double>());
  }
  std::size_t shardBytes = 0;
  for (const auto& p : fsdp.parameters()) shardBytes += p.nbytes();
  std::cout << "moved " << moved << "\n";
  std::cout << "bytes largest unit " << fsdp.largestUnitBytes() << " local " << fsdp.localParameterBytes() << " shards "
            << shardBytes << " shard dtype " << c10::toString(fsdp.parameters().front().scalar_type()) << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// Two phases (args: phase=<save|resume> dir=<folder> optimizer=<sgd|adam>): `save` trains 2 steps with
// bf16 parameters and fp32 reduction and leaves each rank's parameter and optimizer shards and the
// reference's state; `resume` restores both and trains steps 2 and 3, printing "resumed step k max
// difference D" against the reference (which the uninterrupted run equals bit for bit).
CTORCH_TEST_WORKER(fsdp_mp_resume) {
  const bool resume = arg(args, "phase") == "resume";
  const std::filesystem::path dir = arg(args, "dir");
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  const std::string kind = arg(args, "optimizer", "adam");
  Reference reference(kind, at::kBFloat16, at::kFloat, world, 0);
  torch::manual_seed(11);
  Net sharded;
  ctorch::FullyShardedDataParallel<Net> fsdp(sharded, optionsFor({"param=bf16", "reduce=fp32"}));
  auto optimizer = makeOptimizer(kind, fsdp.parameters());
  auto train = [&](int step) {
    optimizer->zero_grad();
    auto [x, y] = batch(step, 0, rank);
    torch::mse_loss(fsdp(x).to(at::kFloat), y).backward();
    optimizer->step();
    reference.step(step, 1);
  };
  if (!resume) {
    for (int step = 0; step < 2; ++step) train(step);
    c10::impl::GenericDict shard(c10::StringType::get(), c10::AnyType::get());
    shard.insert("model", fsdp.shardStateDict());
    shard.insert("optimizer", fsdp.optimizerShardStateDict(*optimizer));
    writeValue(dir / ("shard" + std::to_string(rank) + ".pt"), shard);
    std::string dtypes;
    for (const auto& p : fsdp.parameters()) dtypes += std::string(c10::toString(p.scalar_type())) + " ";
    std::cout << "saved shards of " << dtypes << "\n";
    if (rank == 0) {
      c10::impl::GenericDict full(c10::StringType::get(), c10::AnyType::get());
      for (const auto& p : reference.master->named_parameters()) full.insert(p.key(), p.value().detach());
      writeValue(dir / "full.pt", full);
      std::string type;
      writeValue(dir / "whole.pt", c10::IValue(ctorch::captureOptimizerState(*reference.optimizer, &type)));
      writeValue(dir / "type.pt", type);
    }
  } else {
    std::vector<ctorch::ItemDict> models, optimizers;
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().filename().string().rfind("shard", 0) == 0) {
        const auto shard = readValue(entry.path()).toGenericDict();
        models.push_back(itemDict(shard.at("model")));
        optimizers.push_back(itemDict(shard.at("optimizer")));
      }
    fsdp.loadShardStateDicts(models);
    fsdp.loadOptimizerShardStateDicts(*optimizer, optimizers);
    const auto full = readValue(dir / "full.pt").toGenericDict();
    {
      torch::NoGradGuard noGrad;
      for (auto& p : reference.master->named_parameters()) p.value().copy_(full.at(p.key()).toTensor());
    }
    const auto errors = ctorch::restoreOptimizerState(*reference.optimizer, readValue(dir / "type.pt").toStringRef(),
                                                      itemDict(readValue(dir / "whole.pt")));
    if (!errors.empty()) throw std::runtime_error(errors.front());
    std::cout << "restored step 1 max difference " << maxDifference(fsdp.fullStateDict(), reference.master) << "\n";
    for (int step = 2; step < 4; ++step) {
      train(step);
      std::cout << "resumed step " << step << " max difference " << maxDifference(fsdp.fullStateDict(), reference.master)
                << "\n";
    }
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// A dtype that is not floating point is refused in one line.
CTORCH_TEST_WORKER(fsdp_mp_refusal) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  try {
    auto linear = torch::nn::Linear(4, 4);
    ctorch::FullyShardedDataParallel bad(
        linear, ctorch::FSDPOptions().mixedPrecision(ctorch::MixedPrecisionPolicy().reduceDtype(at::kInt)));
    std::cout << "no refusal\n";
  } catch (const ctorch::ConfigError& e) {
    std::cout << e.what() << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

std::vector<double> numbersAfter(const std::string& output, const std::string& label) {
  std::vector<double> out;
  for (auto at = output.find(label); at != std::string::npos; at = output.find(label, at + 1))
    out.push_back(std::stod(output.substr(at + label.size())));
  return out;
}

std::size_t bytesAfter(const std::string& output, const std::string& label) {
  const auto at = output.find(label);
  return at == std::string::npos ? 0 : std::stoull(output.substr(at + label.size()));
}

} // namespace fsdp_mp_test

using namespace fsdp_mp_test;

TEST_CASE("fsdp mixed precision: bf16 parameters and fp32 reduction on 2 ranks are bit-identical to Python's semantics done by hand, SGD and Adam",
          "[sharding][fsdp][mixed-precision]") {
  // At 2 ranks every collective adds x0 + x1 (one rounding, the same on both sides), the division
  // by 2 is exact and each gathered parameter is its master rounded to bf16 once: the same bits.
  for (const char* reshard : {"1", "0"})
    for (const char* optimizer : {"sgd", "adam"})
      for (const char* accumulate : {"0", "1"}) {
        auto results = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 2,
                                       .args = {std::string("optimizer=") + optimizer, std::string("reshard=") + reshard,
                                                std::string("accumulate=") + accumulate}});
        requireAllOk(results);
        for (const auto& r : results) {
          INFO("reshard " << reshard << ", " << optimizer << ", accumulate " << accumulate << ": " << r.output);
          const auto d = numbersAfter(r.output, "max difference ");
          REQUIRE(d.size() == 4);
          for (double x : d) CHECK(x == 0);
          CHECK_THAT(r.output, Catch::Contains("in forward: weight BFloat16 gathered, input BFloat16"));
          CHECK_THAT(r.output, Catch::Contains("summoned the float32 master"));
          CHECK_THAT(r.output, Catch::Contains("shard dtype Float"));
          CHECK(numbersAfter(r.output, "moved ").at(0) > 1e-2);  // the steps did move the parameters
        }
      }
}

TEST_CASE("fsdp mixed precision: bf16 reduction is bit-identical to its own reference and within a stated bound of fp32 reduction",
          "[sharding][fsdp][mixed-precision]") {
  // The bf16 sum x0 + x1 rounds the averaged gradient to 8 bits of mantissa (relative error <= 2^-9);
  // SGD (lr 0.1, momentum 0.9) or Adam (lr 1e-2) then moves the parameters by an update that
  // differs by about that fraction, and the next forwards (bf16) see the difference. Measured after
  // 4 steps: SGD 7.4e-5 (2.14: 1.2e-4) of a 0.105 move, Adam 1.3e-4 of 0.040; the bound is 2^-6 of
  // how far the parameters moved, and the two runs must differ (the reduction did run in bf16).
  for (const char* optimizer : {"sgd", "adam"}) {
    auto results = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 2,
                                   .args = {std::string("optimizer=") + optimizer, "reduce=bf16", "other=fp32"}});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(optimizer << ": " << r.output);
      const auto d = numbersAfter(r.output, "max difference ");
      REQUIRE(d.size() == 4);
      for (double x : d) CHECK(x == 0);
      const auto distance = numbersAfter(r.output, "reduce dtype distance ");
      REQUIRE(distance.size() == 4);
      const double moved = numbersAfter(r.output, "moved ").at(0);
      CHECK(distance.back() > 0);  // the two reductions do differ
      for (double x : distance) CHECK(x <= moved / 64);
    }
  }
}

TEST_CASE("fsdp mixed precision: the gathered parameters are bf16 and half the bytes, the shards stay fp32",
          "[sharding][fsdp][mixed-precision]") {
  auto plain = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 2, .args = {"mp=0"}});
  auto mixed = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 2, .args = {}});
  requireAllOk(plain);
  requireAllOk(mixed);
  for (std::size_t r = 0; r < 2; ++r) {
    INFO(plain[r].output << "\n---\n" << mixed[r].output);
    CHECK_THAT(plain[r].output, Catch::Contains("in forward: weight Float gathered"));
    CHECK_THAT(mixed[r].output, Catch::Contains("in forward: weight BFloat16 gathered"));
    const auto plainUnit = bytesAfter(plain[r].output, "largest unit "), mixedUnit = bytesAfter(mixed[r].output, "largest unit ");
    CHECK(plainUnit > 0);
    CHECK(mixedUnit * 2 == plainUnit);
    CHECK(bytesAfter(mixed[r].output, " local ") == bytesAfter(plain[r].output, " local "));
    CHECK_THAT(mixed[r].output, Catch::Contains("shard dtype Float"));
  }
}

TEST_CASE("fsdp mixed precision: shards saved after 2 steps resume bit-identically (fp32 shards and optimizer state)",
          "[sharding][fsdp][mixed-precision]") {
  for (const char* optimizer : {"sgd", "adam"}) {
    TempDir dir;
    auto saved = runWorkerGroup({.worker = "fsdp_mp_resume", .worldSize = 2,
                                 .args = {"phase=save", "dir=" + dir.path().string(), std::string("optimizer=") + optimizer}});
    requireAllOk(saved);
    for (const auto& r : saved) CHECK_THAT(r.output, Catch::Contains("saved shards of Float Float Float"));
    auto resumed = runWorkerGroup({.worker = "fsdp_mp_resume", .worldSize = 2,
                                   .args = {"phase=resume", "dir=" + dir.path().string(), std::string("optimizer=") + optimizer}});
    requireAllOk(resumed);
    for (const auto& r : resumed) {
      INFO(optimizer << ": " << r.output);
      const auto d = numbersAfter(r.output, "max difference ");
      REQUIRE(d.size() == 3);
      for (double x : d) CHECK(x == 0);
    }
  }
}

TEST_CASE("fsdp mixed precision: hybrid 2 nodes of 2 is bit-identical to the reference summing node by node, plain 4 ranks within a bound",
          "[sharding][fsdp][mixed-precision][hybrid]") {
  // Hybrid sums (x0 + x1) + (x2 + x3) in fp32, which the reference does too: the same bits. Plain
  // FSDP at 4 ranks sums around its ring in another order; bf16 gradients (8-bit mantissas) summed
  // in fp32 (24 bits) are mostly exact in any order, and were bit-identical here in both lanes, but
  // an order may round where another does not (last-bit differences, ~1e-7 relative) and a bf16
  // forward may then round either way: the bound is 2^-8 of how far the parameters moved.
  for (const char* optimizer : {"sgd", "adam"}) {
    auto hybrid = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 4,
                                  .args = {std::string("optimizer=") + optimizer, "hybrid=2"}});
    requireAllOk(hybrid);
    for (const auto& r : hybrid) {
      INFO("hybrid " << optimizer << ": " << r.output);
      const auto d = numbersAfter(r.output, "max difference ");
      REQUIRE(d.size() == 4);
      for (double x : d) CHECK(x == 0);
    }
    // bf16 reduction across the nodes too (Gloo's allreduce has no bf16: the ring carries it).
    auto bf16 = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 4,
                                .args = {std::string("optimizer=") + optimizer, "hybrid=2", "reduce=bf16"}});
    requireAllOk(bf16);
    for (const auto& r : bf16) {
      INFO("hybrid bf16 reduction " << optimizer << ": " << r.output);
      const auto d = numbersAfter(r.output, "max difference ");
      REQUIRE(d.size() == 4);
      for (double x : d) CHECK(x == 0);
    }
    auto plain = runWorkerGroup({.worker = "fsdp_mp_vs_reference", .worldSize = 4, .args = {std::string("optimizer=") + optimizer}});
    requireAllOk(plain);
    for (const auto& r : plain) {
      INFO("plain " << optimizer << ": " << r.output);
      const auto d = numbersAfter(r.output, "max difference ");
      REQUIRE(d.size() == 4);
      const double moved = numbersAfter(r.output, "moved ").at(0);
      for (double x : d) CHECK(x <= moved / 256);
    }
  }
}

TEST_CASE("fsdp mixed precision: a dtype that is not floating point is refused in one line", "[sharding][fsdp][mixed-precision]") {
  auto results = runWorkerGroup({.worker = "fsdp_mp_refusal", .worldSize = 1});
  requireAllOk(results);
  CHECK_THAT(results[0].output, Catch::Contains("MixedPrecisionPolicy::reduceDtype must be a floating-point dtype, got Int"));
}
