// ctorch's collectives for a loop's own values (collectives.hpp): real processes, a real TCPStore
// and Gloo on 127.0.0.1; every result checked against what each rank put in.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"

#include "ctorch/collectives.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/errors.hpp"

#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

using namespace ctorch::test;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::cout << "FAILED: " << what << std::endl;
    ++failures;
  }
}

} // namespace

// Three ranks: every helper against the values each rank contributed, then rank 2 leaves and the
// others' next collective is a DistributedError (what recover() takes), not a hang or a crash.
CTORCH_TEST_WORKER(collectives) {
  (void)args;
  // Before any group: a world of 1, the identity.
  expect(ctorch::allReduce(5.0) == 5.0, "without a group, allReduce is the identity");
  expect(ctorch::allGather(5.0) == std::vector<double>{5.0}, "without a group, allGather is [value]");
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
  const int rank = ctorch::getRank();
  const double r1 = rank + 1;  // 1, 2, 3
  expect(ctorch::allReduce(r1) == 6.0, "sum");
  expect(ctorch::allReduce(r1, ctorch::ReduceOp::kAvg) == 2.0, "average");
  expect(ctorch::allReduce(r1, ctorch::ReduceOp::kMin) == 1.0, "min");
  expect(ctorch::allReduce(r1, ctorch::ReduceOp::kMax) == 3.0, "max");
  expect(ctorch::allReduce(r1, ctorch::ReduceOp::kProduct) == 6.0, "product");
  expect(ctorch::allReduce(std::vector<double>{r1, 1.0, -r1}) == std::vector<double>{6.0, 3.0, -6.0}, "vector sum");
  // A tensor in place, non-contiguous (a transposed view), float.
  at::Tensor m = (torch::arange(6, torch::kFloat32).reshape({2, 3}) * r1).t();
  ctorch::allReduce(m);
  expect(torch::equal(m, (torch::arange(6, torch::kFloat32).reshape({2, 3}) * 6).t()), "tensor sum in place, transposed");
  // Integers average by floor division: (1 + 2 + 4) / 3 = 2.
  at::Tensor n = torch::tensor({rank == 2 ? 4 : rank + 1}, torch::kInt64);
  ctorch::allReduce(n, ctorch::ReduceOp::kAvg);
  expect(n.item<std::int64_t>() == 2, "integer average (floor)");
  // Broadcast from rank 2.
  expect(ctorch::broadcast(10.0 * rank, 2) == 20.0, "broadcast of a double from rank 2");
  at::Tensor b = torch::full({3}, static_cast<float>(rank));
  ctorch::broadcast(b, 1);
  expect(torch::equal(b, torch::full({3}, 1.0f)), "broadcast of a tensor from rank 1");
  // All-gather, in rank order.
  expect(ctorch::allGather(static_cast<double>(rank * rank)) == std::vector<double>{0.0, 1.0, 4.0}, "allGather of doubles");
  const auto parts = ctorch::allGather(torch::tensor({rank, -rank}, torch::kInt32));
  expect(parts.size() == 3, "allGather: one tensor per rank");
  for (int r = 0; r < static_cast<int>(parts.size()); ++r)
    expect(torch::equal(parts[static_cast<size_t>(r)], torch::tensor({r, -r}, torch::kInt32)), "allGather: rank order");
  // Gather to rank 1 only.
  const auto got = ctorch::gather(torch::full({2}, static_cast<double>(rank)), 1);
  if (rank == 1) {
    expect(got.size() == 3, "gather: rank 1 gets every rank's");
    for (int r = 0; r < static_cast<int>(got.size()); ++r)
      expect(torch::equal(got[static_cast<size_t>(r)], torch::full({2}, static_cast<double>(r))), "gather: rank order");
  } else {
    expect(got.empty(), "gather: the others get nothing");
  }
  // A rank outside the group is a ConfigError naming it, before any collective (so no rank waits).
  try {
    ctorch::broadcast(1.0, 3);
    expect(false, "broadcast from rank 3 of 3 is refused");
  } catch (const ctorch::ConfigError& e) {
    expect(std::string(e.what()).find("rank 3 is not in the group (world size 3)") != std::string::npos,
           std::string("the refusal names the rank: ") + e.what());
  }
  ctorch::barrier();
  if (rank == 2) std::_Exit(failures == 0 ? 0 : 1);  // leaves without a word
  try {
    for (int i = 0; i < 100; ++i) ctorch::allReduce(1.0);
    expect(false, "an allReduce without rank 2 fails");
  } catch (const ctorch::DistributedError& e) {
    std::cout << "lost peer: " << e.what() << std::endl;
    expect(std::string(e.what()).find("allReduce failed") != std::string::npos, "the failure names the collective");
  }
  std::cout << (failures == 0 ? "ok" : "failures") << std::endl;
  std::_Exit(failures == 0 ? 0 : 1);  // the group is broken: no orderly teardown
}

TEST_CASE("collectives: allReduce, broadcast, allGather and gather of a loop's own values over Gloo, 3 ranks, and a lost "
          "peer is a DistributedError (issue 28.8)",
          "[collectives]") {
  auto results = runWorkerGroup({.worker = "collectives", .worldSize = 3, .timeout = std::chrono::seconds(90)});
  requireAllOk(results);
  for (int r : {0, 1}) {
    INFO(results[static_cast<size_t>(r)].output);
    CHECK(results[static_cast<size_t>(r)].output.find("lost peer: rank " + std::to_string(r) + ": allReduce failed") !=
          std::string::npos);
    CHECK(results[static_cast<size_t>(r)].output.find("FAILED") == std::string::npos);
  }
}
