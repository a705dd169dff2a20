// One pipeline job under ctorchrun (S = the world size): an MLP of `layers` x (Linear(width, width),
// ReLU) + Linear(width, 10) cut into S balanced stages, SGD, M micro-batches of a `batch`-row batch.
// After two warm-up steps, `steps` measured steps; each rank prints one line: the median whole step
// (zero_grad, the schedule's step, the optimizer's step), the schedule's step alone, its compute and
// receive-wait times, the measured bubble (wait / schedule step) beside the (S-1)/(M+S-1) model, the most
// micro-batches in flight, and the activation memory: the most heap bytes in use during a step above
// those in use at its start (glibc's mallinfo2, sampled every 200 us by a thread; every tensor here is
// on the heap).
// Usage: pipeline_bench gpipe|1f1b layers width batch microBatches steps [memory|nomemory]
// (nomemory: no sampling thread, activation_mb=0; its mallinfo2 calls take every malloc arena's lock,
// which slows the step: step times compared with another program are taken without it)
#include <ctorch/distributed.hpp>
#include <ctorch/pipeline.hpp>

#include <torch/torch.h>

#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <iostream>
#include <string>
#include <vector>

namespace {

std::size_t heapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::cerr << "usage: pipeline_bench gpipe|1f1b layers width batch microBatches steps [memory|nomemory]\n";
    return 2;
  }
  try {
    const auto kind = ctorch::parsePipelineSchedule(argv[1]);
    const int layers = std::stoi(argv[2]), width = std::stoi(argv[3]), batch = std::stoi(argv[4]);
    const int M = std::stoi(argv[5]), steps = std::stoi(argv[6]);
    ctorch::initProcessGroup();
    const int S = ctorch::getWorldSize(), rank = ctorch::getRank();
    torch::manual_seed(1);
    torch::nn::Sequential model;
    for (int i = 0; i < layers; ++i) {
      model->push_back(torch::nn::Linear(width, width));
      model->push_back(torch::nn::ReLU());
    }
    model->push_back(torch::nn::Linear(width, 10));
    const auto sizes = ctorch::balancedPartition(model, S);
    ctorch::PipelineStage stage(ctorch::pipelineSplit(model, sizes, rank), rank, S);
    ctorch::PipelineSchedule schedule(stage, M, kind, [](const at::Tensor& out, const at::Tensor& y) {
      return torch::nn::functional::cross_entropy(out, y);
    });
    torch::optim::SGD optimizer(stage.module()->parameters(), 0.01);
    const at::Tensor x = torch::randn({batch, width}), y = torch::randint(0, 10, {batch}, torch::kLong);
    auto oneStep = [&] {
      optimizer.zero_grad();
      schedule.step(x, y);
      optimizer.step();
    };
    for (int i = 0; i < 2; ++i) oneStep();
    ctorch::barrier();
    const bool sampleMemory = argc < 8 || std::string(argv[7]) != "nomemory";
    std::atomic<bool> sampling{sampleMemory};
    std::atomic<std::size_t> peak{0};
    std::thread sampler([&] {
      while (sampling.load()) {
        std::size_t now = heapInUse(), seen = peak.load();
        while (now > seen && !peak.compare_exchange_weak(seen, now)) {
        }
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    std::vector<double> whole, total, compute, waiting, activation;
    int inFlight = 0;
    for (int i = 0; i < steps; ++i) {
      const std::size_t start = heapInUse();
      peak = start;
      const auto begin = std::chrono::steady_clock::now();
      oneStep();
      whole.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count());
      activation.push_back(static_cast<double>(peak.load() - start) / 1e6);
      const auto& st = schedule.lastStepStats();
      total.push_back(st.total.count() * 1e3);
      compute.push_back(st.compute.count() * 1e3);
      waiting.push_back(st.waiting.count() * 1e3);
      inFlight = std::max(inFlight, st.maxInFlight);
    }
    sampling = false;
    sampler.join();
    const double t = median(total), w = median(waiting);
    std::printf("rank=%d impl=ctorch schedule=%s S=%d M=%d step_ms=%.1f schedule_ms=%.1f compute_ms=%.1f wait_ms=%.1f bubble=%.3f "
                "model=%.3f max_in_flight=%d activation_mb=%.1f\n",
                rank, ctorch::toString(kind), S, M, median(whole), t, median(compute), w, t > 0 ? w / t : 0,
                static_cast<double>(S - 1) / (M + S - 1), inFlight, median(activation));
    std::fflush(stdout);
    ctorch::barrier();
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "pipeline_bench: " << e.what() << "\n";
    return 1;
  }
}
