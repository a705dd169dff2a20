// Times the flat collectives sharding needs on Gloo (run by bench/shard_collectives.sh, one process per
// rank): ctorch's ring reduceScatter against an allreduce of the whole buffer then taking this rank's
// chunk, and ctorch's ring allGather against c10d's list allgather, per buffer size; and the ring
// allGather of the same elements cast to bfloat16 (FSDP's mixed-precision gather).
//
// Usage (torchrun environment set): shard_collectives_bench <MB,MB,...> <reps> [segment bytes]
// Prints, on rank 0, one line per size and method: "size_mb=16 method=ring_reduce_scatter median_ms=...".
#include "core/compat.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/flat_collectives.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

double medianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The median over `reps` runs of `op`, each started together on every rank (after a barrier), as
// rank 0's wall time.
double timeIt(int reps, const std::function<void()>& op) {
  op();  // warm-up: connections, allocations
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    ctorch::barrier();
    const auto start = std::chrono::steady_clock::now();
    op();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  return medianOf(ms);
}

} // namespace

int main(int argc, char** argv) {
  std::vector<int> sizesMb{1, 16, 64};
  if (argc > 1) {
    sizesMb.clear();
    std::stringstream list(argv[1]);
    for (std::string item; std::getline(list, item, ',');) sizesMb.push_back(std::stoi(item));
  }
  const int reps = argc > 2 ? std::stoi(argv[2]) : 5;
  ctorch::FlatCollectiveOptions ring;
  if (argc > 3) ring.segmentBytes(std::stoll(argv[3]));
  const auto group = ctorch::initProcessGroup();
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  auto report = [&](int mb, const char* method, double ms) {
    if (rank == 0) std::cout << "size_mb=" << mb << " world=" << world << " method=" << method << " median_ms=" << ms << std::endl;
  };
  for (int mb : sizesMb) {
    const std::int64_t numel = ctorch::shardNumel(std::int64_t{mb} << 18, world) * world;  // float32
    const std::int64_t chunk = numel / world;
    at::Tensor flat = torch::randn({numel}), shard = torch::empty({chunk});
    report(mb, "ring_reduce_scatter", timeIt(reps, [&] { ctorch::reduceScatter(group, flat, shard, ring); }));
    report(mb, "allreduce_then_chunk", timeIt(reps, [&] {
             std::vector<at::Tensor> whole{flat.clone()};
             group->allreduce(whole)->wait();
             shard.copy_(whole[0].narrow(0, rank * chunk, chunk));
           }));
    // LibTorch 2.x's own Gloo reduce-scatter of a flat buffer (1.13 has none).
    try {
      report(mb, "c10d_reduce_scatter_base", timeIt(reps, [&] { ctorch::compat::reduceScatterFlat(*group, shard, flat)->wait(); }));
    } catch (const std::exception&) {
      report(mb, "c10d_reduce_scatter_base_unsupported", 0);
    }
    report(mb, "ring_all_gather", timeIt(reps, [&] { ctorch::allGather(group, shard, flat, ring); }));
    // FSDP mixed precision's gather (MixedPrecisionPolicy::paramDtype bfloat16): the same elements, each
    // rank's float32 shard cast to bfloat16, then gathered: half the bytes on the wire.
    at::Tensor flat16 = torch::empty({numel}, torch::kBFloat16);
    report(mb, "ring_all_gather_bf16_cast", timeIt(reps, [&] { ctorch::allGather(group, shard.to(torch::kBFloat16), flat16, ring); }));
    report(mb, "c10d_list_allgather", timeIt(reps, [&] {
             std::vector<std::vector<at::Tensor>> out(1);
             for (int r = 0; r < world; ++r) out[0].push_back(torch::empty({chunk}));
             std::vector<at::Tensor> in{shard};
             group->allgather(out, in)->wait();
           }));
    report(mb, "c10d_list_allgather_then_cat", timeIt(reps, [&] {
             std::vector<std::vector<at::Tensor>> out(1);
             for (int r = 0; r < world; ++r) out[0].push_back(torch::empty({chunk}));
             std::vector<at::Tensor> in{shard};
             group->allgather(out, in)->wait();
             at::cat_out(flat, out[0]);
           }));
  }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}
