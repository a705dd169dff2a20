// Per-step time of ctorch::DistributedDataParallel on an MLP: forward, backward (with the Reducer's
// bucketed allreduce) and an SGD step, on the process group from the environment. The Python twin
// is bench/ddp_step.py; bench/ddp_step.sh runs both side by side.
// Usage: ddp_step_bench [steps] [warmup] [batch] [hidden]   (RANK, WORLD_SIZE, ... in the environment)
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int warmup = argc > 2 ? std::atoi(argv[2]) : 10;
  const int batch = argc > 3 ? std::atoi(argv[3]) : 64;
  const int hidden = argc > 4 ? std::atoi(argv[4]) : 1024;
  try {
    ctorch::initProcessGroup();
    const int rank = ctorch::getRank();
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(hidden, hidden), torch::nn::ReLU(),
                                torch::nn::Linear(hidden, hidden / 8), torch::nn::ReLU(),
                                torch::nn::Linear(hidden / 8, 10));
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    ctorch::DistributedDataParallel ddp(model);
    torch::optim::SGD optimizer(ddp.parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    torch::manual_seed(1 + rank);
    auto x = torch::randn({batch, hidden});
    auto y = torch::randint(0, 10, {batch});

    std::vector<double> ms;
    for (int i = 0; i < warmup + steps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      optimizer.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp(x), y);
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
      std::printf("impl=cpp world=%d params=%lld batch=%d steps=%d median_ms=%.3f mean_ms=%.3f\n",
                  ctorch::getWorldSize(), static_cast<long long>(params), batch, steps, ms[ms.size() / 2], mean);
    }
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_step_bench: %s\n", e.what());
    return 1;
  }
}
