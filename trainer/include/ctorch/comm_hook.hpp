// How DistributedDataParallel moves gradients (CommHook) and when the shared-memory hook reduces them
// (GradientReduction): plain enums and their names, with no LibTorch include, so a program's own
// command line can parse straight into them (ctorch-train's --comm-hook and --gradient-reduction).
// Python's counterpart: DDP.register_comm_hook with torch.distributed.algorithms.ddp_comm_hooks.
#pragma once

#include <optional>
#include <string_view>

namespace ctorch {

// Built-in gradient communication hooks (c10d's, as Python's register_comm_hook with
// default_hooks.allreduce_hook / fp16_compress_hook).
enum class CommHook {
  kNone,          // the Reducer's own allreduce (gradients divided by the world size)
  kAllreduce,     // the built-in ALLREDUCE hook: same result, through the hook path
  kFp16Compress,  // gradients cast to float16 for the allreduce, back to their dtype after
  // ctorch's own: when every rank can map one shared-memory segment (all on one host, CPU tensors),
  // buckets are averaged through it (SharedMemoryAllreduce: no sockets, the same bits on every rank);
  // otherwise (other hosts, NCCL) the Reducer's own allreduce, as kNone. commHookInUse() says which.
  kSharedMemory,
  // Only ever reported, by commHookInUse(): a hook the program gave to registerCommHook.
  // DDPOptions::commHook refuses it.
  kCustom,
};

// When CommHook::kSharedMemory reduces the gradient buckets (the same bits either way).
enum class GradientReduction {
  // Each bucket as soon as its gradients are ready, on a helper thread, while the backward pass
  // goes on. Faster even where every core computes: a rank that waits for a slower one leaves its
  // core to the other's helper thread (docs/performance.md).
  kOverlapped,
  // Every bucket at the end of the backward pass, on the thread that ran it: the ranks meet once per
  // step, and no helper thread runs beside the computation.
  kAfterBackward,
};

// "none", "allreduce", "fp16 compress", "shared memory", "custom".
constexpr const char* toString(CommHook hook) {
  switch (hook) {
    case CommHook::kAllreduce: return "allreduce";
    case CommHook::kFp16Compress: return "fp16 compress";
    case CommHook::kSharedMemory: return "shared memory";
    case CommHook::kCustom: return "custom";
    case CommHook::kNone: break;
  }
  return "none";
}

// "overlapped", "after backward".
constexpr const char* toString(GradientReduction reduction) {
  return reduction == GradientReduction::kAfterBackward ? "after backward" : "overlapped";
}

}  // namespace ctorch
