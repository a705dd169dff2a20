// ctorch-train's set-up before the loop: device, process group, data and the model's options
// (setup.hpp). Python's counterpart: a torchrun script's lines before its epoch loop.
#include "ctorch/train/setup.hpp"

#include "ctorch/train/memory_check.hpp"
#include "ctorch/train/strategy_table.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/data/registry.hpp>
#include <ctorch/distributed_env.hpp>
#include <ctorch/errors.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

namespace ctorch::train {

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// ---- devices and the process group ----------------------------------------------------------------

torch::Device chooseDevice(TrainOptions& o) {
  const bool cuda = torch::cuda::is_available();
  o.resolveAmpDtype(o.device == DeviceChoice::kCuda || (o.device == DeviceChoice::kAuto && cuda));
  o.validate();
  if (o.device == DeviceChoice::kCuda && !cuda)
    throw UsageError("--device 'cuda' but no CUDA device is available to this LibTorch");
  const bool useCuda = o.device == DeviceChoice::kCuda || (o.device == DeviceChoice::kAuto && cuda);
  if (!useCuda) {
    if (o.amp && !amp::autocastSupported(torch::kCPU, amp::parseDtype(o.ampDtype)))
      throw UsageError("--amp with " + o.ampDtype + " needs CUDA, and this run uses the CPU (use --amp-dtype bfloat16)");
    if (o.backend == BackendChoice::kNccl)
      throw UsageError("--backend 'nccl' needs CUDA tensors, and this run uses the CPU");
    if (o.cudaGraphs) throw UsageError("--cuda-graphs needs CUDA, and this run uses the CPU (no CUDA device here)");
    return torch::kCPU;
  }
  return torch::Device(torch::kCUDA);  // the index is chosen once the local rank is known
}

ProcessGroupOptions processGroupOptions(const TrainOptions& o, const torch::Device& device) {
  Backend backend = Backend::kGloo;
  if (device.is_cuda()) backend = o.backend == BackendChoice::kGloo ? Backend::kGloo : Backend::kNccl;
  return ProcessGroupOptions().backend(backend).timeout(o.timeout);
}

torch::Device bindDevice(const torch::Device& device) {
  if (!device.is_cuda()) return device;
  const auto count = static_cast<int>(torch::cuda::device_count());
  const int index = count == 1 ? 0 : getLocalRank();
  if (index >= count)
    throw ConfigError("LOCAL_RANK " + std::to_string(getLocalRank()) + " has no GPU: " + std::to_string(count) +
                      " CUDA devices are visible");
  const torch::Device bound(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(bound);
  return bound;
}

ProcessGroupScope::ProcessGroupScope(const ProcessGroupOptions& options) { initProcessGroup(options); }
ProcessGroupScope::~ProcessGroupScope() {
  try {
    destroyProcessGroup();
  } catch (...) {
  }
}
c10d::ProcessGroup& ProcessGroupScope::group() { return *getDefaultGroup(); }

MemoryFormatDecision chooseMemoryFormat(const TrainOptions& o, bool cuda, bool convolutional) {
  MemoryFormatDecision d;
  // FSDP's flat parameters, a pipeline's activations between stages.
  const char* contiguousBecause = chosenStrategy(o).contiguousBecause;
  switch (o.memoryFormat) {
    case MemoryFormatChoice::kContiguous:
      d.reason = "--memory-format";
      break;
    case MemoryFormatChoice::kChannelsLast:
      d.ignored = !convolutional;
      d.format = convolutional ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
      d.reason = convolutional ? "--memory-format" : "--memory-format channels-last ignored: the model has no 4-D weights";
      break;
    case MemoryFormatChoice::kAuto:
      if (cuda && convolutional && !contiguousBecause) d.format = at::MemoryFormat::ChannelsLast;
      d.reason = !convolutional     ? "auto: the model has no 4-D weights"
                 : !cuda            ? "auto: contiguous on the CPU"
                 : contiguousBecause ? contiguousBecause
                                    : "auto: a convolutional model on CUDA";
      break;
  }
  return d;
}

// ---- data and model ----------------------------------------------------------------------------------

TrainData loadData(const TrainOptions& o) {
  auto options = [&](data::Split split, std::int64_t limit) {
    data::DatasetOptions d;
    d.name = o.dataset;
    d.root = o.dataDir;
    d.split = split;
    d.limit = limit;
    d.seed = static_cast<std::uint64_t>(o.seed);
    d.syntheticSize = split == data::Split::Train ? o.syntheticSize : 0;
    if (!o.syntheticShape.empty()) d.imageShape = o.syntheticShape;
    return d;
  };
  TrainData d;
  try {
    d.train = std::make_shared<const data::InMemoryDataset>(data::loadDataset(options(data::Split::Train, o.trainLimit)));
    d.test = std::make_shared<const data::InMemoryDataset>(data::loadDataset(options(data::Split::Test, o.testLimit)));
  } catch (const data::DataFileError& e) {
    // Unlike Fashion-MNIST (Debian's package), CIFAR-10 is not installed anywhere: say where it comes from.
    if (o.dataset != "cifar10") throw;
    throw data::DataFileError(std::string(e.what()) +
                              "; --dataset cifar10 reads the CIFAR-10 binary version: download cifar-10-binary.tar.gz "
                              "from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it, and pass the directory "
                              "holding data_batch_1.bin ... data_batch_5.bin and test_batch.bin as --data-dir");
  }
  data::PipelineOptions trainOptions;
  d.augmented = o.augment == AugmentChoice::kOn ||
                (o.augment == AugmentChoice::kAuto && d.train->info().recommendsCropFlip);
  if (d.augmented) {
    data::AugmentOptions augment;
    augment.seed = static_cast<std::uint64_t>(o.seed);
    trainOptions.augment = augment;
  }
  d.trainPipeline = std::make_shared<const data::BatchPipeline>(d.train, trainOptions);
  d.testPipeline = std::make_shared<const data::BatchPipeline>(d.test, data::PipelineOptions{});
  return d;
}

models::ModelOptions modelOptionsFor(const TrainOptions& o, const data::InMemoryDataset& train) {
  models::ModelOptions m;
  m.name = o.model;
  const auto shape = train.sampleShape();
  const bool regression = train.info().task == data::Task::Regression;
  if (o.model == "linear") {
    if (!regression || shape.size() != 1)
      throw UsageError("--model 'linear' needs regression data with feature vectors, but --dataset '" + o.dataset +
                       "' has samples of shape " + shapeText(shape) + " and " +
                       (regression ? "regression" : "class") + " targets");
    m.inFeatures = shape[0];
    m.outFeatures = train.targets().dim() > 1 ? train.targets().size(1) : 1;
    return m;
  }
  if (regression || shape.size() != 3 || shape[1] != shape[2])
    throw UsageError("--model '" + o.model + "' needs square images [C, H, W] with class labels, but --dataset '" +
                     o.dataset + "' has samples of shape " + shapeText(shape));
  m.inChannels = shape[0];
  m.imageSize = shape[1];
  m.numClasses = train.info().numClasses;
  return m;
}

std::int64_t measureActivationBytes(const models::ModelOptions& options, const std::vector<std::int64_t>& sampleShape) {
  constexpr std::int64_t kSamples = 8;
  const auto probe = models::createModel(options);
  probe->train();
  std::vector<std::int64_t> shape{kSamples};
  shape.insert(shape.end(), sampleShape.begin(), sampleShape.end());
  const auto input = torch::zeros(shape);
  probe->forward(input.narrow(0, 0, 2));  // one-time allocations (thread pools, kernel caches) first
  const auto before = heapBytesInUse();
  const auto output = probe->forward(input);
  const auto after = heapBytesInUse();
  if (!before || !after || *after <= *before) return 0;
  return (*after - *before) / kSamples;
}

std::int64_t sampleBytes(const std::vector<std::int64_t>& shape) {
  std::int64_t n = static_cast<std::int64_t>(sizeof(float));
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace ctorch::train
