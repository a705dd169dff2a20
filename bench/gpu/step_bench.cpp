// Training throughput of one process under ctorch::DistributedDataParallel: a model of
// ctorch::models on CIFAR-shaped data already on the device, autocast to bfloat16 (or float16 with
// the GradScaler, or float32), SGD with momentum and weight decay, cross entropy. The Python twin,
// bench/gpu/step_bench.py, does exactly the same with PyTorch's DDP; bench/gpu/step_bench.sh runs them
// side by side. On a GPU: NCCL, cuDNN's autotuner on both sides. Without one (scripts/gpu/selftest.sh):
// the CPU and Gloo, bfloat16 through CPU autocast.
// Usage: gpu_step_bench [--model resnet18] [--batch 256] [--steps 50] [--warmup 10] [--precision bf16|fp16|fp32]
// Prints one line: impl=cpp ... samples_per_s=... step_ms=...
#include <ctorch/amp.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/models/registry.hpp>

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "resnet18", precision = "bf16";
  int batch = 256, steps = 50, warmup = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--model") model = value;
    else if (flag == "--batch") batch = std::atoi(value.c_str());
    else if (flag == "--steps") steps = std::atoi(value.c_str());
    else if (flag == "--warmup") warmup = std::atoi(value.c_str());
    else if (flag == "--precision") precision = value;
    else {
      std::fprintf(stderr, "gpu_step_bench: unknown flag '%s'\n", flag.c_str());
      return 2;
    }
  }
  if (batch < 1 || steps < 1 || warmup < 0) {
    std::fprintf(stderr, "gpu_step_bench: --batch and --steps must be positive, --warmup not negative\n");
    return 2;
  }
  try {
    const bool cuda = torch::cuda::is_available();
    ctorch::initProcessGroup(ctorch::ProcessGroupOptions().backend(cuda ? ctorch::Backend::kNccl : ctorch::Backend::kGloo));
    const torch::Device device =
        cuda ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctorch::getLocalRank() % torch::cuda::device_count()))
             : torch::Device(torch::kCPU);
    at::globalContext().setBenchmarkCuDNN(true);  // as torch.backends.cudnn.benchmark = True

    torch::manual_seed(0);
    ctorch::models::ModelOptions mo;
    mo.name = model;
    mo.inChannels = 3;
    mo.imageSize = 32;
    auto net = ctorch::models::createModel(mo);
    net->to(device);
    ctorch::DistributedDataParallel ddp(net, ctorch::DDPOptions().bucketCapMb(25));
    torch::optim::SGD optimizer(ddp.parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(5e-4));
    const bool autocast = precision != "fp32";
    const auto dtype = precision == "fp16" ? torch::kHalf : torch::kBFloat16;
    ctorch::amp::GradScaler scaler(device, ctorch::amp::GradScalerOptions().enabled(precision == "fp16"));

    torch::manual_seed(1);
    const auto x = torch::randn({batch, 3, 32, 32}).to(device);
    const auto y = torch::randint(0, 10, {batch}).to(device);
    auto step = [&] {
      ddp.zeroGrad(/*setToNone=*/true);
      torch::Tensor loss;
      {
        ctorch::amp::Autocast region(device.type(), dtype, autocast);
        loss = torch::nn::functional::cross_entropy(ddp(x), y);
      }
      scaler.scale(loss).backward();
      scaler.step(optimizer);
      scaler.update();
      return loss;
    };
    for (int i = 0; i < warmup; ++i) step();
    synchronize(device);
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor last;
    for (int i = 0; i < steps; ++i) last = step();
    const double lastLoss = last.item<double>();  // waits for the device
    synchronize(device);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("impl=cpp model=%s device=%s precision=%s batch=%d steps=%d samples_per_s=%.1f step_ms=%.3f loss=%.4f\n",
                model.c_str(), device.str().c_str(), precision.c_str(), batch, steps, batch * steps / seconds,
                1000.0 * seconds / steps, lastLoss);
    ctorch::destroyProcessGroup();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_step_bench: %s\n", e.what());
    return 1;
  }
}
