// An allreduce for ranks that share one host's memory: each rank writes its tensor into a shared
// segment, each sums its own slice of every rank's copy, and each copies the result back — no
// sockets, no kernel copies. DDPOptions().commHook(CommHook::kSharedMemory) reduces gradients with it;
// it is public so a user's own loop can reduce other tensors the same way.
#pragma once

#include "ctorch/errors.hpp"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace c10d {
class ProcessGroup;
}

namespace ctorch {

struct SharedMemoryAllreduceOptions {
  // How long a rank waits for the others at each step of the reduction before it gives up with
  // DistributedTimeout (the process group's timeout is the natural choice).
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
  // The segment holds (world size + 1) slots of this many bytes; larger tensors go through in
  // chunks of it. 1 MiB keeps a chunk in the cache and the segment small (/dev/shm is often 64 MiB).
  TORCH_ARG(std::int64_t, chunkBytes) = std::int64_t{1} << 20;

 public:
  // Throws ConfigError for values that cannot work.
  void validate() const;
};

class SharedMemoryAllreduce {
 public:
  enum class Op { kSum, kAverage };

  // A collective over `group` (every rank calls it). Rank 0 creates an anonymous segment (its name
  // is removed as soon as every rank has it open: nothing is left in /dev/shm, even after a crash)
  // and the others map it. Returns null on every rank when some rank cannot map it (another host,
  // another IPC namespace, no room in /dev/shm): the caller then uses the group's own allreduce.
  // Throws DistributedError / DistributedTimeout when the group's collectives fail.
  static std::shared_ptr<SharedMemoryAllreduce> create(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                       const SharedMemoryAllreduceOptions& options = {});

  ~SharedMemoryAllreduce();
  SharedMemoryAllreduce(const SharedMemoryAllreduce&) = delete;
  SharedMemoryAllreduce& operator=(const SharedMemoryAllreduce&) = delete;

  // In place: afterwards every rank holds the sum (or mean) of all ranks' tensors, summed in rank
  // order (the same bits on every rank, and from run to run). A dense, contiguous CPU tensor of a
  // floating or integer type, of the same size and type on every rank, in the same call order.
  // Throws DistributedError when a peer has gone (noticed within ~10 ms) or another rank failed,
  // DistributedTimeout when a peer does not arrive within the timeout (a stopped process); after
  // either, every later call fails at once: the segment's protocol is out of step.
  // kAverage needs a floating-point tensor.
  // Runs on the calling thread, after every call allreduceAsync queued before it.
  void allreduce(at::Tensor& tensor, Op op = Op::kSum);
  // The same, run on this object's worker thread (calls run in the order they are made): the
  // future completes with `tensor`, reduced in place, or holds the error allreduce() would throw.
  // The tensor must stay untouched until then. The worker thread needs a core of its own to pay:
  // on a host whose cores all compute, it takes its time from the caller's.
  c10::intrusive_ptr<c10::ivalue::Future> allreduceAsync(const at::Tensor& tensor, Op op = Op::kSum);

  // Where this rank's time in the reductions went, since it was created. Each call passes two
  // barriers per chunk: at each, exactly one rank arrives last and goes on at once; the others wait.
  struct Stats {
    std::int64_t calls = 0;
    std::chrono::nanoseconds total{0};    // inside the reductions (work and waits)
    std::chrono::nanoseconds waiting{0};  // of which waiting at a barrier for the other ranks
    std::int64_t waits = 0;               // barriers this rank reached before another rank (counted as it begins to wait)
    std::int64_t lastArrivals = 0;        // barriers this rank reached last (it waited for nobody)
  };
  Stats stats() const;

  int rank() const;
  int worldSize() const;

 private:
  struct Impl;
  explicit SharedMemoryAllreduce(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

} // namespace ctorch
