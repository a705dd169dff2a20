// ZeRO stage 1 (ctorch::ZeroRedundancyOptimizer) against DDP with the whole optimizer, with real
// processes, TCPStore and Gloo on 127.0.0.1: the parameters are bit-identical after every step (a
// parameter's update is the same operations on the same averaged gradient, computed by its owner;
// the broadcast copies bytes), with SGD + momentum + weight decay and with Adam, at 2 and 3 ranks.
// A control steps the local share without the broadcast: then the check must fail.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "pickle_files.hpp"
#include "small_net.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/ddp.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/snapshot.hpp"
#include "ctorch/zero_redundancy_optimizer.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

using namespace ctorch::test;
using ddptest::arg;
using namespace sharding_test;

namespace {

bool bitIdentical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// Two replicas of one model on this rank, each behind DDP: `whole` steps the whole optimizer, `sharded`
// a ZeroRedundancyOptimizer over the same kind; the same batches go to both.
struct Twins {
  explicit Twins(const std::string& optimizer, std::int64_t inPlaceBytes = 64 * 1024) : kind(optimizer) {
    torch::manual_seed(11);
    whole = Net();
    sharded = Net();
    {
      torch::NoGradGuard noGrad;
      for (std::size_t i = 0; i < whole->parameters().size(); ++i) sharded->parameters()[i].copy_(whole->parameters()[i]);
    }
    ddpWhole = std::make_unique<ctorch::DistributedDataParallel<Net>>(whole);
    ddpSharded = std::make_unique<ctorch::DistributedDataParallel<Net>>(sharded);
    reference = makeOptimizer(kind, ddpWhole->parameters());
    zero = std::make_unique<ctorch::ZeroRedundancyOptimizer>(
        ddpSharded->parameters(), [this](std::vector<at::Tensor> share) { return makeOptimizer(kind, share); },
        ctorch::ZeroOptions().broadcastInPlaceBytes(inPlaceBytes));
  }
  // Global step `step` on this rank's own batch; `broadcast` false: the local step alone (a control).
  // True while the replicas are bit-identical.
  bool step(int step, int rank, bool broadcast = true) {
    torch::manual_seed(1000 + 17 * step + rank);  // each rank its own batch
    const auto x = torch::randn({8, 12});
    const auto y = torch::randn({8, 3});
    reference->zero_grad();
    torch::mse_loss((*ddpWhole)(x), y).backward();
    reference->step();
    zero->zeroGrad();
    torch::mse_loss((*ddpSharded)(x), y).backward();
    if (broadcast) zero->step();
    else zero->localOptimizer()->step();
    return bitIdentical(whole->parameters(), sharded->parameters());
  }

  std::string kind;
  Net whole{nullptr}, sharded{nullptr};
  std::unique_ptr<ctorch::DistributedDataParallel<Net>> ddpWhole, ddpSharded;
  std::unique_ptr<torch::optim::Optimizer> reference;
  std::unique_ptr<ctorch::ZeroRedundancyOptimizer> zero;
};

// args: optimizer=<sgd|adam|sgd:K|adam:K> control=<0|1> in_place_bytes=<n> (0: every parameter
// broadcast in place; the default packs all of this small net's). Prints "identical after step k" for each step, or
// "differs at step k"; exit 0 either way unless something failed.
CTORCH_TEST_WORKER(zero_vs_ddp) {
  const std::string kind = arg(args, "optimizer", "sgd");
  const bool control = arg(args, "control", "0") == "1";
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  Twins t(kind, std::stoll(arg(args, "in_place_bytes", "65536")));
  for (int step = 0; step < 4; ++step) {
    if (!t.step(step, rank, !control)) {
      std::cout << "differs at step " << step << "\n";
      ctorch::destroyProcessGroup();
      return 0;
    }
    std::cout << "identical after step " << step << "\n";
  }
  // Optimizer state: each rank holds its share's only (SGD: one momentum buffer per parameter;
  // Adam: two moments). The whole optimizer's state is the sum over the ranks.
  std::cout << "state bytes " << t.zero->localStateBytes() << " of " << [&] {
    std::size_t bytes = 0;
    for (const auto& p : t.whole->parameters()) bytes += p.nbytes();
    return bytes * (kind.rfind("adam", 0) == 0 ? 2 : 1);
  }() << " world " << world << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// Two phases of one run (args: optimizer=<sgd|adam> phase=<save|resume> dir=<folder>): `save` trains
// 2 steps on this world size and leaves every rank's ZeRO shard, the parameters and the whole
// optimizer's state in dir; `resume` (on another world size) restores both runs from them — the
// ZeRO run resharded from the saved shards — and trains 2 more steps, printing "identical after
// resumed step k" while the two stay bit-identical.
CTORCH_TEST_WORKER(zero_reshard) {
  const std::string kind = arg(args, "optimizer", "sgd");
  const bool resume = arg(args, "phase") == "resume";
  const std::filesystem::path dir = arg(args, "dir");
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  Twins t(kind);
  if (resume) {
    torch::NoGradGuard noGrad;
    const auto saved = readValue(dir / "params.pt").toTensorList();
    for (std::size_t i = 0; i < saved.size(); ++i) {
      t.whole->parameters()[i].copy_(saved.get(i));
      t.sharded->parameters()[i].copy_(saved.get(i));
    }
    const auto errors = ctorch::restoreOptimizerState(*t.reference, readValue(dir / "type.pt").toStringRef(),
                                                      itemDict(readValue(dir / "whole.pt")));
    if (!errors.empty()) throw std::runtime_error(errors.front());
    std::vector<ctorch::ItemDict> shards;
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      if (entry.path().filename().string().rfind("shard", 0) == 0) shards.push_back(itemDict(readValue(entry.path())));
    t.zero->loadShardStateDicts(shards);
  }
  for (int step = resume ? 2 : 0; step < (resume ? 4 : 2); ++step) {
    if (!t.step(step, rank)) {
      std::cout << "differs at step " << step << "\n";
      break;
    }
    if (resume) std::cout << "identical after resumed step " << step << "\n";
  }
  if (!resume) {
    writeValue(dir / ("shard" + std::to_string(rank) + ".pt"), c10::IValue(t.zero->shardStateDict()));
    if (rank == 0) {
      writeValue(dir / "params.pt", c10::List<at::Tensor>(t.whole->parameters()));
      std::string type;
      writeValue(dir / "whole.pt", c10::IValue(ctorch::captureOptimizerState(*t.reference, &type)));
      writeValue(dir / "type.pt", type);
    }
  }
  std::cout << "world " << world << " done\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// The refusals, printed: Adam shards into SGD; only the other rank's shard (this rank's parameters
// are held by none).
CTORCH_TEST_WORKER(zero_refusals) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  torch::manual_seed(11);
  Net net;
  ctorch::DistributedDataParallel ddp(net);
  ctorch::ZeroRedundancyOptimizer adam(ddp.parameters(), [](std::vector<at::Tensor> share) { return makeOptimizer("adam", share); });
  ctorch::ZeroRedundancyOptimizer sgd(ddp.parameters(), [](std::vector<at::Tensor> share) { return makeOptimizer("sgd", share); });
  torch::mse_loss(ddp(torch::randn({4, 12})), torch::randn({4, 3})).backward();
  adam.step();
  sgd.step();
  try {
    sgd.loadShardStateDicts({adam.shardStateDict()});
  } catch (const ctorch::ConfigError& e) {
    std::cout << e.what() << "\n";
  }
  try {  // one float and one double parameter: a share would not fit one flat buffer
    ctorch::ZeroRedundancyOptimizer mixed({torch::zeros({3}), torch::zeros({3}, torch::kFloat64)},
                                          [](std::vector<at::Tensor> share) { return makeOptimizer("sgd", share); });
  } catch (const ctorch::ConfigError& e) {
    std::cout << e.what() << "\n";
  }
  auto other = sgd.shardStateDict();
  other.insert_or_assign("param_groups", c10::impl::GenericList(c10::AnyType::get()));
  try {
    sgd.loadShardStateDicts({other});
  } catch (const ctorch::ConfigError& e) {
    std::cout << e.what() << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// The number after `after` on the worker's "state bytes H of W world N" line (Gloo's own log lines
// may say " of " too).
std::size_t number(const std::string& text, const std::string& after) {
  const auto line = text.find("state bytes ");
  if (line == std::string::npos) return 0;
  const auto at = text.find(after, line);
  if (at == std::string::npos) return 0;
  return std::stoull(text.substr(at + after.size()));
}

} // namespace

TEST_CASE("zero: the sorted-greedy packing matches Python's ZeroRedundancyOptimizer", "[sharding][zero]") {
  // Largest first, each to the least-loaded rank (the lowest on a tie), whole parameters.
  CHECK(ctorch::partitionParameters({480, 40, 960, 24, 72, 3}, 2) == std::vector<int>{1, 1, 0, 1, 1, 1});
  CHECK(ctorch::partitionParameters({10, 10, 10, 10}, 3) == std::vector<int>{0, 1, 2, 0});
  CHECK(ctorch::partitionParameters({5}, 4) == std::vector<int>{0});
  CHECK_THROWS_AS(ctorch::partitionParameters({5}, 0), ctorch::ConfigError);
}

TEST_CASE("zero: ZeRO-1 on 2 and 3 ranks is bit-identical to DDP with the whole optimizer, SGD and Adam", "[sharding][zero]") {
  // torch::optim's optimizers and ctorch::optim's multi-tensor ones (fused where this LibTorch has
  // the kernels); parameters packed into one broadcast per owner, or each broadcast in place.
  for (int world : {2, 3})
    for (const char* optimizer : {"sgd", "adam", "sgd:auto", "adam:auto"})
      for (const char* inPlace : {"65536", "0"}) {
      if (inPlace[0] == '0' && world == 3 && optimizer[0] == 's') continue;  // enough combinations
      auto results = runWorkerGroup({.worker = "zero_vs_ddp", .worldSize = world,
                                     .args = {std::string("optimizer=") + optimizer, std::string("in_place_bytes=") + inPlace}});
      requireAllOk(results);
      std::size_t held = 0, whole = 0;
      for (const auto& r : results) {
        INFO(world << " ranks, " << optimizer << ", in place from " << inPlace << " bytes: " << r.output);
        CHECK_THAT(r.output, Catch::Contains("identical after step 3"));
        held += number(r.output, "state bytes ");
        whole = number(r.output, " of ");
        // No rank holds more than its share plus the largest parameter (the packing's bound).
        CHECK(number(r.output, "state bytes ") <= whole / static_cast<std::size_t>(world) + 960 * 4 * 2);
      }
      CHECK(held == whole);  // every parameter's state is held exactly once
    }
}

TEST_CASE("zero: the control - the local step without the broadcast fails the check", "[sharding][zero][control]") {
  auto results = runWorkerGroup({.worker = "zero_vs_ddp", .worldSize = 2, .args = {"control=1"}});
  requireAllOk(results);
  for (const auto& r : results) CHECK_THAT(r.output, Catch::Contains("differs at step 0"));
}

TEST_CASE("zero: shards saved on 2 ranks resume on 3, and on 4 resume on 2, bit-identical to the whole optimizer", "[sharding][zero]") {
  for (const auto& [from, to] : {std::pair{2, 3}, std::pair{4, 2}})
    for (const char* optimizer : {"sgd", "adam"}) {
      const auto dir = std::filesystem::temp_directory_path() /
                       ("ctorch-zero-reshard-" + std::to_string(::getpid()) + "-" + std::to_string(from) + optimizer);
      std::filesystem::remove_all(dir);
      std::filesystem::create_directories(dir);
      const std::string common[] = {std::string("optimizer=") + optimizer, "dir=" + dir.string()};
      requireAllOk(runWorkerGroup({.worker = "zero_reshard", .worldSize = from, .args = {common[0], common[1], "phase=save"}}));
      auto results = runWorkerGroup({.worker = "zero_reshard", .worldSize = to, .args = {common[0], common[1], "phase=resume"}});
      requireAllOk(results);
      for (const auto& r : results) {
        INFO(from << " -> " << to << " ranks, " << optimizer << ": " << r.output);
        CHECK_THAT(r.output, Catch::Contains("identical after resumed step 3"));
      }
      std::filesystem::remove_all(dir);
    }
}

TEST_CASE("zero: a shard of another optimizer, shards that miss a parameter, or parameters of two dtypes are refused by name", "[sharding][zero]") {
  auto results = runWorkerGroup({.worker = "zero_refusals", .worldSize = 2});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("the shards hold Adam state, the optimizer is SGD"));
    CHECK_THAT(r.output, Catch::Contains("no shard holds parameter"));
    CHECK_THAT(r.output, Catch::Contains("the parameters must share one dtype and device (found Float on cpu and Double on cpu)"));
  }
}
