// ctorch::reduceScatter / ctorch::allGather on flat tensors (flat_collectives.hpp) with real processes,
// TCPStore and Gloo on 127.0.0.1, at 2, 3 and 4 ranks, float32 and float64, from one element per
// rank to a few MB: the reduce-scatter is bit-identical to a sum in the documented order, the
// all-gather to the concatenation; controls with a wrong order or a skipped hop must fail; a lost
// peer is a DistributedError on the others before the group's timeout, a silent one a timeout.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/collectives.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/flat_collectives.hpp"

#include <torch/torch.h>

#include <algorithm>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <string>
#include <thread>
#include <vector>

using namespace ctorch::test;
using ddptest::arg;

namespace {

// Values of widely different magnitudes, so that another summation order changes the last bits.
at::Tensor values(std::uint64_t seed, std::int64_t numel, at::ScalarType dtype) {
  torch::manual_seed(seed);
  auto base = torch::randn({numel}, torch::kFloat64);
  return (base * torch::exp(3 * torch::randn({numel}, torch::kFloat64))).to(dtype);
}

// Chunk c summed as flat_collectives.hpp documents: starting at rank c+1, around the ring, ending
// with rank c. Controls: "order" starts at rank c itself (the owner's part first, then around the
// ring), another association for every chunk at 3 ranks and more; "skip" leaves out the last hop
// (rank c's own part).
at::Tensor referenceSum(const std::vector<at::Tensor>& x, int c, std::int64_t m, const std::string& control) {
  const int world = static_cast<int>(x.size());
  auto part = [&](int r) { return x[static_cast<std::size_t>(r % world)].narrow(0, c * m, m); };
  const int first = control == "order" ? c : c + 1;
  at::Tensor acc = part(first).clone();
  const int terms = control == "skip" ? world - 1 : world;
  for (int k = 1; k < terms; ++k) acc = acc + part(first + k);
  return acc;
}

struct Size {
  std::int64_t chunk;         // elements per rank
  std::int64_t segmentBytes;  // the ring's segment (small ones give many ragged segments)
};

// args: control=<none|order|skip>. One line per check: "<collective> <dtype> m=<n>: <verdict>".
CTORCH_TEST_WORKER(flat_collectives) {
  const std::string control = arg(args, "control", "none");
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const auto group = ctorch::getDefaultGroup();
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  for (const auto dtype : {torch::kFloat32, torch::kFloat64})
    for (const Size size : {Size{1, 1 << 20}, Size{7, 24}, Size{1000, 256}, Size{262147, 1 << 20}}) {
      const std::int64_t m = size.chunk;
      const auto options = ctorch::FlatCollectiveOptions().segmentBytes(size.segmentBytes);
      const std::string tag = std::string(dtype == torch::kFloat32 ? "float32" : "float64") + " m=" + std::to_string(m);
      std::vector<at::Tensor> x;
      for (int r = 0; r < world; ++r) x.push_back(values(1000 + 31 * r + m, world * m, dtype));

      at::Tensor out = at::full({m}, -1.0, x[0].options());
      ctorch::reduceScatter(group, x[static_cast<std::size_t>(rank)], out, options);
      const bool same = torch::equal(out, referenceSum(x, rank, m, control));
      std::cout << "reduceScatter " << tag << ": " << (same ? "bit-identical" : "DIFFERS") << "\n";

      // Against an allreduce of the whole buffer: another association of the same sum, so within
      // 2 (N-1) eps sum|x| element-wise (each order is within (N-1) eps sum|x| of the exact sum).
      at::Tensor all = x[static_cast<std::size_t>(rank)].clone();
      ctorch::allReduce(all);
      const at::Tensor mine = all.narrow(0, rank * m, m);
      at::Tensor magnitude = at::zeros_like(out);
      for (const auto& xr : x) magnitude = magnitude + xr.narrow(0, rank * m, m).abs();
      const double eps = dtype == torch::kFloat32 ? std::numeric_limits<float>::epsilon()
                                                  : std::numeric_limits<double>::epsilon();
      const bool within = ((out - mine).abs() <= magnitude * (2.0 * (world - 1) * eps)).all().item<bool>();
      std::cout << "vs allreduce " << tag << ": " << (torch::equal(out, mine) ? "exact" : within ? "within" : "OUTSIDE")
                << "\n";

      std::vector<at::Tensor> y;
      for (int r = 0; r < world; ++r) y.push_back(values(5000 + 31 * r + m, m, dtype));
      at::Tensor expected = torch::cat(y);
      // The skip control: the chunk that comes the whole way round (the last hop's) never arrives.
      if (control == "skip") expected.narrow(0, ((rank + 1) % world) * m, m).fill_(0);
      at::Tensor gathered = at::zeros({world * m}, y[0].options());
      ctorch::allGather(group, y[static_cast<std::size_t>(rank)], gathered, options);
      std::cout << "allGather " << tag << ": " << (torch::equal(gathered, expected) ? "exact" : "DIFFERS") << "\n";
      at::Tensor inPlace = at::zeros({world * m}, y[0].options());
      inPlace.narrow(0, rank * m, m).copy_(y[static_cast<std::size_t>(rank)]);
      ctorch::allGather(group, inPlace.narrow(0, rank * m, m), inPlace, options);
      std::cout << "allGather in place " << tag << ": " << (torch::equal(inPlace, expected) ? "exact" : "DIFFERS")
                << "\n";
    }
  // Sizes that are not a multiple of the world size are refused before any communication.
  try {
    at::Tensor small = at::empty({1});
    ctorch::reduceScatter(group, at::zeros({world * 1 + 1}), small);
    std::cout << "uneven: accepted\n";
  } catch (const ctorch::ConfigError& e) {
    std::cout << "uneven: " << e.what() << "\n";
  }
  std::cout.flush();
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// args: collective=<reduceScatter|allGather> peer=<exits|silent> timeout_s=<n> dir=<scratch directory,
// peer=silent>. The last rank leaves after the group is up (or, silent, stays until every other rank
// caught its error, then leaves); the others run the collective and print what they got.
CTORCH_TEST_WORKER(flat_collectives_lost_peer) {
  namespace fs = std::filesystem;
  const std::string collective = arg(args, "collective", "reduceScatter");
  const bool silent = arg(args, "peer", "exits") == "silent";
  const std::chrono::seconds timeout(ddptest::argInt(args, "timeout_s", 60));
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(timeout));
  const auto group = ctorch::getDefaultGroup();
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  const fs::path dir = arg(args, "dir", ".");
  const auto caught = [&](int r) { return dir / ("caught-" + std::to_string(r)); };
  // Every survivor said it caught its error (a minute at most: a bound against a hang).
  const auto allCaught = [&] {
    for (int i = 0; i < 6000; ++i) {
      bool all = true;
      for (int r = 0; r + 1 < world; ++r) all = all && fs::exists(caught(r));
      if (all) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  };
  ctorch::barrier();
  if (rank == world - 1) {  // leaves without a word, at once or once the others gave up on it
    if (silent) allCaught();
    std::_Exit(0);
  }
  const std::int64_t m = 1 << 18;
  at::Tensor big = at::ones({world * m}), small = at::ones({m});
  try {
    if (collective == "allGather") ctorch::allGather(group, small, big);
    else ctorch::reduceScatter(group, big, small);
    std::cout << "no error" << std::endl;
  } catch (const ctorch::DistributedError& e) {
    const bool timedOut = dynamic_cast<const ctorch::DistributedTimeout*>(&e) != nullptr;
    std::cout << (timedOut ? "timed out: " : "lost peer: ") << e.what() << std::endl;
  }
  // With a silent peer, stay until every survivor's own wait has ended (leaving would end theirs
  // early with a closed connection).
  if (silent) {
    std::ofstream(caught(rank)) << "x";
    allCaught();
  }
  std::_Exit(0);  // the group is broken: no orderly teardown
}

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

constexpr std::size_t kChecks = 8;  // 2 dtypes x 4 sizes

} // namespace

TEST_CASE("flat collectives: reduceScatter is bit-identical to the documented order, allGather exact, at 2, 3 and 4 ranks",
          "[sharding][flat_collectives]") {
  for (int world : {2, 3, 4}) {
    auto results = runWorkerGroup({.worker = "flat_collectives", .worldSize = world, .timeout = std::chrono::seconds(150)});
    requireAllOk(results);
    for (const auto& r : results) {
      INFO(world << " ranks: " << r.output);
      CHECK(count(r.output, ": bit-identical") == kChecks);
      CHECK(count(r.output, "allGather float") == kChecks);
      CHECK(count(r.output, "vs allreduce") == kChecks);
      // At 2 ranks both orders are a + b == b + a; at more, some elements may differ in the last bits.
      if (world == 2) CHECK(count(r.output, ": exact") == 3 * kChecks);
      else CHECK(count(r.output, ": exact") >= 2 * kChecks);
      CHECK(count(r.output, "DIFFERS") == 0);
      CHECK(count(r.output, "OUTSIDE") == 0);
      CHECK_THAT(r.output, Catch::Contains("not " + std::to_string(world) + " (the world size) x 1"));
    }
  }
}

TEST_CASE("flat collectives: the controls - a wrong summation order and a skipped hop are detected",
          "[sharding][flat_collectives][control]") {
  auto order = runWorkerGroup({.worker = "flat_collectives", .worldSize = 3, .args = {"control=order"}});
  requireAllOk(order);
  for (const auto& r : order) {
    INFO(r.output);
    // (x[c] + x[c+1]) + x[c+2] against the ring's (x[c+1] + x[c+2]) + x[c]: the last bits of some
    // elements of the big chunks differ.
    CHECK_THAT(r.output, Catch::Contains("reduceScatter float32 m=262147: DIFFERS"));
    CHECK_THAT(r.output, Catch::Contains("reduceScatter float64 m=262147: DIFFERS"));
  }
  auto skip = runWorkerGroup({.worker = "flat_collectives", .worldSize = 3, .args = {"control=skip"}});
  requireAllOk(skip);
  for (const auto& r : skip) {
    INFO(r.output);
    CHECK(count(r.output, "reduceScatter float") == kChecks);
    CHECK(count(r.output, ": bit-identical") == 0);
    CHECK(count(r.output, "allGather float") == kChecks);
    CHECK(count(r.output, "DIFFERS") == 3 * kChecks);
  }
}

TEST_CASE("flat collectives: a lost peer is a DistributedError naming the rank and the collective, not a timeout",
          "[sharding][flat_collectives]") {
  for (const auto& [world, collective] : {std::pair{3, "reduceScatter"}, std::pair{4, "allGather"}}) {
    auto results = runWorkerGroup({.worker = "flat_collectives_lost_peer", .worldSize = world,
                                   .args = {std::string("collective=") + collective}, .timeout = std::chrono::seconds(60)});
    requireAllOk(results);
    for (int r = 0; r < world - 1; ++r) {
      const std::string& out = results[static_cast<std::size_t>(r)].output;
      INFO(world << " ranks, rank " << r << ": " << out);
      // "lost peer": a DistributedError that is not the timeout's, so noticed before it ran out.
      CHECK_THAT(out, Catch::Contains("lost peer: "));
      CHECK_THAT(out, Catch::Contains("rank " + std::to_string(r) + ": " + collective + " failed"));
    }
  }
}

TEST_CASE("flat collectives: a silent peer is a DistributedTimeout after the group's timeout, not a hang",
          "[sharding][flat_collectives]") {
  // 3 ranks, rank 2 silent: rank 0 waits to receive from it, rank 1 to send to it. The first wait to
  // run out is a DistributedTimeout; Gloo then closes that rank's connections, so a survivor whose
  // own wait had not yet run out may see its peer's connection closed instead (a DistributedError)
  // at the same moment. The silent rank stays until both caught theirs: nothing else ends a wait.
  // The timeout (5 s) also bounds the set-up (the store and Gloo's connections): a run whose ranks
  // missed it before the collective tests nothing and is run again.
  std::vector<ProcessResult> results;
  for (int attempt = 0; attempt < 3; ++attempt) {
    ctorch::test::TempDir dir("flat-silent-peer");
    results = runWorkerGroup({.worker = "flat_collectives_lost_peer", .worldSize = 3,
                              .args = {"collective=reduceScatter", "peer=silent", "timeout_s=5", "dir=" + dir.path().string()},
                              .timeout = std::chrono::seconds(90)});
    const bool setUpFailed = std::any_of(results.begin(), results.end(), [](const ProcessResult& r) {
      return r.exitCode == 1 && r.output.find("worker 'flat_collectives_lost_peer' failed: rank ") != std::string::npos;
    });
    if (!setUpFailed) break;
    WARN("attempt " << attempt + 1 << ": the ranks did not connect within the 5 s timeout; run again");
  }
  requireAllOk(results);
  int timedOut = 0;
  for (int r = 0; r < 2; ++r) {
    const std::string& out = results[static_cast<std::size_t>(r)].output;
    INFO("rank " << r << ": " << out);
    CHECK_THAT(out, Catch::Contains("rank " + std::to_string(r) + ": reduceScatter failed"));
    if (out.find("timed out: ") != std::string::npos) ++timedOut;
    else CHECK_THAT(out, Catch::Contains("lost peer: "));
  }
  CHECK(timedOut >= 1);
}

TEST_CASE("flat collectives: shard sizes, and what is refused before any communication", "[sharding][flat_collectives]") {
  CHECK(ctorch::shardNumel(10, 4) == 3);  // pad 10 to 12
  CHECK(ctorch::shardNumel(12, 4) == 3);
  CHECK(ctorch::shardNumel(0, 3) == 0);
  CHECK(ctorch::shardNumel(1, 4) == 1);
  CHECK_THROWS_AS(ctorch::shardNumel(10, 0), ctorch::ConfigError);
  CHECK_THROWS_AS(ctorch::FlatCollectiveOptions().segmentBytes(0).validate(), ctorch::ConfigError);
  at::Tensor in = at::zeros({4}), out = at::zeros({2});
  CHECK_THROWS_WITH(ctorch::reduceScatter({}, in, out), Catch::Contains("no process group"));
  CHECK_THROWS_WITH(ctorch::allGather({}, out, in), Catch::Contains("no process group"));
}
