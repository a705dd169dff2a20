// Synchronous against asynchronous parameter-server training on real Fashion-MNIST (issue 32.3): the
// test accuracy after each epoch, the training time, and what the servers saw (staleness, held answers).
//
// Run under a launcher, the last --servers ranks serve:
//   ctorchrun --standalone --nproc-per-node 3 build/bench/ps_async_accuracy_bench --mode async --staleness 4
// bench/ps_async_accuracy.sh runs the comparison quoted in docs/parameter-server.md.
#include "ctorch/distributed.hpp"
#include "ctorch/parameter_server.hpp"

#include <ctorch/data/registry.hpp>
#include <ctorch/models/registry.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Args {
  std::string mode = "sync";
  int staleness = 4;
  int servers = 1;
  int epochs = 3;
  std::int64_t batch = 64;  // per worker
  double lr = 0.05;
  int slowMs = 0;           // worker 1 sleeps this long before each push (a slower machine)
  std::int64_t limit = 0;   // train samples (0: all 60,000)
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument("missing value after " + flag);
    const std::string value = argv[++i];
    if (flag == "--mode") a.mode = value;
    else if (flag == "--staleness") a.staleness = std::stoi(value);
    else if (flag == "--servers") a.servers = std::stoi(value);
    else if (flag == "--epochs") a.epochs = std::stoi(value);
    else if (flag == "--batch") a.batch = std::stoll(value);
    else if (flag == "--lr") a.lr = std::stod(value);
    else if (flag == "--slow-ms") a.slowMs = std::stoi(value);
    else if (flag == "--limit") a.limit = std::stoll(value);
    else throw std::invalid_argument("unknown flag " + flag);
  }
  if (a.mode != "sync" && a.mode != "async") throw std::invalid_argument("--mode must be sync or async, got " + a.mode);
  return a;
}

// Fashion-MNIST's per-pixel mean and standard deviation over the training set.
torch::Tensor normalise(const torch::Tensor& images) {
  return (images.to(torch::kFloat32).div(255.0) - 0.2860).div(0.3530);
}

torch::Tensor lossOf(ctorch::models::Model& model, const torch::Tensor& out, const torch::Tensor& y) {
  return model.output() == ctorch::models::ModelOutput::LogProbabilities ? torch::nll_loss(out, y)
                                                                           : torch::cross_entropy_loss(out, y);
}

double accuracy(ctorch::models::Model& model, const ctorch::data::InMemoryDataset& test) {
  torch::NoGradGuard noGrad;
  model.eval();
  std::int64_t right = 0;
  for (std::int64_t at = 0; at < test.size(); at += 1000) {
    const auto n = std::min<std::int64_t>(1000, test.size() - at);
    const auto x = normalise(test.inputs().narrow(0, at, n));
    const auto y = test.targets().narrow(0, at, n);
    right += model.forward(x).argmax(1).eq(y).sum().item<std::int64_t>();
  }
  model.train();
  return 100.0 * static_cast<double>(right) / static_cast<double>(test.size());
}

} // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::minutes(5)));
    torch::set_num_threads(1);
    torch::manual_seed(1);
    auto model = ctorch::models::createModel(ctorch::models::ModelOptions{});
    ctorch::ParameterServer ps(
        model->parameters(),
        [&](std::vector<at::Tensor> share) {
          return std::make_unique<torch::optim::SGD>(share, torch::optim::SGDOptions(a.lr).momentum(0.9));
        },
        ctorch::ParameterServerOptions()
            .servers(a.servers)
            .mode(a.mode == "async" ? ctorch::ParameterServerMode::kAsynchronous : ctorch::ParameterServerMode::kSynchronous)
            .staleness(a.staleness)
            .timeout(std::chrono::minutes(5)));
    if (ps.isServer()) {
      for (int e = 0; e < a.epochs; ++e) ps.serveRound();
      ps.serve();  // until the workers finish
      const auto& s = ps.stats();
      std::printf("server %d: updates %lld, staleness max %lld mean %.2f, answers held %lld\n", ps.serverIndex(),
                  static_cast<long long>(s.updates), static_cast<long long>(s.maxStaleness), s.meanStaleness,
                  static_cast<long long>(s.heldAnswers));
      ctorch::destroyProcessGroup();
      return 0;
    }
    ctorch::data::DatasetOptions trainOptions;
    trainOptions.limit = a.limit;
    const auto train = ctorch::data::loadDataset(trainOptions);
    ctorch::data::DatasetOptions testOptions;
    testOptions.split = ctorch::data::Split::Test;
    const auto test = ctorch::data::loadDataset(testOptions);
    const int w = ps.workerIndex(), workers = ps.numWorkers();
    double trainSeconds = 0.0;
    std::int64_t aheadMost = 0;
    for (int e = 0; e < a.epochs; ++e) {
      // One shuffle per epoch, the same on every worker; worker w takes every workers-th sample.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + e);
      const auto order = torch::randperm(train.size(), gen, torch::kLong);
      const auto mine = order.slice(0, w, train.size(), workers);
      const std::int64_t steps = mine.size(0) / a.batch;  // equal on every worker (drop the tail)
      const auto start = std::chrono::steady_clock::now();
      double lossSum = 0.0;
      for (std::int64_t s = 0; s < steps; ++s) {
        const auto idx = mine.narrow(0, s * a.batch, a.batch);
        const auto batch = train.select(idx);
        ps.zeroGrad();
        const auto loss = lossOf(*model, model->forward(normalise(batch.inputs)), batch.targets);
        loss.backward();
        lossSum += loss.item<double>();
        if (w == 1 && a.slowMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(a.slowMs));
        ps.step();
        aheadMost = std::max(aheadMost, ps.aheadOfSlowest());
      }
      ps.sync();
      trainSeconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (w == 0)
        std::printf("%s staleness %d: epoch %d: train loss %.4f, test accuracy %.2f%%, %.1f s (worker 0 at most %lld ahead)\n",
                    a.mode.c_str(), a.staleness, e + 1, lossSum / static_cast<double>(steps), accuracy(*model, test), trainSeconds,
                    static_cast<long long>(aheadMost));
      std::fflush(stdout);
    }
    ps.finish();
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ps_async_accuracy: " << e.what() << "\n";
    return 1;
  }
}
