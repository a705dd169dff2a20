// The step time a snapshot adds (issue 17's "snapshot stall"): a model of the requested size
// trained through ctorch::ResilientTraining, once without snapshots and once with one every
// `--every` steps (the writer encodes, checksums, fsyncs and renames in the background while the
// loop goes on). Prints the median step without saves, each save step's time and the whole run's
// extra time per save, in steps.
//   build/bench/snapshot/stall_bench [--mb 512] [--batch 64] [--steps 40] [--every 12] [--rounds 1]
//                                    [--dir /tmp]
// --rounds N alternates the two runs N times and reports each round and the median: on a shared VM
// two runs of the same loop differ by a few steps, so one pair of runs is no measurement. Choose
// --steps so that the last save's write still overlaps training (not a multiple of --every).
// Model: one square Linear layer holding --mb MiB of float32, plain SGD (the snapshot is the model).
// --threads N (default 1) sets LibTorch's intra-op threads and OpenBLAS's own pool (which ignores
// LibTorch's setting: before 2026-11-25 this bench's "1 thread" ran its GEMMs on both cores of the
// VM, so the writer could only run by taking a core from the step; ctorch::configureThreads and
// ctorch::setBlasThreads set both). --threads 1 on a 2-core machine leaves a core to the writer;
// --threads <all CPUs> measures a training that occupies every core.
#include <ctorch/distributed.hpp>
#include <ctorch/process_tuning.hpp>
#include <ctorch/resilience.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Run {
  std::vector<double> steps;  // seconds per step, stepDone() included
  double total = 0;
  int saves = 0;
};

Run train(std::int64_t dim, int batch, int steps, int every, const std::filesystem::path& dir) {
  torch::manual_seed(0);
  torch::nn::Linear model(torch::nn::LinearOptions(dim, dim).bias(false));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-6));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ctorch::ResilientTraining training(ctorch::ResilienceOptions()
                                         .snapshotPath(dir / "snapshot.pt")
                                         .saveEverySteps(every)
                                         .saveEveryEpochs(0)
                                         .resume(false)
                                         .keepPrevious(0)
                                         .handleSignals(false)
                                         .log([](const std::string&) {}));
  training.track(model).track(optimizer);
  training.resume();
  auto x = torch::randn({batch, dim});
  Run run;
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) {
    const auto a = Clock::now();
    optimizer.zero_grad();
    model(x).pow(2).mean().backward();
    optimizer.step();
    training.stepDone();
    run.steps.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  // The training time: up to the last step. The last write, still in flight, is not step time
  // (it overlaps whatever follows; finish() waits for it).
  run.total = std::chrono::duration<double>(Clock::now() - start).count();
  training.wait();
  run.saves = every > 0 ? steps / every : 0;
  training.finish();
  return run;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
  double mb = 512;
  int batch = 64, steps = 40, every = 12, rounds = 1, threads = 1;
  std::filesystem::path dir = std::filesystem::temp_directory_path();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mb") mb = std::atof(argv[i + 1]);
    else if (flag == "--batch") batch = std::atoi(argv[i + 1]);
    else if (flag == "--steps") steps = std::atoi(argv[i + 1]);
    else if (flag == "--every") every = std::atoi(argv[i + 1]);
    else if (flag == "--threads") threads = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--rounds") rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (flag == "--dir") dir = argv[i + 1];
    else {
      std::fprintf(stderr, "stall_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  try {
    // LibTorch's intra-op threads, and OpenBLAS's own pool at the same count (configureThreads
    // would hold it to one: this model's time is one large GEMM called outside LibTorch's loops).
    ctorch::configureThreads(threads);
    ctorch::setBlasThreads(threads);
    ctorch::initProcessGroup();  // a world of 1
    const auto dim = static_cast<std::int64_t>(std::sqrt(mb * 1024 * 1024 / 4));
    dir /= "ctorch-stall-bench-" + std::to_string(::getpid());
    std::vector<double> perSave, saveStep;
    double step = 0;
    for (int round = 1; round <= rounds; ++round) {
      const Run plain = train(dim, batch, steps, 0, dir);
      const Run saving = train(dim, batch, steps, every, dir);
      step = median(plain.steps);
      if (round == 1)
        std::printf("model %.0f MiB (Linear %lld x %lld, no bias), batch %d, %d steps, torch and BLAS threads %d\n",
                    static_cast<double>(dim * dim * 4) / (1 << 20), static_cast<long long>(dim),
                    static_cast<long long>(dim), batch, steps, torch::get_num_threads());
      std::printf("round %d: median step without snapshots: %.3f s; run %.3f s\n", round, step, plain.total);
      std::printf("  with a snapshot every %d steps (%d saves): run %.3f s\n", every, saving.saves, saving.total);
      for (int i = every - 1; i < steps; i += every) {
        std::printf("  save at step %d: that step took %.3f s (%.2f steps)\n", i + 1, saving.steps[i],
                    saving.steps[i] / step);
        saveStep.push_back(saving.steps[i] / step);
      }
      const double extra = (saving.total - plain.total) / std::max(saving.saves, 1);
      std::printf("  extra run time per save: %.3f s = %.2f steps\n", extra, extra / step);
      perSave.push_back(extra / step);
    }
    std::filesystem::remove_all(dir);
    if (rounds > 1) {
      std::sort(perSave.begin(), perSave.end());
      std::printf("over %d rounds: extra run time per save, in steps: median %.2f (min %.2f, max %.2f); "
                  "the step that saves: median %.2f steps\n",
                  rounds, median(perSave), perSave.front(), perSave.back(), median(saveStep));
    }
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "stall_bench: %s\n", e.what());
    return 1;
  }
}
