// FullyShardedDataParallel (ZeRO-3 and, with reshardAfterForward(false), SHARD_GRAD_OP) against
// ctorch's DDP with the whole optimizer, with real processes, TCPStore and Gloo on 127.0.0.1: the
// gathered parameters and the BatchNorm buffers after every step, on a model with units of their own,
// a unit mixing trainable and frozen parameters, a frozen unit, weights tied across two units and
// parameters left in the root.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "pickle_files.hpp"
#include "fsdp_net.hpp"
#include "small_net.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/ddp.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/fully_sharded_data_parallel.hpp"
#include "ctorch/hybrid_shard_groups.hpp"
#include "ctorch/snapshot.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <string>

using namespace ctorch::test;
using ddptest::arg;
using namespace sharding_test;

namespace fsdp_test {

// The largest absolute difference between the FSDP replica's full state and the reference's (every
// parameter and buffer by name); infinity when a name or shape is missing.
double maxDifference(const torch::OrderedDict<std::string, at::Tensor>& sharded, Net& whole) {
  double most = 0;
  auto compare = [&](const std::string& name, const at::Tensor& expected) {
    const auto* got = sharded.find(name);
    if (got == nullptr || !got->sizes().equals(expected.sizes())) {
      most = std::numeric_limits<double>::infinity();
      return;
    }
    if (!torch::equal(*got, expected))
      most = std::max(most, (*got - expected).abs().max().to(at::kDouble).item<double>() + 1e-300);
  };
  for (const auto& p : whole->named_parameters()) compare(p.key(), p.value().detach());
  for (const auto& b : whole->named_buffers()) compare(b.key(), b.value());
  return most;
}

// The FSDP options of a test: plain (hybrid 0), or hybrid sharding in shard groups of `hybrid` ranks
// ("nodes" of that many processes on this host); `noReplicate` (the control) shards in those groups
// but leaves out the replicate group, so that the nodes never exchange gradients.
ctorch::FSDPOptions testOptions(int hybrid, bool noReplicate = false) {
  ctorch::FSDPOptions options;
  if (hybrid > 0) {
    const auto groups = ctorch::hybridShardGroups(ctorch::HybridShardOptions().shardSize(hybrid));
    options.processGroup(groups.shard);
    if (!noReplicate) options.replicateGroup(groups.replicate);
  }
  return options;
}

// One model twice on this rank: `whole` behind DDP with the whole optimizer (the reference), and a
// copy behind FullyShardedDataParallel with the same optimizer over its shards.
struct Pair {
  Pair(const std::string& optimizerKind, bool reshard, ctorch::FSDPOptions options = {}) : kind(optimizerKind) {
    torch::manual_seed(11);
    whole = Net();
    sharded = Net();
    {
      torch::NoGradGuard noGrad;
      for (std::size_t i = 0; i < whole->parameters().size(); ++i) sharded->parameters()[i].copy_(whole->parameters()[i]);
    }
    ddp = std::make_unique<ctorch::DistributedDataParallel<Net>>(whole);
    for (const auto& p : ddp->parameters())  // tiedA.weight is tiedB.weight: one entry for the optimizer
      if (std::none_of(unique.begin(), unique.end(), [&](const at::Tensor& u) { return u.is_same(p); })) unique.push_back(p);
    reference = makeOptimizer(kind, unique);
    fsdp = std::make_unique<ctorch::FullyShardedDataParallel<Net>>(
        sharded, options.autoWrapPolicy(netPolicy()).reshardAfterForward(reshard));
    optimizer = makeOptimizer(kind, fsdp->parameters());
  }
  // Global step `step` on this rank's batches (two micro-batches with `accumulate`); returns the
  // largest difference after it.
  double step(int step, int rank, bool accumulate, bool clip, bool control) {
    const int micro = accumulate ? 2 : 1;
    reference->zero_grad();
    optimizer->zero_grad();
    for (int m = 0; m < micro; ++m) {
      torch::manual_seed(1000 + 17 * step + 5 * m + rank);  // each rank its own batch
      const auto x = torch::randn({8, 12});
      const auto y = torch::randn({8, 3});
      const bool last = m == micro - 1;
      {
        auto guard = last ? std::optional<ctorch::NoSyncGuard>() : std::optional<ctorch::NoSyncGuard>(ddp->noSync());
        torch::mse_loss((*ddp)(x), y).backward();
      }
      fsdp->setRequiresGradientSync(last && !control);
      torch::mse_loss((*fsdp)(x), y).backward();
    }
    if (clip) {
      torch::nn::utils::clip_grad_norm_(unique, 0.05);
      fsdp->clipGradNorm(0.05);
    }
    reference->step();
    optimizer->step();
    return maxDifference(fsdp->fullStateDict(), whole);
  }
  std::string kind;
  Net whole{nullptr}, sharded{nullptr};
  std::unique_ptr<ctorch::DistributedDataParallel<Net>> ddp;
  std::vector<at::Tensor> unique;
  std::unique_ptr<torch::optim::Optimizer> reference, optimizer;
  std::unique_ptr<ctorch::FullyShardedDataParallel<Net>> fsdp;
};

// args: optimizer=<sgd|adam> reshard=<1|0> accumulate=<0|1> clip=<0|1> control=<0|1|noreplicate>
// hybrid=<ranks per shard group, 0: plain FSDP>. Prints "step k max difference D" after each step
// (0 = bit-identical) and the local bytes.
CTORCH_TEST_WORKER(fsdp_vs_ddp) {
  const bool reshard = arg(args, "reshard", "1") == "1", accumulate = arg(args, "accumulate", "0") == "1",
             clip = arg(args, "clip", "0") == "1", control = arg(args, "control", "0") == "1",
             noReplicate = arg(args, "control", "0") == "noreplicate";
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  Pair pair(arg(args, "optimizer", "sgd"), reshard, testOptions(std::stoi(arg(args, "hybrid", "0")), noReplicate));
  std::cout << "units";
  for (const auto& name : pair.fsdp->unitNames()) std::cout << " [" << name << "]";
  std::cout << "\n";
  for (int step = 0; step < 4; ++step)
    std::cout << "step " << step << " max difference " << pair.step(step, rank, accumulate, clip, control) << "\n";
  std::size_t wholeBytes = 0;
  for (const auto& p : pair.unique) wholeBytes += p.nbytes();
  std::cout << "bytes " << pair.fsdp->localParameterBytes() << " whole " << wholeBytes << " largest unit "
            << pair.fsdp->largestUnitBytes() << " world " << world << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

struct NoHookImpl : torch::nn::Module {  // calls its Linear directly: not a unit that can be sharded
  NoHookImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(NoHook);

// The refusals, printed: a unit never called through unitForward; a unit of two dtypes.
CTORCH_TEST_WORKER(fsdp_refusals) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  NoHook net;
  ctorch::FullyShardedDataParallel fsdp(net, ctorch::FSDPOptions().autoWrapPolicy(
                                                 ctorch::moduleTypeWrapPolicy<torch::nn::LinearImpl>()));
  try {
    fsdp(torch::randn({2, 4})).sum().backward();
    std::cout << "no refusal\n";
  } catch (const ctorch::ConfigError& e) {
    std::cout << e.what() << "\n";
  }
  try {
    auto mixed = torch::nn::Linear(4, 4);
    mixed->bias.set_data(mixed->bias.to(torch::kFloat64));
    ctorch::FullyShardedDataParallel bad(mixed);
  } catch (const ctorch::ConfigError& e) {
    std::cout << e.what() << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// Models whose units FSDP reaches with no ctorch::unitForward in them (issue 42.8): a root
// torch::nn::Sequential, and a parent calling a ctorch::UnitSequential of blocks like any Sequential.
struct StackImpl : torch::nn::Module {
  StackImpl() {
    blocks = register_module("blocks", ctorch::UnitSequential(Block(12, 24), Block(24, 24), Block(24, 16)));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return head(blocks->forward(x)); }  // no unitForward
  ctorch::UnitSequential blocks{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Stack);

torch::nn::Sequential plainSequential() {
  return torch::nn::Sequential(torch::nn::Linear(12, 40), torch::nn::Functional(torch::tanh), torch::nn::Linear(40, 16),
                               torch::nn::Functional(torch::relu), torch::nn::Linear(16, 3));
}

// FSDP (units by `policy`) against DDP with Adam, 3 steps on each rank's own batches: prints the units
// and "container step k max difference D" (0 = bit-identical).
template <typename M>
void compareContainer(const std::function<M()>& make, ctorch::WrapPolicy policy, int rank) {
  torch::manual_seed(5);
  M whole = make(), sharded = make();
  {
    torch::NoGradGuard noGrad;
    for (std::size_t i = 0; i < whole->parameters().size(); ++i) sharded->parameters()[i].copy_(whole->parameters()[i]);
  }
  ctorch::DistributedDataParallel<M> ddp(whole);
  auto reference = makeOptimizer("adam", ddp.parameters());
  ctorch::FullyShardedDataParallel<M> fsdp(sharded, ctorch::FSDPOptions().autoWrapPolicy(std::move(policy)));
  auto optimizer = makeOptimizer("adam", fsdp.parameters());
  std::cout << "units";
  for (const auto& name : fsdp.unitNames()) std::cout << " [" << name << "]";
  std::cout << "\n";
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(2000 + 13 * step + rank);
    const auto x = torch::randn({8, 12}), y = torch::randn({8, 3});
    reference->zero_grad();
    optimizer->zero_grad();
    torch::mse_loss(ddp(x), y).backward();
    torch::mse_loss(fsdp(x), y).backward();
    reference->step();
    optimizer->step();
    const auto state = fsdp.fullStateDict();
    double most = 0;
    for (const auto& p : whole->named_parameters()) {
      const auto* got = state.find(p.key());
      most = std::max(most, got == nullptr ? 1e300 : (*got - p.value().detach()).abs().max().template item<double>());
    }
    std::cout << "container step " << step << " max difference " << most << "\n";
  }
}

CTORCH_TEST_WORKER(fsdp_containers) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank();
  compareContainer<torch::nn::Sequential>(plainSequential, ctorch::moduleTypeWrapPolicy<torch::nn::LinearImpl>(), rank);
  compareContainer<Stack>([] { return Stack(); }, ctorch::moduleTypeWrapPolicy<BlockImpl>(), rank);
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// Two phases of one run (args: phase=<save|resume> dir=<folder> optimizer=<sgd|adam>): `save` trains
// 2 steps and leaves each rank's parameter and optimizer shards plus the reference's whole state;
// `resume` (on another world size) restores both runs from them - FSDP resharded from the shards - and
// trains 2 more steps, printing "resumed step k max difference D".
CTORCH_TEST_WORKER(fsdp_reshard) {
  const bool resume = arg(args, "phase") == "resume";
  const std::filesystem::path dir = arg(args, "dir");
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank();
  Pair pair(arg(args, "optimizer", "adam"), true, testOptions(std::stoi(arg(args, "hybrid", "0"))));
  if (!resume) {
    for (int step = 0; step < 2; ++step) pair.step(step, rank, false, false, false);
    c10::impl::GenericDict shard(c10::StringType::get(), c10::AnyType::get());
    shard.insert("model", pair.fsdp->shardStateDict());
    shard.insert("optimizer", pair.fsdp->optimizerShardStateDict(*pair.optimizer));
    writeValue(dir / ("shard" + std::to_string(rank) + ".pt"), shard);
    const auto sharded = pair.fsdp->fullStateDict();
    if (rank == 0) {
      c10::impl::GenericDict own(c10::StringType::get(), c10::AnyType::get());
      for (const auto& item : sharded) own.insert(item.key(), item.value());
      writeValue(dir / "fsdp_full.pt", own);
      c10::impl::GenericDict full(c10::StringType::get(), c10::AnyType::get());
      for (const auto& p : pair.whole->named_parameters()) full.insert(p.key(), p.value().detach());
      for (const auto& b : pair.whole->named_buffers()) full.insert(b.key(), b.value());
      writeValue(dir / "full.pt", full);
      std::string type;
      writeValue(dir / "whole.pt", c10::IValue(ctorch::captureOptimizerState(*pair.reference, &type)));
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
    pair.fsdp->loadShardStateDicts(models);
    pair.fsdp->loadOptimizerShardStateDicts(*pair.optimizer, optimizers);
    const auto full = readValue(dir / "full.pt").toGenericDict();
    {
      torch::NoGradGuard noGrad;
      for (auto& p : pair.whole->named_parameters()) p.value().copy_(full.at(p.key()).toTensor());
      for (auto& b : pair.whole->named_buffers()) b.value().copy_(full.at(b.key()).toTensor());
    }
    const auto errors = ctorch::restoreOptimizerState(*pair.reference, readValue(dir / "type.pt").toStringRef(),
                                                      itemDict(readValue(dir / "whole.pt")));
    if (!errors.empty()) throw std::runtime_error(errors.front());
    // Exact: the gathered parameters are the saved run's, and this rank's optimizer state is the
    // slice of every saved rank's pieces laid end to end.
    const auto saved = readValue(dir / "fsdp_full.pt").toGenericDict();
    bool same = true;
    for (const auto& item : pair.fsdp->fullStateDict()) same = same && torch::equal(saved.at(item.key()).toTensor(), item.value());
    const auto mine = pair.fsdp->optimizerShardStateDict(*pair.optimizer).at("flat_state").toGenericDict();
    int compared = 0;
    for (const auto& flat : mine) {
      const auto entry = flat.value().toGenericDict();
      for (const auto& piece : entry.at("pieces").toGenericDict()) {
        // By where they begin: a hybrid run's nodes each saved the same pieces, taken once.
        std::map<std::int64_t, at::Tensor> parts;
        for (const auto& o : optimizers) {
          const auto e = o.at("flat_state").toGenericDict().at(flat.key()).toGenericDict();
          parts.emplace(e.at("begin").toInt(), e.at("pieces").toGenericDict().at(piece.key()).toTensor());
        }
        std::vector<at::Tensor> ordered;
        for (const auto& part : parts) ordered.push_back(part.second);
        const auto whole = torch::cat(ordered);
        const auto& got = piece.value().toTensor();
        same = same && torch::equal(got, whole.narrow(0, entry.at("begin").toInt(), got.numel()));
        ++compared;
      }
    }
    // Without the optimizer's load there would be no state to compare: that must fail too.
    std::cout << (same && compared > 0 ? "resharded state identical" : "resharded state differs") << "\n";
    for (int step = 2; step < 4; ++step)
      std::cout << "resumed step " << step << " max difference " << pair.step(step, rank, false, false, false) << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

std::vector<double> differences(const std::string& output) {
  std::vector<double> out;
  for (std::size_t at = output.find("max difference "); at != std::string::npos; at = output.find("max difference ", at + 1))
    out.push_back(std::stod(output.substr(at + 15)));
  return out;
}

std::size_t bytesNumber(const std::string& text, const std::string& after) {
  const auto line = text.find("bytes ");
  const auto at = text.find(after, line);
  return at == std::string::npos ? 0 : std::stoull(text.substr(at + after.size()));
}

} // namespace fsdp_test

using namespace fsdp_test;

TEST_CASE("fsdp: 2 ranks, full sharding and SHARD_GRAD_OP, SGD and Adam, are bit-identical to DDP", "[sharding][fsdp]") {
  // torch::optim's optimizers and ctorch::optim's multi-tensor ones over the flat shards (fused where
  // this LibTorch has the kernels).
  for (const char* reshard : {"1", "0"})
    for (const char* optimizer : {"sgd", "adam", "sgd:auto", "adam:auto"}) {
      auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 2,
                                     .args = {std::string("optimizer=") + optimizer, std::string("reshard=") + reshard}});
      requireAllOk(results);
      for (const auto& r : results) {
        INFO("reshard " << reshard << ", " << optimizer << ": " << r.output);
        CHECK_THAT(r.output, Catch::Contains("units [] [a] [b] [tiedA] [frozen]"));  // tiedB's weight went to the root
        const auto d = differences(r.output);
        REQUIRE(d.size() == 4);
        for (double x : d) CHECK(x == 0);
        // Each rank holds half of the parameters (plus at most one element of padding per flat buffer).
        CHECK(bytesNumber(r.output, "bytes ") <= bytesNumber(r.output, " whole ") / 2 + 7 * 4);
      }
    }
}

TEST_CASE("fsdp: gradient accumulation without synchronisation is bit-identical to DDP's no_sync", "[sharding][fsdp]") {
  auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 2, .args = {"optimizer=adam", "accumulate=1"}});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    const auto d = differences(r.output);
    REQUIRE(d.size() == 4);
    for (double x : d) CHECK(x == 0);
  }
}

TEST_CASE("fsdp: clipping by the global norm over the shards matches DDP's clip_grad_norm_ within a stated bound", "[sharding][fsdp]") {
  // The norm is summed over shards in float64 here and per parameter in float32 by
  // clip_grad_norm_, so the clip coefficients may differ in their last bits (~1e-7 relative); with
  // SGD at lr 0.1 on clipped gradients of norm 0.05, 4 steps move a parameter by < 1e-7 * 0.02 * 4
  // for that cause: 1e-6 bounds it with margin, the control's differences are >= 1e-3.
  auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 2, .args = {"optimizer=sgd", "clip=1"}});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    const auto d = differences(r.output);
    REQUIRE(d.size() == 4);
    for (double x : d) CHECK(x <= 1e-6);
  }
}

TEST_CASE("fsdp: 3 ranks stay within the bound another association of the sum allows", "[sharding][fsdp]") {
  // At 3 ranks DDP's Gloo allreduce and the reduce-scatter add the three ranks' gradients in
  // different orders, so an averaged gradient may differ in its last bit or two (~2.4e-7 relative);
  // 4 steps of SGD (lr 0.1, momentum 0.9) or Adam (lr 1e-2, whose update is ~lr in size) keep
  // parameters of order 1 within 1e-5 of each other; the control's differences are >= 1e-3.
  for (const char* optimizer : {"sgd", "adam"}) {
    auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 3, .args = {std::string("optimizer=") + optimizer}});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(optimizer << ": " << r.output);
      const auto d = differences(r.output);
      REQUIRE(d.size() == 4);
      for (double x : d) CHECK(x <= 1e-5);
    }
  }
}

TEST_CASE("fsdp: the control - no gradient synchronisation fails the check", "[sharding][fsdp][control]") {
  auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 2, .args = {"control=1"}});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    const auto d = differences(r.output);
    REQUIRE(d.size() == 4);
    CHECK(d.front() >= 1e-3);
  }
}

TEST_CASE("fsdp: parameter and optimizer shards saved on 4 ranks load exactly on 2, and on 2 ranks on 3, and training goes on", "[sharding][fsdp]") {
  // Exact: the loaded parameters and each rank's optimizer state are the saved run's, resharded.
  // The DDP reference resumes from its own whole state, which at 4 (and 3) ranks had already moved
  // from FSDP's within the 3-rank bound above (another association of the sums), so the steps after
  // the resume are held to that bound.
  for (const auto& [from, to] : {std::pair{4, 2}, std::pair{2, 3}})
    for (const char* optimizer : {"sgd", "adam"}) {
      TempDir dir;
      const std::string where = "dir=" + dir.path().string(), kind = std::string("optimizer=") + optimizer;
      requireAllOk(runWorkerGroup({.worker = "fsdp_reshard", .worldSize = from, .args = {"phase=save", where, kind}}));
      auto results = runWorkerGroup({.worker = "fsdp_reshard", .worldSize = to, .args = {"phase=resume", where, kind}});
      requireAllOk(results);
      for (const auto& r : results) {
        INFO(from << " -> " << to << ", " << optimizer << ": " << r.output);
        CHECK_THAT(r.output, Catch::Contains("resharded state identical"));
        const auto d = differences(r.output);
        REQUIRE(d.size() == 2);
        for (double x : d) CHECK(x <= 1e-5);
      }
    }
}

TEST_CASE("fsdp: the children of a root Sequential and of a UnitSequential are units with no unitForward in the model, "
          "bit-identical to DDP (issue 42.8)",
          "[sharding][fsdp]") {
  auto results = runWorkerGroup({.worker = "fsdp_containers", .worldSize = 2});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("units [] [0] [2] [4]\n"));  // the root Sequential's Linears
    CHECK_THAT(r.output, Catch::Contains("units [] [blocks.0] [blocks.1] [blocks.2]\n"));
    const auto count = [&](const std::string& text) {
      std::size_t n = 0;
      for (auto at = r.output.find(text); at != std::string::npos; at = r.output.find(text, at + 1)) ++n;
      return n;
    };
    CHECK(count("container step ") == 6);
    CHECK(count("container step 0 max difference 0\n") == 2);
    CHECK(count("container step 2 max difference 0\n") == 2);
    CHECK(count(" max difference 0\n") >= 6);
  }
}

TEST_CASE("fsdp: a unit not called through unitForward, or of two dtypes, is refused by name", "[sharding][fsdp]") {
  auto results = runWorkerGroup({.worker = "fsdp_refusals", .worldSize = 2});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("unit 'fc' was not called through ctorch::unitForward in the forward"));
    CHECK_THAT(r.output, Catch::Contains("must share one dtype and device (found Float on cpu and Double on cpu)"));
  }
}

// ---- Hybrid sharding: 4 processes on this host as 2 "nodes" of 2 (shard groups {0,1} and {2,3},
// replicate groups {0,2} and {1,3}), against DDP over all 4 ranks on the same global batch.

TEST_CASE("fsdp hybrid: 2 nodes of 2, full sharding and SHARD_GRAD_OP, SGD and Adam, stay within the 4-rank bound of DDP",
          "[sharding][fsdp][hybrid]") {
  // DDP's Gloo allreduce adds the 4 ranks' gradients in its ring's order; hybrid sharding adds them
  // as (x0 + x1) + (x2 + x3) (the node's reduce-scatter, then the 2-node allreduce). Two associations
  // of the same 4-term sum, each within 3 eps sum|x| of the exact one, so an averaged gradient may
  // differ in its last bits (~5e-7 relative); the division by 4 is exact on both sides. As for FSDP
  // at 3 ranks, 4 steps of SGD (lr 0.1, momentum 0.9) or Adam (lr 1e-2) keep parameters of order 1
  // within 1e-5; the control without the replicate group differs by >= 1e-3.
  for (const char* reshard : {"1", "0"})
    for (const char* optimizer : {"sgd", "adam"}) {
      auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 4,
                                     .args = {std::string("optimizer=") + optimizer, std::string("reshard=") + reshard, "hybrid=2"}});
      requireAllOk(results);
      for (const auto& r : results) {
        INFO("reshard " << reshard << ", " << optimizer << ": " << r.output);
        const auto d = differences(r.output);
        REQUIRE(d.size() == 4);
        for (double x : d) CHECK(x <= 1e-5);
        // Each rank holds half of the parameters: sharded over its node of 2, not over the world of 4.
        CHECK(bytesNumber(r.output, "bytes ") <= bytesNumber(r.output, " whole ") / 2 + 7 * 4);
        CHECK(bytesNumber(r.output, "bytes ") > bytesNumber(r.output, " whole ") / 4 + 7 * 4);
      }
    }
}

TEST_CASE("fsdp hybrid: clipping takes the norm over one node's shards, not once per node", "[sharding][fsdp][hybrid]") {
  // Bound as the 2-rank clipping test's plus the 4-rank association's (1e-5); counting each node's
  // shards once more would clip by a norm sqrt(2) too large: differences ~1e-3.
  auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 4, .args = {"optimizer=sgd", "clip=1", "hybrid=2"}});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    const auto d = differences(r.output);
    REQUIRE(d.size() == 4);
    for (double x : d) CHECK(x <= 1e-5);
  }
}

TEST_CASE("fsdp hybrid: 2 nodes of 1 rank (the replicate allreduce alone) is bit-identical to DDP", "[sharding][fsdp][hybrid]") {
  // Each node's reduce-scatter is a copy and the 2-node allreduce adds x0 + x1, as DDP's does.
  for (const char* optimizer : {"sgd", "adam"}) {
    auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 2,
                                   .args = {std::string("optimizer=") + optimizer, "hybrid=1", "accumulate=1"}});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(optimizer << ": " << r.output);
      const auto d = differences(r.output);
      REQUIRE(d.size() == 4);
      for (double x : d) CHECK(x == 0);
    }
  }
}

TEST_CASE("fsdp hybrid: the control - shard groups without the replicate group fail the check", "[sharding][fsdp][hybrid][control]") {
  auto results = runWorkerGroup({.worker = "fsdp_vs_ddp", .worldSize = 4, .args = {"hybrid=2", "control=noreplicate"}});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    const auto d = differences(r.output);
    REQUIRE(d.size() == 4);
    CHECK(d.back() >= 1e-3);
  }
}

TEST_CASE("fsdp hybrid: shards saved by 2 nodes of 2 resume on 4 ranks without hybrid and on 1 rank, and plain shards of "
          "2 ranks resume as 2 nodes of 2",
          "[sharding][fsdp][hybrid]") {
  // Every rank of a hybrid run saves its shards; the two nodes' sets are equal and the first is read.
  // Exact on load (the resharded state is the saved one); the steps after it are held to the 4-rank
  // bound as above (at 1 rank DDP and FSDP sum nothing: identical).
  struct Move {
    int from, to;
    const char *saveHybrid, *resumeHybrid;
  };
  for (const Move& m : {Move{4, 4, "hybrid=2", "hybrid=0"}, Move{4, 1, "hybrid=2", "hybrid=0"}, Move{2, 4, "hybrid=0", "hybrid=2"}}) {
    TempDir dir;
    const std::string where = "dir=" + dir.path().string();
    requireAllOk(runWorkerGroup({.worker = "fsdp_reshard", .worldSize = m.from, .args = {"phase=save", where, "optimizer=adam", m.saveHybrid}}));
    auto results = runWorkerGroup({.worker = "fsdp_reshard", .worldSize = m.to, .args = {"phase=resume", where, "optimizer=adam", m.resumeHybrid}});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(m.from << " " << m.saveHybrid << " -> " << m.to << " " << m.resumeHybrid << ": " << r.output);
      CHECK_THAT(r.output, Catch::Contains("resharded state identical"));
      const auto d = differences(r.output);
      REQUIRE(d.size() == 2);
      for (double x : d) CHECK(x <= 1e-5);
    }
  }
}
