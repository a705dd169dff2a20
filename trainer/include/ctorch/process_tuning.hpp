// Process-wide settings that make CPU training fast without changing any result: intra-op threads
// sized to the CPUs this rank may use, OpenBLAS single-threaded under them (its own pool ignores
// LibTorch's setting; LibTorch calls it from inside its parallel loops, and the two pools on the
// same cores fight), and a glibc heap that keeps freed activation memory instead of returning it to
// the kernel after every step.
// ctorch-train calls both first thing; a loop of your own should too (docs/ddp.md, "Fast CPU
// training"; docs/trainer.md and docs/performance.md have the measurements).
#pragma once

#include <string>

namespace ctorch {

struct ThreadChoice {
  int threads = 1;
  std::string reason;      // "requested", "OMP_NUM_THREADS=1", "2 CPUs / 1 local rank"
  int blasThreads = 0;     // OpenBLAS's thread count afterwards; 0 when OpenBLAS is not loaded
  std::string blasReason;  // "one per calling thread", "OPENBLAS_NUM_THREADS=2"
  // Set when the count was chosen from the CPUs (not asked for) while other work already keeps them
  // busy: one line saying so and what to do. Several threads per rank that wait for each other on
  // a busy host can be ten times slower than one.
  std::string busyHost;
};

// LibTorch's intra-op threads: requested > 0: that many. Else OMP_NUM_THREADS when set (LibTorch's
// own rule). Else the CPUs in this process's affinity mask divided by the ranks on this node (at
// least 1). localWorldSize < 1: LOCAL_WORLD_SIZE from the environment (the launcher's worker
// contract), 1 when unset.
// OpenBLAS (when it is LibTorch's BLAS): 1 thread, so that the intra-op threads are the only pool,
// unless OPENBLAS_NUM_THREADS (or GOTO_NUM_THREADS) is set: then OpenBLAS keeps what it read from
// it (a model whose time is in large matrix products called outside LibTorch's parallel loops, an
// MLP with 4096 hidden units, runs faster with OpenBLAS's own threads: docs/performance.md).
// Applies both and returns them.
ThreadChoice configureThreads(int requested = 0, int localWorldSize = 0);

// The line ThreadChoice::busyHost holds: "the host is busy (load 3.9 ... on 2 CPUs): ..." when a
// rank would run `threadsPerRank` >= 2 threads while the host's load over the last minute
// (/proc/loadavg) is already at least its online CPUs; "" otherwise.
std::string busyHostWarning(int threadsPerRank, int localWorldSize, double loadAverage, int cpus);

// OpenBLAS's own pool from code (what OPENBLAS_NUM_THREADS sets before it loads), e.g. after
// configureThreads for such a model. Returns the count OpenBLAS reports afterwards; 0 when LibTorch's
// BLAS is not OpenBLAS (nothing is set). threads < 1: only reads it.
int setBlasThreads(int threads);

// glibc's mallopt: activations up to 32 MiB come from the heap, and up to 1 GiB of freed heap is
// kept. Without it, glibc returns the freed activations of every step to the kernel and the next
// step faults them in again, zeroed (the MNIST CNN's DDP step: 248 ms without, 63 ms with it on
// the project's VM). A Python process gets the same from its environment:
// MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824. Cost: no higher peak, but up to
// 1 GiB of freed memory stays with the process instead of going back to the system
// (docs/ddp.md, "Fast CPU training"). Call it before training allocates; it does nothing on other
// C libraries.
void tuneAllocator();

}  // namespace ctorch
