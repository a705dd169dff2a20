// Process-wide settings that make CPU training fast without changing any result: intra-op threads
// sized to the CPUs this rank may use, OpenBLAS kept to the same count (it ignores LibTorch's
// setting, and its idle threads otherwise spin in sched_yield on the cores the others compute on),
// and a glibc heap that keeps freed activation memory instead of returning it to the kernel after
// every step. ctorch-train calls both first thing; a loop of your own should too (docs/ddp.md,
// "Fast CPU training"; docs/trainer.md and docs/performance.md have the measurements).
#pragma once

#include <string>

namespace ctorch {

struct ThreadChoice {
  int threads = 1;
  std::string reason;  // "requested", "OMP_NUM_THREADS=1", "2 CPUs / 1 local rank"
};

// requested > 0: that many. Else OMP_NUM_THREADS when set (LibTorch's own rule). Else the CPUs in
// this process's affinity mask divided by the ranks on this node (at least 1). Applies the choice to
// LibTorch and OpenBLAS and returns it. localWorldSize < 1: LOCAL_WORLD_SIZE from the environment
// (the launcher's worker contract), 1 when unset.
ThreadChoice configureThreads(int requested = 0, int localWorldSize = 0);

// glibc's mallopt: activations up to 32 MiB come from the heap, and up to 1 GiB of freed heap is
// kept. Without it, glibc returns the freed activations of every step to the kernel and the next
// step faults them in again, zeroed (the MNIST CNN's step: 85 ms -> 68 ms on the 2-core VM, one
// thread). Call it before training allocates; it does nothing on other C libraries.
void tuneAllocator();

}  // namespace ctorch
