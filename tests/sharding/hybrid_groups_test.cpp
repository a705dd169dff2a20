// ctorch::newGroup (Python's dist.new_group) and ctorch::hybridShardGroups (hybrid sharding's shard and
// replicate groups): who is in which group, checked by an allreduce in each, with real processes,
// TCPStore and Gloo on 127.0.0.1; layouts that cannot work are refused in one line.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/fully_sharded_data_parallel.hpp"
#include "ctorch/hybrid_shard_groups.hpp"

#include <torch/torch.h>

#include <iostream>
#include <map>
#include <string>
#include <vector>

using namespace ctorch::test;
using ddptest::arg;

namespace hybrid_groups_test {

// "<what> <rank in group>/<size> sum <sum of the members' global ranks>", or "<what> none".
void describe(const std::string& what, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group) {
    std::cout << what << " none\n";
    return;
  }
  std::vector<at::Tensor> t{torch::full({1}, static_cast<double>(ctorch::getRank()), torch::kFloat64)};
  group->allreduce(t)->wait();
  std::cout << what << " " << group->getRank() << "/" << group->getSize() << " sum " << t[0].item<double>() << "\n";
}

// args: shard=<n> (explicit shard groups; absent: from LOCAL_WORLD_SIZE). Prints this rank's groups,
// then a newGroup of ranks {3, 1} (given unsorted) made after them, or the refusal.
CTORCH_TEST_WORKER(hybrid_groups) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  try {
    ctorch::HybridShardOptions options;
    if (const auto shard = arg(args, "shard", ""); !shard.empty()) options.shardSize(std::stoi(shard));
    const auto groups = ctorch::hybridShardGroups(options);
    std::cout << "layout " << groups.layout.replicas << "x" << groups.layout.shardSize << " node " << groups.layout.node
              << " local " << groups.layout.localRank << "\n";
    describe("shard", groups.shard);
    describe("replicate", groups.replicate);
    if (ctorch::getWorldSize() == 4) describe("subgroup", ctorch::newGroup({3, 1}));
  } catch (const ctorch::ConfigError& e) {
    std::cout << "refused: " << e.what() << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// newGroup's refusals, and FSDP given a replicate group without its shard group.
CTORCH_TEST_WORKER(new_group_refusals) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  for (const std::vector<int>& ranks : {std::vector<int>{}, std::vector<int>{0, 2}, std::vector<int>{1, 1}}) {
    try {
      (void)ctorch::newGroup(ranks);
      std::cout << "no refusal\n";
    } catch (const ctorch::ConfigError& e) {
      std::cout << "refused: " << e.what() << "\n";
    }
  }
  try {
    auto net = torch::nn::Linear(4, 4);
    ctorch::FullyShardedDataParallel fsdp(net, ctorch::FSDPOptions().replicateGroup(ctorch::getDefaultGroup()));
    std::cout << "no refusal\n";
  } catch (const ctorch::ConfigError& e) {
    std::cout << "refused: " << e.what() << "\n";
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// The torchrun environment of `nodes` x `perNode` ranks, numbered node by node.
std::map<int, std::map<std::string, std::string>> nodesEnv(const std::vector<int>& perNode) {
  std::map<int, std::map<std::string, std::string>> env;
  int rank = 0;
  for (std::size_t node = 0; node < perNode.size(); ++node)
    for (int local = 0; local < perNode[node]; ++local, ++rank)
      env[rank] = {{"LOCAL_RANK", std::to_string(local)}, {"LOCAL_WORLD_SIZE", std::to_string(perNode[node])},
                   {"GROUP_RANK", std::to_string(node)}};
  return env;
}

} // namespace hybrid_groups_test

using namespace hybrid_groups_test;

TEST_CASE("hybridShardLayout: nodes numbered node by node, refusals in one line", "[sharding][hybrid]") {
  const auto layout = ctorch::hybridShardLayout(6, 4, 3);
  CHECK(layout.replicas == 2);
  CHECK(layout.shardSize == 3);
  CHECK(layout.node == 1);
  CHECK(layout.localRank == 1);
  CHECK(layout.shardGroups == std::vector<std::vector<int>>{{0, 1, 2}, {3, 4, 5}});
  CHECK(layout.replicateGroups == std::vector<std::vector<int>>{{0, 3}, {1, 4}, {2, 5}});
  CHECK(ctorch::hybridShardLayout(4, 3, 4).replicas == 1);
  CHECK(ctorch::hybridShardLayout(4, 3, 1).replicateGroups == std::vector<std::vector<int>>{{0, 1, 2, 3}});
  CHECK_THROWS_WITH(ctorch::hybridShardLayout(6, 0, 4),
                    "hybrid sharding: a world of 6 ranks is not nodes x 4 ranks (the shard group's size must divide the world)");
  CHECK_THROWS_AS(ctorch::hybridShardLayout(4, 0, 0), ctorch::ConfigError);
  CHECK_THROWS_AS(ctorch::hybridShardLayout(4, 4, 2), ctorch::ConfigError);
}

TEST_CASE("hybridShardGroups: 4 processes as 2 nodes of 2, from shardSize and from the torchrun environment, and newGroup",
          "[sharding][hybrid]") {
  // The sums of the members' global ranks name the members: shard {0,1} 1, {2,3} 5; replicate
  // {0,2} 2, {1,3} 4; newGroup({3,1}) holds ranks 1 (its rank 0) and 3 (its rank 1), sum 4.
  const std::map<int, std::vector<std::string>> expected{
      {0, {"shard 0/2 sum 1\n", "replicate 0/2 sum 2\n", "subgroup none\n", "node 0 local 0"}},
      {1, {"shard 1/2 sum 1\n", "replicate 0/2 sum 4\n", "subgroup 0/2 sum 4\n", "node 0 local 1"}},
      {2, {"shard 0/2 sum 5\n", "replicate 1/2 sum 2\n", "subgroup none\n", "node 1 local 0"}},
      {3, {"shard 1/2 sum 5\n", "replicate 1/2 sum 4\n", "subgroup 1/2 sum 4\n", "node 1 local 1"}}};
  for (const bool fromEnv : {false, true}) {
    WorkerGroupOptions options{.worker = "hybrid_groups", .worldSize = 4};
    if (fromEnv) options.rankEnv = nodesEnv({2, 2});
    else options.args = {"shard=2"};
    auto results = runWorkerGroup(options);
    requireAllOk(results);
    for (int rank = 0; rank < 4; ++rank) {
      INFO((fromEnv ? "environment" : "shard=2") << ", rank " << rank << ": " << results[rank].output);
      CHECK_THAT(results[rank].output, Catch::Contains("layout 2x2"));
      for (const auto& line : expected.at(rank)) CHECK_THAT(results[rank].output, Catch::Contains(line));
    }
  }
}

TEST_CASE("hybridShardGroups: one node shards over it with no replicate group (plain FSDP)", "[sharding][hybrid]") {
  auto results = runWorkerGroup({.worker = "hybrid_groups", .worldSize = 2});  // LOCAL_WORLD_SIZE=2
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("layout 1x2"));
    CHECK_THAT(r.output, Catch::Contains(" sum 1\n"));
    CHECK_THAT(r.output, Catch::Contains("replicate none\n"));
  }
}

TEST_CASE("hybridShardGroups: a world that is not nodes x equal local sizes is refused on every rank in one line",
          "[sharding][hybrid]") {
  {  // 4 ranks in shard groups of 3
    auto results = runWorkerGroup({.worker = "hybrid_groups", .worldSize = 4, .args = {"shard=3"}});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(r.output);
      CHECK_THAT(r.output, Catch::Contains("refused: hybrid sharding: a world of 4 ranks is not nodes x 3 ranks"));
    }
  }
  {  // a node of 3 and a node of 1
    auto results = runWorkerGroup({.worker = "hybrid_groups", .worldSize = 4, .rankEnv = nodesEnv({3, 1})});
    requireAllOk(results);
    for (int rank = 0; rank < 4; ++rank) {
      INFO(results[rank].output);
      CHECK_THAT(results[rank].output, Catch::Contains("refused: hybrid sharding needs nodes of equal size: rank "));
      CHECK_THAT(results[rank].output, Catch::Contains(rank < 3 ? "rank 3 has LOCAL_WORLD_SIZE=1" : "rank 0 has LOCAL_WORLD_SIZE=3"));
    }
  }
  {  // equal nodes, but ranks not numbered node by node
    auto env = nodesEnv({2, 2});
    std::swap(env[1], env[2]);
    auto results = runWorkerGroup({.worker = "hybrid_groups", .worldSize = 4, .rankEnv = env});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(r.output);
      CHECK_THAT(r.output, Catch::Contains("refused: hybrid sharding needs ranks numbered node by node (torchrun's "
                                           "numbering): rank 1 has LOCAL_RANK=0, not 1 with LOCAL_WORLD_SIZE=2"));
    }
  }
}

TEST_CASE("newGroup: an empty list, a rank outside the world or given twice, and FSDP's replicate group alone are refused",
          "[sharding][hybrid]") {
  auto results = runWorkerGroup({.worker = "new_group_refusals", .worldSize = 2});
  requireAllOk(results);
  for (const auto& r : results) {
    INFO(r.output);
    CHECK_THAT(r.output, Catch::Contains("refused: newGroup: no ranks given\n"));
    CHECK_THAT(r.output, Catch::Contains("refused: newGroup: ranks [0, 2] are not all in the world of 2 ranks (0 to 1)\n"));
    CHECK_THAT(r.output, Catch::Contains("refused: newGroup: ranks [1, 1] name a rank twice\n"));
    CHECK_THAT(r.output, Catch::Contains("refused: FullyShardedDataParallel: FSDPOptions::replicateGroup needs processGroup"));
    CHECK(r.output.find("no refusal") == std::string::npos);
  }
}
