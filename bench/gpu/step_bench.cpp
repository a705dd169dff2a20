// Training throughput of one process under ctorch::DistributedDataParallel: a model of
// ctorch::models on CIFAR-shaped data already on the device, autocast to bfloat16 (or float16 with
// the GradScaler, or float32), SGD with momentum and weight decay, cross entropy. The Python twin,
// bench/gpu/step_bench.py, does exactly the same with PyTorch's DDP; bench/gpu/step_bench.sh runs them
// side by side. On a GPU: NCCL, cuDNN's autotuner on both sides. Without one (scripts/gpu/selftest.sh):
// the CPU and Gloo, bfloat16 through CPU autocast.
//
// Variants, measured in rounds that alternate between them inside this process:
//   eager   torch::optim::SGD (one parameter and one operation at a time), contiguous tensors
//   mt      ctorch::optim::SGD with --optimizer-kernels (default auto: fused on CUDA where LibTorch has it)
//   cl      parameters and input in channels-last memory format
//   mt-cl   both
// --cuda-graphs: each variant's whole step (forward, backward, DDP's NCCL allreduce, autocast, the
// GradScaler, SGD) captured by ctorch::CudaGraphStep after its warm-up and replayed; printed as
// cpp-graphs (eager) and cpp-graphs-<variant>. A variant not replaying after the warm-up is reported
// status=failed with the reason, never measured eagerly under the graphs' name; on the CPU, not-built.
// Usage: gpu_step_bench [--model resnet18] [--batch 256] [--steps 200] [--warmup 15]
//                       [--precision bf16|fp16|fp32] [--rounds 3] [--first-round 1]
//                       [--variants eager,mt-cl] [--optimizer-kernels auto|fused|foreach|per-parameter]
//                       [--cuda-graphs]
// Prints one line per variant and round: impl=cpp-<variant> ... round=r samples_per_s=... step_ms=...
// A variant this build cannot run prints impl=cpp-<variant> ... status=not-built reason=...
// `--help` lists the flags (bench/gpu/step_bench.sh reads it to know what this build offers).
#include <ctorch/amp.hpp>
#include <ctorch/cuda_graph.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/memory_format.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/optim.hpp>

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr const char* kUsage =
    "usage: gpu_step_bench [--model resnet18] [--batch 256] [--steps 200] [--warmup 15]\n"
    "                      [--precision bf16|fp16|fp32] [--rounds 3] [--first-round 1]\n"
    "                      [--variants eager,mt,cl,mt-cl] [--optimizer-kernels auto|fused|foreach|per-parameter]\n"
    "                      [--cuda-graphs]\n";

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

struct Options {
  std::string model = "resnet18", precision = "bf16", variants = "eager", kernels = "auto";
  int batch = 256, steps = 200, warmup = 15, rounds = 3, firstRound = 1;
  bool cudaGraphs = false;
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// One variant: its model behind DDP, its optimizer, GradScaler and input, ready to step; with
// --cuda-graphs, the CudaGraphStep that captures and replays its step.
struct Variant {
  std::string name;   // as printed: cpp-<variant>, or cpp-graphs[-<variant>] with --cuda-graphs
  std::shared_ptr<ctorch::models::Model> net;
  std::unique_ptr<ctorch::CudaGraphStep> graphed;
  std::unique_ptr<ctorch::DistributedDataParallel<std::shared_ptr<ctorch::models::Model>>> ddp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<ctorch::amp::GradScaler> scaler;
  torch::Tensor x;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (flag == "--cuda-graphs") {
      o.cudaGraphs = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "gpu_step_bench: %s needs a value\n%s", flag.c_str(), kUsage);
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--model") o.model = value;
    else if (flag == "--batch") o.batch = std::atoi(value.c_str());
    else if (flag == "--steps") o.steps = std::atoi(value.c_str());
    else if (flag == "--warmup") o.warmup = std::atoi(value.c_str());
    else if (flag == "--precision") o.precision = value;
    else if (flag == "--rounds") o.rounds = std::atoi(value.c_str());
    else if (flag == "--first-round") o.firstRound = std::atoi(value.c_str());
    else if (flag == "--variants") o.variants = value;
    else if (flag == "--optimizer-kernels") o.kernels = value;
    else {
      std::fprintf(stderr, "gpu_step_bench: unknown flag '%s'\n%s", flag.c_str(), kUsage);
      return 2;
    }
  }
  if (o.batch < 1 || o.steps < 1 || o.warmup < 0 || o.rounds < 0) {
    std::fprintf(stderr, "gpu_step_bench: --batch and --steps must be positive, --warmup and --rounds not negative\n");
    return 2;
  }
  try {
    const bool cuda = torch::cuda::is_available();
    ctorch::initProcessGroup(ctorch::ProcessGroupOptions().backend(cuda ? ctorch::Backend::kNccl : ctorch::Backend::kGloo));
    const torch::Device device =
        cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctorch::getLocalRank() % torch::cuda::device_count()))
             : torch::Device(torch::kCPU);
    at::globalContext().setBenchmarkCuDNN(true);  // as torch.backends.cudnn.benchmark = True
    const bool autocast = o.precision != "fp32";
    const auto dtype = o.precision == "fp16" ? torch::kHalf : torch::kBFloat16;
    torch::manual_seed(1);
    const auto xPlain = torch::randn({o.batch, 3, 32, 32}).to(device);
    const auto y = torch::randint(0, 10, {o.batch}).to(device);
    std::ostringstream commonText;
    commonText << "model=" << o.model << " device=" << device.str() << " precision=" << o.precision << " batch=" << o.batch;
    const std::string common = commonText.str();
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4);
    const auto kernels = ctorch::optim::kernelsFromString(o.kernels);
    if (!kernels) {
      std::fprintf(stderr, "gpu_step_bench: --optimizer-kernels '%s' (auto, fused, foreach, per-parameter)\n", o.kernels.c_str());
      return 2;
    }
    // A graphed step needs DDP's 11 warm-up steps (its Reducer times iterations 1 to 10), the capture
    // and one replay before the rounds measure replays only.
    const int warmup = o.cudaGraphs ? std::max<int>(o.warmup, static_cast<int>(ctorch::CudaGraphOptions().warmupSteps()) + 2)
                                    : o.warmup;

    std::vector<std::unique_ptr<Variant>> variants;
    for (const auto& name : split(o.variants)) {
      const bool mt = name == "mt" || name == "mt-cl", cl = name == "cl" || name == "mt-cl";
      if (name != "eager" && !mt && !cl) {
        std::fprintf(stderr, "gpu_step_bench: unknown variant '%s' (eager, mt, cl, mt-cl)\n", name.c_str());
        return 2;
      }
      auto v = std::make_unique<Variant>();
      v->name = !o.cudaGraphs ? "cpp-" + name : name == "eager" ? std::string("cpp-graphs") : "cpp-graphs-" + name;
      if (o.cudaGraphs && (!cuda || !ctorch::CudaGraphStep::available())) {
        std::printf("impl=%s %s status=not-built reason=%s\n", v->name.c_str(), common.c_str(),
                    cuda ? "this LibTorch has no CUDA graphs" : "CUDA graphs need a GPU (this run is on the CPU)");
        continue;
      }
      torch::manual_seed(0);
      ctorch::models::ModelOptions mo;
      mo.name = o.model;
      mo.inChannels = 3;
      mo.imageSize = 32;
      v->net = ctorch::models::createModel(mo);
      v->net->to(device);
      v->x = xPlain;
      if (cl) {  // model.to(memory_format=torch.channels_last), before DDP lays out its buckets
        ctorch::toMemoryFormat(*v->net, at::MemoryFormat::ChannelsLast);
        v->x = ctorch::toMemoryFormat(xPlain, at::MemoryFormat::ChannelsLast);
      }
      {
        // Graphed: DDP keeps the gradient accumulators, whose backward runs on the stream current at
        // its construction: the graph's side stream.
        std::optional<ctorch::CudaGraphStep::StreamScope> stream;
        if (o.cudaGraphs) {
          v->graphed = std::make_unique<ctorch::CudaGraphStep>(v->net->parameters());
          stream.emplace(v->graphed->sideStream(device));
        }
        v->ddp = std::make_unique<ctorch::DistributedDataParallel<std::shared_ptr<ctorch::models::Model>>>(
            v->net, ctorch::DDPOptions().bucketCapMb(25));
      }
      if (mt) v->optimizer = std::make_unique<ctorch::optim::SGD>(v->ddp->parameters(), sgd, *kernels);
      else v->optimizer = std::make_unique<torch::optim::SGD>(v->ddp->parameters(), sgd);
      v->scaler = std::make_unique<ctorch::amp::GradScaler>(device, ctorch::amp::GradScalerOptions().enabled(o.precision == "fp16"));
      if (v->graphed)
        v->graphed->add(ctorch::graphParticipant(*v->ddp))
            .add(ctorch::graphParticipant(*v->scaler))
            .add(ctorch::graphParticipant(*v->optimizer));
      variants.push_back(std::move(v));
    }

    // One step; returns the loss (not read: an .item() would wait for the device, and end a capture).
    auto eagerStep = [&](Variant& v, const torch::Tensor& x, const torch::Tensor& target) {
      v.ddp->zeroGrad(/*setToNone=*/true);
      torch::Tensor loss;
      {
        ctorch::amp::Autocast region(device.type(), dtype, autocast);
        loss = torch::nn::functional::cross_entropy((*v.ddp)(x), target);
      }
      v.scaler->scale(loss).backward();
      v.scaler->step(*v.optimizer);
      v.scaler->update();
      return loss.detach();
    };
    auto step = [&](Variant& v) {
      if (!v.graphed) return eagerStep(v, v.x, y);
      return v.graphed->run({v.x, y}, [&](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{eagerStep(v, in[0], in[1])};
      })[0];
    };
    for (auto it = variants.begin(); it != variants.end();) {
      auto& v = **it;
      const auto started = std::chrono::steady_clock::now();
      for (int i = 0; i < warmup; ++i) step(v);
      synchronize(device);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      // A graphed variant that is not replaying after its warm-up would measure eager steps under the
      // graphs' name: it is reported with the reason instead.
      if (v.graphed && v.graphed->lastDecision().action != ctorch::cuda_graph::Action::kReplay) {
        std::printf("impl=%s %s status=failed reason=not replaying after %d warm-up steps: %s\n", v.name.c_str(),
                    common.c_str(), warmup, v.graphed->lastDecision().reason.c_str());
        it = variants.erase(it);
        continue;
      }
      std::printf("impl=%s %s status=ready warmup_s=%.1f%s\n", v.name.c_str(), common.c_str(), seconds,
                  v.graphed ? " captured=1" : "");
      std::fflush(stdout);
      ++it;
    }
    for (int r = o.firstRound; r < o.firstRound + o.rounds; ++r)
      for (auto& v : variants) {
        synchronize(device);
        const auto replaysBefore = v->graphed ? v->graphed->replays() : 0;
        const auto start = std::chrono::steady_clock::now();
        torch::Tensor last;
        for (int i = 0; i < o.steps; ++i) last = step(*v);
        const double lastLoss = last.item<double>();  // waits for the device
        synchronize(device);
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::string replayed;
        if (v->graphed) replayed = " replayed=" + std::to_string(v->graphed->replays() - replaysBefore);
        std::printf("impl=%s %s round=%d steps=%d samples_per_s=%.1f step_ms=%.3f loss=%.4f%s\n", v->name.c_str(),
                    common.c_str(), r, o.steps, o.batch * o.steps / seconds, 1000.0 * seconds / o.steps, lastLoss,
                    replayed.c_str());
        std::fflush(stdout);
      }
    variants.clear();
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_step_bench: %s\n", e.what());
    return 1;
  }
}
