// Per-step time of ctorch::DistributedDataParallel: forward, backward (with the Reducer's bucketed
// allreduce) and an SGD step, on the process group from the environment, for an MLP (1.2 M
// parameters at hidden 1024), the seeds' MNIST CNN, or a tiny Linear(20, 1) whose step is almost
// nothing but one small allreduce. CTORCH_BENCH_HOOK=shared-memory selects CommHook::kSharedMemory.
// The CNN pools with ctorch::models::maxPool2x2 (what ctorch-train's CNN runs: max_pool2d's results
// bit for bit, a faster kernel); CTORCH_BENCH_TORCH_POOL=1 pools with torch::max_pool2d, as the
// Python twin does, to compare DDP alone. The process is tuned as ctorch-train tunes it
// (ctorch::tuneAllocator, ctorch::configureThreads); CTORCH_BENCH_DEFAULT_ALLOCATOR=1 leaves glibc's
// allocator as it comes, as the Python twin does.
// The Python twin is bench/ddp_step.py; bench/ddp_step.sh runs them side by side.
// Usage: ddp_step_bench [steps] [warmup] [batch] [hidden] [mlp|cnn|linear]   (RANK, WORLD_SIZE, ...)
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/process_tuning.hpp>
#include <ctorch/models/ops.hpp>

#include <torch/torch.h>

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

} // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int warmup = argc > 2 ? std::atoi(argv[2]) : 10;
  const int batch = argc > 3 ? std::atoi(argv[3]) : 64;
  const int hidden = argc > 4 ? std::atoi(argv[4]) : 1024;
  try {
    const char* plainAllocator = std::getenv("CTORCH_BENCH_DEFAULT_ALLOCATOR");
    if (!(plainAllocator && std::string(plainAllocator) == "1")) ctorch::tuneAllocator();
    ctorch::configureThreads();
    ctorch::initProcessGroup();
    const int rank = ctorch::getRank();
    torch::manual_seed(0);
    const std::string kind = argc > 5 ? argv[5] : "mlp";
    torch::nn::Sequential model;
    if (kind == "cnn") model->push_back(Cnn());
    else if (kind == "linear") model->push_back(torch::nn::Linear(20, 1));
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
    torch::Tensor x, y;
    if (kind == "cnn") x = torch::randn({batch, 1, 28, 28}), y = torch::randint(0, 10, {batch});
    else if (kind == "linear") x = torch::randn({batch, 20}), y = torch::randn({batch, 1});
    else x = torch::randn({batch, hidden}), y = torch::randint(0, 10, {batch});
    auto lossOf = [&](const torch::Tensor& out) {
      return kind == "linear" ? torch::mse_loss(out, y) : torch::nn::functional::cross_entropy(out, y);
    };

    std::vector<double> ms;
    for (int i = 0; i < warmup + steps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      optimizer.zero_grad();
      auto loss = lossOf(ddp(x));
      loss.backward();
      optimizer.step();
      const double elapsed = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      if (i >= warmup) ms.push_back(elapsed);
    }
    ctorch::barrier();
    if (rank == 0) {
      std::sort(ms.begin(), ms.end());
      double mean = 0;
      for (double v : ms) mean += v / ms.size();
      std::printf("impl=cpp%s model=%s world=%d params=%lld batch=%d steps=%d median_ms=%.4f mean_ms=%.4f\n",
                  shm ? "-shm" : "", kind.c_str(), ctorch::getWorldSize(), static_cast<long long>(params), batch, steps,
                  ms[ms.size() / 2], mean);
    }
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_step_bench: %s\n", e.what());
    return 1;
  }
}
