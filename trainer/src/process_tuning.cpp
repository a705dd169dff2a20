#include "ctorch/process_tuning.hpp"

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>

namespace ctorch {

namespace {

int affinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// OpenBLAS is reached through LibTorch's BLAS dependency when the system's libblas is OpenBLAS;
// its thread count is set through its own entry point when that is loaded (no link dependency).
void setBlasThreads(int threads) {
  using SetThreads = void (*)(int);
  if (auto* f = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(threads);
}

}  // namespace

ThreadChoice configureThreads(int requested, int localWorldSize) {
  if (localWorldSize < 1) {
    const char* env = std::getenv("LOCAL_WORLD_SIZE");
    char* end = nullptr;
    const long n = env ? std::strtol(env, &end, 10) : 0;
    localWorldSize = env && end != env && *end == '\0' && n >= 1 && n <= 1 << 20 ? static_cast<int>(n) : 1;
  }
  ThreadChoice choice;
  if (requested > 0) {
    choice.threads = requested;
    choice.reason = "requested";
  } else if (const char* omp = std::getenv("OMP_NUM_THREADS"); omp && *omp) {
    choice.threads = std::max(1, at::get_num_threads());
    choice.reason = std::string("OMP_NUM_THREADS=") + omp;
  } else {
    const int cpus = affinityCpus();
    choice.threads = std::max(1, cpus / std::max(1, localWorldSize));
    choice.reason = std::to_string(cpus) + " CPUs / " + std::to_string(localWorldSize) + " local rank" +
                    (localWorldSize == 1 ? "" : "s");
  }
  if (at::get_num_threads() != choice.threads) at::set_num_threads(choice.threads);
  setBlasThreads(choice.threads);
  return choice;
}

void tuneAllocator() {
  // Setting either disables glibc's dynamic thresholds; both together keep per-step allocations
  // (conv activations of several MiB) in a heap that is not trimmed back after every step.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
}

}  // namespace ctorch
