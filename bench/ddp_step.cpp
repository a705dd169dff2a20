// Per-step time of ctorch::DistributedDataParallel: forward, backward (with the Reducer's bucketed
// allreduce) and an SGD step, on the process group from the environment, for an MLP (1.2 M
// parameters at hidden 1024), the seeds' MNIST CNN, or a tiny Linear(20, 1) whose step is almost
// nothing but one small allreduce. CTORCH_BENCH_HOOK=shared-memory selects CommHook::kSharedMemory.
// The CNN pools with ctorch::models::maxPool2x2 (what ctorch-train's CNN runs: max_pool2d's results
// bit for bit, a faster kernel); CTORCH_BENCH_TORCH_POOL=1 pools with torch::max_pool2d, as the
// Python twin does, to compare DDP alone. The process is tuned as ctorch-train tunes it
// (ctorch::tuneAllocator, ctorch::configureThreads); CTORCH_BENCH_DEFAULT_ALLOCATOR=1 leaves glibc's
// allocator as it comes, as the Python twin does.
// ResNet-18 (ctorch::models::ResNet18, CIFAR stem) on 3x32x32 inputs is the fourth model.
// Every step is timed by phase (rank 0's medians): data (a batch gathered from a preloaded set of 8,
// as a preloaded loader collates one), zero_grad, forward with the loss, backward (the Reducer's
// reduction overlaps it and its wait ends it), optimizer; page faults (getrusage minor faults) per
// step; and after the measured steps the same number of steps under noSync(): their backward is
// the compute alone, so backward minus it is what the reduction costs the step. Peak RSS at the end.
// The Python twin is bench/ddp_step.py; bench/ddp_step.sh runs them side by side.
// Usage: ddp_step_bench [steps] [warmup] [batch] [hidden] [mlp|cnn|linear|resnet18]   (RANK, WORLD_SIZE, ...)
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/process_tuning.hpp>
#include <ctorch/models/ops.hpp>
#include <ctorch/models/resnet.hpp>

#include <torch/torch.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

const bool kTorchPool = [] {
  const char* v = std::getenv("CTORCH_BENCH_TORCH_POOL");
  return v && std::string(v) == "1";
}();

// The seeds' CNN without dropout (as bench/ddp_step.py builds it).
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(9216, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv1(x));
    x = torch::relu(conv2(x));
    x = kTorchPool ? torch::max_pool2d(x, 2) : ctorch::models::maxPool2x2(x);
    x = torch::relu(fc1(torch::flatten(x, 1)));
    return fc2(x);
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

long minorFaults() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

using Clock = std::chrono::steady_clock;
double msSince(Clock::time_point& t) {
  const auto now = Clock::now();
  const double ms = std::chrono::duration<double, std::milli>(now - t).count();
  t = now;
  return ms;
}

} // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int warmup = argc > 2 ? std::atoi(argv[2]) : 10;
  const int batch = argc > 3 ? std::atoi(argv[3]) : 64;
  const int hidden = argc > 4 ? std::atoi(argv[4]) : 1024;
  try {
    const char* plainAllocator = std::getenv("CTORCH_BENCH_DEFAULT_ALLOCATOR");
    if (!(plainAllocator && std::string(plainAllocator) == "1")) ctorch::tuneAllocator();
    const auto threads = ctorch::configureThreads();
    ctorch::initProcessGroup();
    const int rank = ctorch::getRank();
    torch::manual_seed(0);
    const std::string kind = argc > 5 ? argv[5] : "mlp";
    torch::nn::Sequential model;
    if (kind == "cnn") model->push_back(Cnn());
    else if (kind == "linear") model->push_back(torch::nn::Linear(20, 1));
    else if (kind == "resnet18") model->push_back(std::make_shared<ctorch::models::ResNet18>(3, 10));
    else
      model = torch::nn::Sequential(torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                    torch::nn::Linear(hidden, hidden / 8), torch::nn::ReLU(),
                                    torch::nn::Linear(hidden / 8, 10));
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    const char* hook = std::getenv("CTORCH_BENCH_HOOK");
    const bool shm = hook && std::string(hook) == "shared-memory";
    ctorch::DistributedDataParallel ddp(
        model, ctorch::DDPOptions().commHook(shm ? ctorch::CommHook::kSharedMemory : ctorch::CommHook::kNone));
    torch::optim::SGD optimizer(ddp.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    torch::manual_seed(1 + rank);
    // A preloaded set of 8 batches; each step gathers one batch of random rows from it.
    const int64_t pool = 8 * static_cast<int64_t>(batch);
    torch::Tensor xs, ys;
    if (kind == "cnn") xs = torch::randn({pool, 1, 28, 28}), ys = torch::randint(0, 10, {pool});
    else if (kind == "resnet18") xs = torch::randn({pool, 3, 32, 32}), ys = torch::randint(0, 10, {pool});
    else if (kind == "linear") xs = torch::randn({pool, 20}), ys = torch::randn({pool, 1});
    else xs = torch::randn({pool, hidden}), ys = torch::randint(0, 10, {pool});
    auto lossOf = [&](const torch::Tensor& out, const torch::Tensor& y) {
      return kind == "linear" ? torch::mse_loss(out, y) : torch::nn::functional::cross_entropy(out, y);
    };

    std::vector<double> total, data, zero, forward, backward, optim, faults, backwardAlone;
    // kWarmup: not recorded; kSynced: every phase recorded; kNoSync: only the backward (under noSync()).
    enum class Record { kWarmup, kSynced, kNoSync };
    auto step = [&](Record record) {
      auto t = Clock::now();
      const long faultsBefore = minorFaults();
      const auto index = torch::randint(0, pool, {batch}, torch::kLong);
      const auto x = xs.index_select(0, index), y = ys.index_select(0, index);
      const double d = msSince(t);
      optimizer.zero_grad();
      const double z = msSince(t);
      auto loss = lossOf(ddp(x), y);
      const double f = msSince(t);
      loss.backward();
      const double b = msSince(t);
      optimizer.step();
      const double o = msSince(t);
      const long stepFaults = minorFaults() - faultsBefore;
      if (record == Record::kNoSync) backwardAlone.push_back(b);
      if (record != Record::kSynced) return;
      total.push_back(z + f + b + o), data.push_back(d), zero.push_back(z), forward.push_back(f);
      backward.push_back(b), optim.push_back(o), faults.push_back(static_cast<double>(stepFaults));
    };
    for (int i = 0; i < warmup + steps; ++i) step(i < warmup ? Record::kWarmup : Record::kSynced);
    // The same steps without the reduction: backward is the compute alone.
    {
      auto guard = ddp.noSync();
      for (int i = 0; i < steps; ++i) step(Record::kNoSync);
    }
    ctorch::barrier();
    rusage usage{};
    ::getrusage(RUSAGE_SELF, &usage);
    if (rank == 0) {
      double mean = 0;
      for (double v : total) mean += v / total.size();
      std::printf("impl=cpp%s model=%s world=%d params=%lld batch=%d steps=%d median_ms=%.4f mean_ms=%.4f"
                  " data_ms=%.4f zero_ms=%.4f forward_ms=%.4f backward_ms=%.4f backward_nosync_ms=%.4f"
                  " optimizer_ms=%.4f faults_per_step=%.0f maxrss_mib=%.1f threads=%d\n",
                  shm ? "-shm" : "", kind.c_str(), ctorch::getWorldSize(), static_cast<long long>(params), batch, steps,
                  median(total), mean, median(data), median(zero), median(forward), median(backward),
                  median(backwardAlone), median(optim), median(faults), usage.ru_maxrss / 1024.0, threads.threads);
    }
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_step_bench: %s\n", e.what());
    return 1;
  }
}
