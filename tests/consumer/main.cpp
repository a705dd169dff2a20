// A user's own training program on the installed ctorch package: a LibTorch loop (its own model,
// data, SGD with momentum, a StepLR schedule) made data-parallel with ctorch::DistributedDataParallel
// and fault tolerant with ctorch::ResilientTraining. Killed, stopped (SIGTERM, SIGUSR1: exit 75) or
// preempted at any moment, the same command continues from its newest snapshot and ends with the
// same weights as a run that was never interrupted. tests/consumer/run.sh builds it against a fresh
// `cmake --install` and checks exactly that; scripts/chaos/chaos.py --suite consumer injects faults.
//
//   ctorchrun --standalone --nproc-per-node 2 consumer --epochs 3 --save-every-steps 4
//   consumer                      # a world of 1, no launcher and no variables
//   consumer --tensorboard-dir tb # also the losses as TensorBoard scalars (rank 0)
#include <ctorch/ctorch.hpp>  // the whole public API (issue 59.6)

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

struct Flags {
  std::int64_t epochs = 3;
  std::int64_t batchSize = 32;
  std::int64_t saveEverySteps = 0;
  std::string snapshot = "snapshot.pt";
  std::string out = "model.pt";
  std::int64_t stepDelayMs = 0;  // a pause after each step, so that tests can hit a run mid-training
  std::int64_t timeoutS = 60;    // collectives give up on a silent peer after this long
  double lr = 0.05;
  std::int64_t stepSeed = -1;    // >= 0: every step's randomness from (seed, rank, step)
  std::int64_t recoverInPlace = 1;  // 0: the README's loop without try / recover(): a failed step ends it
  std::string tensorboardDir;       // non-empty: rank 0 writes the losses as TensorBoard scalars
  bool fsdp = false;                // --sharding fsdp: FullyShardedDataParallel in place of DDP
  std::int64_t shardCopies = 0;     // ResilienceOptions::shardCopies (in-place recovery of the shards)
  // Testing aids (tests/consumer/run.sh): a stop at a known step, a start-up at a known moment.
  std::int64_t sigtermAfterStep = 0;  // > 0: rank sigtermRank raises SIGTERM on itself after this global step
  std::int64_t sigtermRank = 0;
  std::string waitForFile;            // non-empty: start-up waits until this file exists (before the group)
};

constexpr const char* kUsage =
    "usage: consumer [--epochs N] [--batch-size B] [--save-every-steps K] [--snapshot PATH] [--out PATH]\n"
    "                [--step-delay-ms D] [--timeout S] [--lr X] [--step-seed S] [--recover-in-place 0|1]\n"
    "                [--tensorboard-dir DIR] [--sharding none|fsdp] [--shard-copies 0|1]\n"
    "testing aids:   [--sigterm-after-step S [--sigterm-rank R]] [--wait-for-file PATH]";

// Parses "--flag value" (or --flag=value; --batch_size spellings too). Returns an error line, or
// nothing when every flag was understood.
std::optional<std::string> parseFlags(int argc, char** argv, Flags& f) {
  auto integer = [](const std::string& text, std::int64_t low, std::int64_t& into) {
    std::size_t used = 0;
    try {
      into = std::stoll(text, &used);
    } catch (const std::exception&) {
      return false;
    }
    return used == text.size() && into >= low;
  };
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i], value;
    if (name == "-h" || name == "--help") return std::string();
    const auto eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      return "flag '" + name + "' needs a value";
    }
    for (std::size_t k = 2; k < name.size(); ++k)
      if (name[k] == '_') name[k] = '-';
    bool ok = true;
    if (name == "--epochs") ok = integer(value, 1, f.epochs);
    else if (name == "--batch-size") ok = integer(value, 1, f.batchSize);
    else if (name == "--save-every-steps") ok = integer(value, 0, f.saveEverySteps);
    else if (name == "--step-delay-ms") ok = integer(value, 0, f.stepDelayMs);
    else if (name == "--timeout") ok = integer(value, 1, f.timeoutS);
    else if (name == "--step-seed") ok = integer(value, 0, f.stepSeed);
    else if (name == "--recover-in-place") ok = integer(value, 0, f.recoverInPlace) && f.recoverInPlace <= 1;
    else if (name == "--snapshot") ok = !(f.snapshot = value).empty();
    else if (name == "--sharding") ok = (value == "none" || value == "fsdp") && ((f.fsdp = value == "fsdp"), true);
    else if (name == "--shard-copies") ok = integer(value, 0, f.shardCopies) && f.shardCopies <= 1;
    else if (name == "--out") ok = !(f.out = value).empty();
    else if (name == "--tensorboard-dir") ok = !(f.tensorboardDir = value).empty();
    else if (name == "--sigterm-after-step") ok = integer(value, 0, f.sigtermAfterStep);
    else if (name == "--sigterm-rank") ok = integer(value, 0, f.sigtermRank);
    else if (name == "--wait-for-file") ok = !(f.waitForFile = value).empty();
    else if (name == "--lr") {
      std::istringstream in(value);
      ok = static_cast<bool>(in >> f.lr) && in.eof() && f.lr > 0;
    } else {
      return "unknown flag '" + name + "'";
    }
    if (!ok) return "bad value '" + value + "' for " + name;
  }
  return std::nullopt;
}

// 16 inputs -> 64 hidden -> 1 output; dropout makes the random generator part of the result.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 64))),
        drop(register_module("drop", torch::nn::Dropout(0.2))),
        fc2(register_module("fc2", torch::nn::Linear(64, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

// A synthetic regression set, the same on every rank and in every run (no files).
struct Dataset {
  torch::Tensor x, y;
  explicit Dataset(std::int64_t size) {
    torch::manual_seed(1234);
    x = torch::randn({size, 16});
    y = torch::sin(x.matmul(torch::randn({16, 1}))) + 0.1 * torch::randn({size, 1});
  }
  std::pair<torch::Tensor, torch::Tensor> batch(const std::vector<std::int64_t>& indices) const {
    const auto rows = torch::tensor(indices, torch::kLong);
    return {x.index_select(0, rows), y.index_select(0, rows)};
  }
};

int train(const Flags& f) {
  // A stop signal during start-up (the rendezvous can take a while) is kept for resume() to agree on;
  // without this it would end the process before ResilientTraining installs the same handlers.
  ctorch::installStopHandlers();
  ctorch::tuneAllocator();     // the installed package's process tuning, as README's quickstart has it
  ctorch::configureThreads();
  if (!f.waitForFile.empty()) {
    std::cout << "waiting for " << f.waitForFile << std::endl;
    while (!std::filesystem::exists(f.waitForFile)) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(f.timeoutS)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  if (ctorch::isMainProcess())
    std::cout << ctorch::versionString() << ": " << world << " rank(s), "
              << toString(ctorch::getDistributedEnv().launcher) << std::endl;

  const Dataset data(2048);
  torch::manual_seed(0);
  Net model;
  // Every rank starts from rank 0's weights. DDP, or (--sharding fsdp) each rank holds a shard of the
  // parameters, gradients and optimizer state.
  std::optional<ctorch::DistributedDataParallel<Net>> ddp;
  std::optional<ctorch::FullyShardedDataParallel<Net>> fsdp;
  if (f.fsdp) fsdp.emplace(model);
  else ddp.emplace(model);
  const auto forward = [&](const torch::Tensor& x) { return fsdp ? (*fsdp)(x) : (*ddp)(x); };
  torch::manual_seed(1 + rank);                // each rank its own dropout masks
  torch::optim::SGD optimizer(fsdp ? fsdp->parameters() : ddp->parameters(), torch::optim::SGDOptions(f.lr).momentum(0.9));
  torch::optim::StepLR scheduler(optimizer, /*step_size=*/2, /*gamma=*/0.5);
  ctorch::DistributedSamplerOptions so;
  so.datasetSize = data.x.size(0);
  so.worldSize = world;
  so.rank = rank;
  ctorch::DistributedSampler sampler(so);
  double bestLoss = std::numeric_limits<double>::infinity();  // the lowest end-of-epoch loss so far

  // The resilience: what a snapshot holds, and where the run continues from.
  std::ostringstream lr;
  lr << f.lr;
  auto options = ctorch::ResilienceOptions()
                     .snapshotPath(f.snapshot)
                     .saveEverySteps(f.saveEverySteps)
                     .runName("consumer-mlp")
                     .programName("consumer")
                     .config({{"lr", lr.str()}, {"batch_size", std::to_string(f.batchSize)}})
                     .shardCopies(static_cast<int>(f.shardCopies));
  // Without a step seed every rank's generator state is saved with the snapshots instead; in-place
  // recovery is exact only with one (a replaced rank's generator is gone with it).
  if (f.stepSeed >= 0) options.stepSeed(static_cast<std::uint64_t>(f.stepSeed));
  ctorch::ResilientTraining training(options);
  if (fsdp) training.track(*fsdp);
  else training.track(*ddp);
  training.track(optimizer).track(sampler).track(scheduler).track("best_loss", bestLoss);
  const ctorch::ResumePoint start = training.resume();
  if (training.stopRequested()) return training.exitCode();  // stopped while starting: 75, nothing to save
  if (start.resumed && ctorch::isMainProcess())
    std::cout << "continuing at epoch " << start.epoch + 1 << " after step " << start.stepInEpoch
              << ", best loss so far " << std::fixed << std::setprecision(6) << bestLoss << std::endl;
  // TensorBoard on rank 0: the file's START at the first step this process runs hides what a
  // stopped process logged after the snapshot this one resumed from (docs/tensorboard.md).
  std::optional<ctorch::SummaryWriter> tensorboard;
  if (!f.tensorboardDir.empty() && ctorch::isMainProcess()) {
    ctorch::SummaryWriterOptions tb;
    tb.purgeStep = training.globalStep() + 1;
    tensorboard.emplace(f.tensorboardDir, tb);
  }

  const std::int64_t steps = (sampler.size() + f.batchSize - 1) / f.batchSize;
  // The loop follows training.epoch(): after an in-place recovery (below) it goes on from wherever
  // the ranks agreed, mid-epoch or at an epoch's end.
  while (training.epoch() < f.epochs) {
    const std::int64_t epoch = training.epoch();
    sampler.setEpoch(epoch);  // after a mid-epoch resume or recovery: keeps the restored position
    model->train();
    try {
      while (!sampler.exhausted()) {
        auto [x, y] = data.batch(sampler.next(f.batchSize));
        if (fsdp) fsdp->zeroGrad();
        else ddp->zeroGrad();
        auto loss = torch::mse_loss(forward(x), y);
        loss.backward();
        optimizer.step();
        std::vector<double> lossSum{loss.item<double>()};
        const bool stop = training.stepDone(lossSum);  // also sums the loss over the ranks
        if (ctorch::isMainProcess())
          std::cout << "epoch " << epoch + 1 << "/" << f.epochs << " step "
                    << (sampler.position() + f.batchSize - 1) / f.batchSize << "/" << steps << " loss "
                    << std::fixed << std::setprecision(4) << lossSum[0] / world << std::endl;
        if (tensorboard) tensorboard->addScalar("train/loss", lossSum[0] / world, training.globalStep());
        if (stop) return training.exitCode();  // SIGTERM/SIGUSR1: saved, exit 75, run me again
        if (f.sigtermAfterStep > 0 && training.globalStep() == f.sigtermAfterStep && rank == f.sigtermRank)
          std::raise(SIGTERM);  // as if sent now: agreed on by every rank within the next steps
        if (f.stepDelayMs > 0) std::this_thread::sleep_for(std::chrono::milliseconds(f.stepDelayMs));
      }
      scheduler.step();
      // The whole set without dropout: the same number on every rank.
      model->eval();
      double epochLoss = 0;
      {
        torch::NoGradGuard noGrad;  // a sharded model's forward gathers its parameters (every rank)
        epochLoss = torch::mse_loss(fsdp ? forward(data.x) : model(data.x), data.y).item<double>();
      }
      bestLoss = std::min(bestLoss, epochLoss);
      if (ctorch::isMainProcess())
        std::cout << "epoch " << epoch + 1 << "/" << f.epochs << " done: loss " << std::fixed
                  << std::setprecision(6) << epochLoss << " best " << bestLoss << std::endl;
      if (tensorboard) tensorboard->addScalar("epoch/loss", epochLoss, training.globalStep());
      if (training.epochDone()) return training.exitCode();
    } catch (const std::exception&) {
      if (f.recoverInPlace == 0) throw;  // as a loop without the try: ctorchrun restarts the group
      // A peer died or hung (ctorchrun --recovery in-place): re-form with its replacement and go on
      // from the agreed step with everything restored. Anything else, or without in-place recovery:
      // rethrown.
      const ctorch::ResumePoint at = training.recover();
      if (ctorch::isMainProcess()) std::cout << at.message << std::endl;
    }
  }
  const int code = training.finish();
  if (fsdp)
    fsdp->summonFullParameters([&] {
      if (ctorch::isMainProcess()) ctorch::saveStateDict(*model, f.out);
    });
  else if (ctorch::isMainProcess())
    ctorch::saveStateDict(*model, f.out);
  ctorch::destroyProcessGroup();
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  if (const auto error = parseFlags(argc, argv, flags)) {
    if (error->empty()) {
      std::cout << kUsage << std::endl;
      return 0;
    }
    std::cerr << "consumer: error: " << *error << " (--help lists the flags)" << std::endl;
    return 2;
  }
  return ctorch::runRecorded([&] { return train(flags); });
}
