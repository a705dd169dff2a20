#include "ctorch/process_tuning.hpp"

#include <ATen/Parallel.h>

#include <dlfcn.h>
#include <malloc.h>
#include <sched.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>

namespace ctorch {

namespace {

int affinityCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::max(1, CPU_COUNT(&set));
}

// The user's own OpenBLAS setting (which OpenBLAS read when it loaded), if any.
const char* blasEnvironment(std::string& name) {
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"}) {
    const char* value = std::getenv(var);
    if (value && *value) {
      name = var;
      return value;
    }
  }
  return nullptr;
}

}  // namespace

// OpenBLAS is reached through LibTorch's BLAS dependency when the system's libblas is OpenBLAS;
// its thread count is set through its own entry points when it is loaded (no link dependency).
int setBlasThreads(int threads) {
  using SetThreads = void (*)(int);
  using GetThreads = int (*)();
  auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  auto* get = reinterpret_cast<GetThreads>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (!get) return 0;
  if (set && threads > 0) set(threads);
  return std::max(0, get());
}

namespace {

// The host's load over the last minute (/proc/loadavg), or nullopt.
std::optional<double> loadAverage() {
  std::ifstream in("/proc/loadavg");
  double load = 0;
  if (in >> load && std::isfinite(load) && load >= 0) return load;
  return std::nullopt;
}

}  // namespace

std::string busyHostWarning(int threads, int localWorldSize, double load, int cpus) {
  if (threads < 2 || cpus < 1 || !(load >= static_cast<double>(cpus))) return "";
  std::ostringstream os;
  os.precision(3);
  os << "the host is busy (load " << load << " over the last minute on " << cpus << " CPUs): " << threads
     << " threads per rank for " << localWorldSize << " local rank" << (localWorldSize == 1 ? "" : "s")
     << " will wait for each other; OMP_NUM_THREADS=1 (or fewer threads) may run much faster. "
        "A resumed run is bit-identical only with the same number of threads";
  return os.str();
}

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
    if (const auto load = loadAverage())
      choice.busyHost = busyHostWarning(choice.threads, localWorldSize, *load,
                                        static_cast<int>(std::min<long>(::sysconf(_SC_NPROCESSORS_ONLN), 1 << 20)));
  }
  if (at::get_num_threads() != choice.threads) at::set_num_threads(choice.threads);
  // OpenBLAS on the calling thread: LibTorch calls BLAS from inside its own parallel loops (the
  // convolutions), so a second pool on the same cores only fights the first (spinning in
  // sched_yield while LibTorch's threads compute, or taking a core from the other ranks).
  std::string var;
  if (const char* value = blasEnvironment(var)) {
    choice.blasThreads = setBlasThreads(0);
    choice.blasReason = var + "=" + value;
  } else {
    choice.blasThreads = setBlasThreads(1);
    choice.blasReason = "one per calling thread";
  }
  return choice;
}

void tuneAllocator() {
  // Setting either disables glibc's dynamic thresholds; both together keep per-step allocations
  // (conv activations of several MiB) in a heap that is not trimmed back after every step.
  mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
  mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
}

}  // namespace ctorch
