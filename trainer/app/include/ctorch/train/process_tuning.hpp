// Process-wide settings that make CPU training fast without changing any result: intra-op threads
// sized to the CPUs this rank may use, OpenBLAS kept to the same count (its idle threads otherwise
// spin in sched_yield on the cores the others compute on), and a glibc heap that keeps freed
// activation memory instead of returning it to the kernel after every step (docs/trainer.md has the
// measurements).
#pragma once

#include <string>

namespace ctorch::train {

struct ThreadChoice {
  int threads = 1;
  std::string reason;  // "--threads", "OMP_NUM_THREADS=1", "2 CPUs / 1 local rank"
};

// requested > 0: that many. Else OMP_NUM_THREADS when set (LibTorch's own rule). Else the CPUs in
// this process's affinity mask divided by the ranks on this node (at least 1). Applies the choice to
// LibTorch and OpenBLAS and returns it.
ThreadChoice configureThreads(int requested, int localWorldSize);

// mallopt: activations up to 32 MiB come from the heap, and up to 1 GiB of freed heap is kept.
void tuneAllocator();

}  // namespace ctorch::train
