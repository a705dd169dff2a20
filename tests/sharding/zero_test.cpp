// ZeRO stage 1 (ctorch::ZeroRedundancyOptimizer) against DDP with the whole optimizer, with real
// processes, TCPStore and Gloo on 127.0.0.1: the parameters are bit-identical after every step (a
// parameter's update is the same operations on the same averaged gradient, computed by its owner;
// the broadcast copies bytes), with SGD + momentum + weight decay and with Adam, at 2 and 3 ranks.
// A control steps the local share without the broadcast: then the check must fail.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/ddp.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/zero_redundancy_optimizer.hpp"

#include <torch/torch.h>

#include <iostream>
#include <string>

using namespace ctorch::test;
using ddptest::arg;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    // Parameters of unequal sizes, so the packing gives each rank a different share.
    a = register_module("a", torch::nn::Linear(12, 40));
    b = register_module("b", torch::nn::Linear(40, 24));
    c = register_module("c", torch::nn::Linear(24, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return c(torch::tanh(b(torch::relu(a(x))))); }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(Net);

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const std::string& kind, std::vector<at::Tensor> params) {
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(1e-3));
}

bool bitIdentical(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

// args: optimizer=<sgd|adam> control=<0|1>. Prints "identical after step k" for each step, or
// "differs at step k"; exit 0 either way unless something failed.
CTORCH_TEST_WORKER(zero_vs_ddp) {
  const std::string kind = arg(args, "optimizer", "sgd");
  const bool control = arg(args, "control", "0") == "1";
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  torch::manual_seed(11);
  Net whole, sharded;
  {
    torch::NoGradGuard noGrad;
    for (std::size_t i = 0; i < whole->parameters().size(); ++i) sharded->parameters()[i].copy_(whole->parameters()[i]);
  }
  ctorch::DistributedDataParallel ddpWhole(whole), ddpSharded(sharded);
  auto reference = makeOptimizer(kind, ddpWhole.parameters());
  ctorch::ZeroRedundancyOptimizer zero(ddpSharded.parameters(),
                                       [&](std::vector<at::Tensor> share) { return makeOptimizer(kind, share); });
  for (int step = 0; step < 4; ++step) {
    torch::manual_seed(1000 + 17 * step + rank);  // each rank its own batch
    const auto x = torch::randn({8, 12});
    const auto y = torch::randn({8, 3});
    reference->zero_grad();
    torch::mse_loss(ddpWhole(x), y).backward();
    reference->step();
    zero.zeroGrad();
    torch::mse_loss(ddpSharded(x), y).backward();
    if (control) zero.localOptimizer()->step();
    else zero.step();
    if (!bitIdentical(whole->parameters(), sharded->parameters())) {
      std::cout << "differs at step " << step << "\n";
      ctorch::destroyProcessGroup();
      return 0;
    }
    std::cout << "identical after step " << step << "\n";
  }
  // Optimizer state: each rank holds its share's only (SGD: one momentum buffer per parameter;
  // Adam: two moments). The whole optimizer's state is the sum over the ranks.
  std::cout << "state bytes " << zero.localStateBytes() << " of " << [&] {
    std::size_t bytes = 0;
    for (const auto& p : whole->parameters()) bytes += p.nbytes();
    return bytes * (kind == "adam" ? 2 : 1);
  }() << " world " << world << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

std::size_t number(const std::string& text, const std::string& after) {
  const auto at = text.find(after);
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
  for (int world : {2, 3})
    for (const char* optimizer : {"sgd", "adam"}) {
      auto results = runWorkerGroup({.worker = "zero_vs_ddp", .worldSize = world, .args = {std::string("optimizer=") + optimizer}});
      requireAllOk(results);
      std::size_t held = 0, whole = 0;
      for (const auto& r : results) {
        INFO(world << " ranks, " << optimizer << ": " << r.output);
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
