// Reduce-scatter and all-gather of flat 1-D tensors over a given process group: the two collectives
// gradient sharding (ZeRO-2) and full sharding (FSDP) are made of, as Python's
// dist.reduce_scatter_tensor / dist.all_gather_into_tensor, on LibTorch 1.13 and 2.x alike.
//
//   at::Tensor flat = ...;                          // numel = world * shard (pad with shardNumel)
//   at::Tensor mine = at::empty({shard}, flat.options());
//   ctorch::reduceScatter(group, flat, mine);      // mine = sum over ranks of chunk `rank`
//   ctorch::allGather(group, mine, flat);          // flat = every rank's chunk, in rank order
//
// CPU tensors (Gloo) go around a ring of point-to-point sends: rank r sends to r+1 and receives
// from r-1, N-1 hops, so each rank sends and receives (N-1)/N of the buffer — half of what an
// allreduce of the whole buffer moves, which is what LibTorch 2.x's Gloo does for reduce-scatter
// (1.13's Gloo has none). Each hop is cut into segments that are forwarded as soon as they arrive.
//
// The summation order is fixed, so the result is the same bits on every run: chunk c (rank c's) is
// summed around the ring starting at rank c+1,
//     ((x[c+1] + x[c+2]) + ...) + x[c]        (rank indices mod N, element-wise, in the dtype)
// which at 2 ranks is x0 + x1 for both chunks, i.e. what any allreduce gives; at 3 and more ranks
// it may differ from an allreduce in the last bits (another association of the same sum).
//
// CUDA tensors use NCCL's own collective (reduce-scatter / all-gather base), whose order is NCCL's,
// where the group hands CUDA tensors to NCCL. Under Gloo (e.g. two ranks sharing one GPU, which
// NCCL refuses) they are copied to the host, go around the same ring in the same order as CPU
// tensors (the same bits), and the result is copied back: Gloo's send / recv read host memory only.
//
// Every rank of the group calls each collective, in the same order, from one thread at a time.
// A failed send or receive (a peer gone, a wait past the group's timeout) is a DistributedError
// (DistributedTimeout) naming this rank, the collective and the peer; the group is then out of
// step and must be replaced (ResilientTraining::recover() does).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <cstdint>

namespace c10d {
class ProcessGroup;
}

namespace ctorch {

struct FlatCollectiveOptions {
  // The ring forwards a hop in pieces of this many bytes, so that the next hop starts before the
  // whole chunk has arrived. It changes the speed only, never the result.
  TORCH_ARG(std::int64_t, segmentBytes) = std::int64_t{1} << 20;

 public:
  // Throws ConfigError for values that cannot work.
  void validate() const;
};

// The length of each rank's shard of a flat buffer of `numel` elements: numel / worldSize rounded
// up. A caller pads its flat buffer to shardNumel * worldSize elements (zeros in the padding keep
// a sum unchanged) — the collectives themselves take exact multiples only.
std::int64_t shardNumel(std::int64_t numel, int worldSize);

// `output` (numel = input.numel() / world) becomes the sum over the ranks of chunk `rank` of
// `input`, summed in the order above. Both contiguous, the same dtype and device; `input` is not
// modified and must not overlap `output`. Throws ConfigError for mismatched sizes, dtypes or
// devices (before any communication).
void reduceScatter(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& input,
                   at::Tensor& output, const FlatCollectiveOptions& options = {});

// `output` (numel = world * input.numel()) becomes the concatenation of every rank's `input`, in
// rank order (copied bytes: exact). Same requirements as reduceScatter, except that `input` may be
// output's own chunk (gathering in place, as FSDP does).
void allGather(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& input,
               at::Tensor& output, const FlatCollectiveOptions& options = {});

} // namespace ctorch
