// Per-rank model-state memory and step time of DDP with the whole Adam, DDP with a
// ZeroRedundancyOptimizer (ZeRO-1), FullyShardedDataParallel (full sharding, and SHARD_GRAD_OP) and a
// pipeline of 2 stages (1F1B, 4 micro-batches; data parallel over world / 2 pipelines), on an MLP of
// ~100 M parameters; run under ctorchrun by bench/zero_memory.sh, which prints the table quoted in
// docs/sharding.md (and bench/memory_limit.sh, docs/pipeline.md).
// Usage (as each worker): zero_memory_bench <ddp|zero|fsdp|fsdp-grad-op|hybrid|hybrid-grad-op|pipeline> <layers> <width> <steps>
// Every mode computes the same rows per step over the world: 8 per rank (a pipeline's batch: 8 x 2).
// hybrid and hybrid-grad-op are fsdp and fsdp-grad-op sharded over each node's ranks (LOCAL_WORLD_SIZE)
// and replicated across the nodes (ctorch::hybridShardGroups(); bench/sharding_lab.sh runs them).
// ZERO_MEMORY_TRACE=1 also prints, on stderr, the resident and peak memory after each phase and the
// last step's loss (the same in every mode at one rank). ZERO_MEMORY_NO_PREFETCH=1 turns the fsdp
// modes' prefetch off (what the unit gathered ahead costs in peak memory).
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/fully_sharded_data_parallel.hpp>
#include <ctorch/hybrid_shard_groups.hpp>
#include <ctorch/optim.hpp>
#include <ctorch/pipeline.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/zero_redundancy_optimizer.hpp>

#include <torch/torch.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace {

std::size_t bytesOf(const std::vector<at::Tensor>& tensors) {
  std::size_t n = 0;
  for (const auto& t : tensors)
    if (t.defined()) n += t.nbytes();
  return n;
}

// The whole optimizer's state bytes (Adam: exp_avg and exp_avg_sq per parameter). Counted on a copy
// of the state (as ZeroRedundancyOptimizer::localStateBytes also is): call it after the peak RSS is taken.
std::size_t stateBytes(const torch::optim::Optimizer& optimizer) {
  std::size_t bytes = 0;
  std::function<void(const c10::IValue&)> add = [&](const c10::IValue& v) {
    if (v.isTensor()) bytes += v.toTensor().nbytes();
    else if (v.isGenericDict())
      for (const auto& e : v.toGenericDict()) add(e.value());
  };
  add(ctorch::captureOptimizerState(optimizer).at("state"));
  return bytes;
}

double peakRssMb() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;
}

int currentStep = -1;

// With ZERO_MEMORY_TRACE set: where the resident memory and its peak stand after a phase.
void trace(const char* phase) {
  static const bool on = std::getenv("ZERO_MEMORY_TRACE") != nullptr;
  if (!on) return;
  std::ifstream statm("/proc/self/statm");
  long pages = 0, resident = 0;
  statm >> pages >> resident;
  std::fprintf(stderr, "trace rank=%d step=%d phase=%s rss_mb=%.1f peak_rss_mb=%.1f\n", ctorch::getRank(), currentStep, phase,
               resident * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0), peakRssMb());
}

// torch.nn.Sequential of Linears, with each Linear called through ctorch::unitForward so that
// FullyShardedDataParallel can make it a unit; its parameters are named "0.weight", "0.bias", ... as
// Sequential's are, and made in the same order from the same seed.
struct MlpImpl : torch::nn::Module {
  MlpImpl(int layers, int width) {
    for (int i = 0; i < layers; ++i) linears.push_back(register_module(std::to_string(i), torch::nn::Linear(width, width)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < linears.size(); ++i) {
      x = ctorch::unitForward(linears[i], x);
      // Traced: the memory as the backward reaches each Linear (its output's gradient is ready).
      if (std::getenv("ZERO_MEMORY_TRACE") != nullptr && x.requires_grad())
        x.register_hook([i](const at::Tensor&) { trace(("backward-reaches-" + std::to_string(i)).c_str()); });
    }
    return x;
  }
  std::vector<torch::nn::Linear> linears;
};
TORCH_MODULE(Mlp);

struct Measured {
  std::size_t params = 0, grads = 0, optimizer = 0, unit = 0;
  double peakRss = 0;  // MiB, taken after the steps, before the optimizer state is counted (which copies it)
  std::vector<double> ms;
  double lastLoss = 0;
};

// ZERO_MEMORY_OPTIMIZER=auto|fused|foreach|per-parameter: how Adam steps (ctorch/optim.hpp; default
// auto, as ctorch-train's).
ctorch::optim::Kernels adamKernels() {
  const char* text = std::getenv("ZERO_MEMORY_OPTIMIZER");
  if (!text || !*text) return ctorch::optim::Kernels::kAuto;
  const auto k = ctorch::optim::kernelsFromString(text);
  if (!k) {
    std::fprintf(stderr, "zero_memory_bench: ZERO_MEMORY_OPTIMIZER '%s' is not auto, fused, foreach or per-parameter\n",
                 text);
    std::exit(2);
  }
  return *k;
}

std::unique_ptr<torch::optim::Adam> adam(std::vector<at::Tensor> parameters) {
  return std::make_unique<ctorch::optim::Adam>(parameters, torch::optim::AdamOptions(1e-4), adamKernels());
}

// `step` runs one step and returns its loss.
void timeSteps(int steps, const std::function<double()>& step, Measured& out) {
  for (int s = 0; s < steps; ++s) {
    currentStep = s;
    const auto start = std::chrono::steady_clock::now();
    out.lastLoss = step();
    out.ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  currentStep = -1;
  out.peakRss = peakRssMb();
}

Measured runDdp(bool sharded, int layers, int width, int steps) {
  torch::nn::Sequential mlp;
  for (int i = 0; i < layers; ++i) mlp->push_back(torch::nn::Linear(width, width));
  trace("model");
  ctorch::DistributedDataParallel ddp(mlp, ctorch::DDPOptions().gradientAsBucketView(true));
  trace("wrapped");
  std::unique_ptr<torch::optim::Optimizer> whole;
  std::unique_ptr<ctorch::ZeroRedundancyOptimizer> zero;
  if (sharded) zero = std::make_unique<ctorch::ZeroRedundancyOptimizer>(ddp.parameters(), adam);
  else whole = adam(ddp.parameters());
  Measured out;
  timeSteps(steps, [&] {
    ddp.zeroGrad();
    const auto x = torch::randn({8, width});
    auto loss = ddp(x).pow(2).mean();
    trace("forward");
    loss.backward();
    trace("backward");
    if (zero) zero->step();
    else whole->step();
    trace("optimizer");
    return loss.item<double>();
  }, out);
  std::vector<at::Tensor> grads;
  for (const auto& p : ddp.parameters()) grads.push_back(p.grad());
  out.params = bytesOf(ddp.parameters());
  out.grads = bytesOf(grads);
  out.optimizer = zero ? zero->localStateBytes() : stateBytes(*whole);
  return out;
}

// Each Linear a unit; the optimizer over this rank's flat shards.
Measured runFsdp(bool reshardAfterForward, bool hybrid, int layers, int width, int steps) {
  Mlp mlp(layers, width);
  trace("model");
  auto options = ctorch::FSDPOptions()
                     .autoWrapPolicy(ctorch::moduleTypeWrapPolicy<torch::nn::LinearImpl>())
                     .reshardAfterForward(reshardAfterForward)
                     .prefetch(std::getenv("ZERO_MEMORY_NO_PREFETCH") == nullptr);
  if (hybrid) {
    auto groups = ctorch::hybridShardGroups();
    options.processGroup(groups.shard).replicateGroup(groups.replicate);
  }
  ctorch::FullyShardedDataParallel fsdp(mlp, options);
  trace("wrapped");
  auto optimizer = adam(fsdp.parameters());
  Measured out;
  timeSteps(steps, [&] {
    fsdp.zeroGrad();
    const auto x = torch::randn({8, width});
    auto loss = fsdp(x).pow(2).mean();
    trace("forward");
    loss.backward();
    trace("backward");
    optimizer->step();
    trace("optimizer");
    return loss.item<double>();
  }, out);
  out.params = fsdp.localParameterBytes();
  out.grads = fsdp.localGradientBytes();
  out.optimizer = stateBytes(*optimizer);
  out.unit = fsdp.largestUnitBytes();
  return out;
}

// Each rank builds the whole MLP, keeps its stage (the model's own Linears) and lets the rest go.
Measured runPipeline(int layers, int width, int steps) {
  constexpr int kStages = 2, kMicroBatches = 4;
  const auto groups = ctorch::pipelineGroups(kStages);
  std::unique_ptr<ctorch::PipelineStage> stage;
  {
    torch::nn::Sequential mlp;
    for (int i = 0; i < layers; ++i) mlp->push_back(torch::nn::Linear(width, width));
    const auto sizes = ctorch::balancedPartition(mlp, kStages);
    stage = std::make_unique<ctorch::PipelineStage>(ctorch::pipelineSplit(mlp, sizes, groups.stage), groups.stage, kStages,
                                                    ctorch::PipelineStageOptions().group(groups.pipeline));
  }
  trace("model");
  ctorch::PipelineScheduleOptions options;
  if (groups.replicas > 1) options.dataParallelGroup(groups.dataParallel);
  ctorch::Schedule1F1B schedule(*stage, kMicroBatches, [](const at::Tensor& y, const at::Tensor&) { return y.pow(2).mean(); },
                                options);
  auto optimizer = adam(stage->module()->parameters());
  Measured out;
  timeSteps(steps, [&] {
    optimizer->zero_grad();
    const auto x = torch::randn({8 * kStages, width});
    const auto losses = schedule.step(stage->isFirst() ? x : at::Tensor(), stage->isLast() ? torch::zeros({8 * kStages}) : at::Tensor());
    trace("backward");
    optimizer->step();
    trace("optimizer");
    return losses.empty() ? 0.0 : losses.front().item<double>();
  }, out);
  std::vector<at::Tensor> grads;
  for (const auto& p : stage->module()->parameters()) grads.push_back(p.grad());
  out.params = bytesOf(stage->module()->parameters());
  out.grads = bytesOf(grads);
  out.optimizer = stateBytes(*optimizer);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 5 ? argv[1] : "";
  const bool hybrid = mode == "hybrid" || mode == "hybrid-grad-op";
  if (mode != "ddp" && mode != "zero" && mode != "fsdp" && mode != "fsdp-grad-op" && mode != "pipeline" && !hybrid) {
    std::fprintf(stderr, "usage: %s <ddp|zero|fsdp|fsdp-grad-op|hybrid|hybrid-grad-op|pipeline> <layers> <width> <steps>%s%s\n",
                 argv[0],
                 argc == 5 ? "; unknown mode: " : "", argc == 5 ? argv[1] : "");
    return 2;
  }
  const int layers = std::stoi(argv[2]), width = std::stoi(argv[3]), steps = std::stoi(argv[4]);
  torch::set_num_threads(1);
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::minutes(10)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  torch::manual_seed(1);
  const bool fsdp = mode.rfind("fsdp", 0) == 0 || hybrid;
  Measured m = fsdp                 ? runFsdp(mode == "fsdp" || mode == "hybrid", hybrid, layers, width, steps)
               : mode == "pipeline" ? runPipeline(layers, width, steps)
                                    : runDdp(mode == "zero", layers, width, steps);
  std::sort(m.ms.begin() + 1, m.ms.end());  // the first step builds the optimizer state: left out
  char unit[64] = "";
  if (fsdp) std::snprintf(unit, sizeof unit, " unit_mb=%.1f", m.unit / 1e6);
  std::printf("rank=%d world=%d mode=%s params_mb=%.1f grads_mb=%.1f optimizer_mb=%.1f peak_rss_mb=%.1f step_ms=%.0f%s\n",
              rank, world, mode.c_str(), m.params / 1e6, m.grads / 1e6, m.optimizer / 1e6, m.peakRss,
              m.ms.size() > 1 ? m.ms[1 + (m.ms.size() - 1) / 2] : m.ms[0], unit);
  if (std::getenv("ZERO_MEMORY_TRACE") != nullptr)
    std::fprintf(stderr, "trace rank=%d last_loss=%.9g\n", rank, m.lastLoss);
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}
