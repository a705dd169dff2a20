// Measures the data path (docs/data.md): time to load Fashion-MNIST, batches/s of the loader at
// batch 64 for each conversion and prefetch setting, and an epoch slice of a training-like consumer
// (MNIST CNN forward + backward) with and without the background thread.
//
//   ctorch-data-bench [--root DIR] [--repeat N] [--train-batches N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>

#include <torch/torch.h>

#include <ctorch/data/loader.hpp>
#include <ctorch/data/registry.hpp>
#include <ctorch/data/synthetic.hpp>
#include <ctorch/models/registry.hpp>

using namespace ctorch;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Best of several runs: on a shared machine the fastest run is the one least disturbed by others.
double best(const std::vector<double>& v, bool higherIsBetter) {
  return higherIsBetter ? *std::max_element(v.begin(), v.end()) : *std::min_element(v.begin(), v.end());
}

std::vector<int64_t> shuffled(int64_t n, uint64_t seed) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), std::mt19937_64(seed));
  return v;
}

// One pass over all indices; returns batches/s (best of `repeat` passes).
double loaderRate(std::shared_ptr<const data::BatchPipeline> pipeline, int prefetch, int repeat) {
  auto order = shuffled(pipeline->size(), 1);
  std::vector<double> rates;
  for (int r = 0; r < repeat; ++r) {
    data::BatchLoader loader(pipeline, order, {.batchSize = 64, .epoch = r, .prefetch = prefetch});
    auto start = Clock::now();
    int64_t n = 0;
    while (auto b = loader.next()) ++n;
    rates.push_back(n / seconds(Clock::now() - start));
  }
  return best(rates, true);
}

void reportLoader(const char* dataset, std::shared_ptr<const data::InMemoryDataset> ds, bool augment,
                  int repeat) {
  for (auto conversion : {data::Conversion::PerBatch, data::Conversion::Once}) {
    data::PipelineOptions o;
    o.conversion = conversion;
    if (augment) o.augment = data::AugmentOptions{.seed = 1};
    auto start = Clock::now();
    auto pipeline = std::make_shared<const data::BatchPipeline>(ds, o);
    double setup = seconds(Clock::now() - start);
    for (int prefetch : {0, 1}) {
      std::printf("| %s | %s | %s | %d | %.0f | %.3f |\n", dataset, augment ? "crop+flip" : "none",
                  conversion == data::Conversion::Once ? "once" : "per batch", prefetch,
                  loaderRate(pipeline, prefetch, repeat), setup);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string root = data::kDefaultFashionMnistDir;
  int repeat = 5;
  int64_t trainBatches = 100;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--root") root = argv[i + 1];
    else if (flag == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--train-batches") trainBatches = std::max(1, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "ctorch-data-bench: unknown flag '%s'\n", argv[i]);
      return 2;
    }
  }
  try {
    torch::NoGradGuard noGrad;
    std::printf("torch intra-op threads: %d (best of %d runs each)\n\n", at::get_num_threads(), repeat);

    // 1. Loading.
    std::vector<double> trainLoad, testLoad;  // sorted below for the median
    std::shared_ptr<const data::InMemoryDataset> train;
    for (int r = 0; r < repeat; ++r) {
      auto start = Clock::now();
      auto ds = data::loadDataset({.name = "fashion-mnist", .root = root, .split = data::Split::Train});
      trainLoad.push_back(seconds(Clock::now() - start));
      start = Clock::now();
      auto test = data::loadDataset({.name = "fashion-mnist", .root = root, .split = data::Split::Test});
      testLoad.push_back(seconds(Clock::now() - start));
      train = std::make_shared<const data::InMemoryDataset>(ds);
    }
    std::sort(trainLoad.begin(), trainLoad.end());
    std::printf("load Fashion-MNIST train (60000, gzip): best %.3f s, median %.3f s of %d\n",
                best(trainLoad, false), trainLoad[trainLoad.size() / 2], repeat);
    std::printf("load Fashion-MNIST test (10000, gzip): best %.3f s of %d\n\n", best(testLoad, false), repeat);

    // 2. Loader throughput, batch 64, one epoch per pass, nothing consuming the batches.
    std::printf("| data | augmentation | conversion | prefetch | batches/s | setup s |\n");
    std::printf("|---|---|---|---|---|---|\n");
    reportLoader("Fashion-MNIST 60000x1x28x28", train, false, repeat);
    reportLoader("Fashion-MNIST 60000x1x28x28", train, true, repeat);
    auto cifarLike = std::make_shared<const data::InMemoryDataset>(
        data::makeSyntheticImages(50000, {3, 32, 32}, 10, 1));
    reportLoader("CIFAR-sized 50000x3x32x32", cifarLike, false, repeat);
    reportLoader("CIFAR-sized 50000x3x32x32", cifarLike, true, repeat);

    // 3. A training-like consumer: MNIST CNN forward + backward + SGD on each batch.
    torch::manual_seed(0);
    auto model = models::createModel({.name = "mnist-cnn"});
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto pipeline = std::make_shared<const data::BatchPipeline>(train, data::PipelineOptions{});
    auto order = shuffled(train->size(), 2);
    order.resize(static_cast<size_t>(trainBatches * 64));
    std::printf("\nMNIST CNN training steps, batch 64, %lld batches, samples/s best of 3 (interleaved):\n",
                static_cast<long long>(trainBatches));
    std::vector<double> rate[2], wait[2], first[2];
    for (int round = 0; round < 3; ++round) {
      for (int prefetch : {0, 1}) {
        torch::AutoGradMode grad(true);
        data::BatchLoader loader(pipeline, order, {.batchSize = 64, .prefetch = prefetch});
        auto start = Clock::now();
        int64_t samples = 0, batches = 0;
        while (true) {
          auto askedAt = Clock::now();
          auto b = loader.next();
          if (!b) break;
          double us = 1e6 * seconds(Clock::now() - askedAt);
          (batches == 0 ? first : wait)[prefetch].push_back(us);
          sgd.zero_grad();
          auto loss = torch::nll_loss(model->forward(b->inputs), b->targets);
          loss.backward();
          sgd.step();
          samples += b->size();
          ++batches;
        }
        rate[prefetch].push_back(samples / seconds(Clock::now() - start));
      }
    }
    for (int prefetch : {0, 1}) {
      auto& w = wait[prefetch];
      std::sort(w.begin(), w.end());
      std::printf("  prefetch %d: %.0f samples/s; time in next(): median %.1f us, 90th percentile %.1f us "
                  "per batch, first batch %.1f us\n",
                  prefetch, best(rate[prefetch], true), w[w.size() / 2], w[w.size() * 9 / 10],
                  best(first[prefetch], false));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ctorch-data-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
