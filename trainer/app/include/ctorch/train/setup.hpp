// What ctorch-train sets up before its loop: the device (chosen, then bound to the local rank), the
// default process group for the run, the data (datasets and their batch pipelines) and the model's
// options derived from them. The optimizer and the way ranks share a step are strategy.hpp's.
// Python's counterpart: the lines of a torchrun script before `for epoch in ...` (torch.device,
// init_process_group, Dataset/DataLoader, the model's constructor).
#pragma once

#include "ctorch/train/options.hpp"

#include <ctorch/distributed.hpp>
#include <ctorch/data/dataset.hpp>
#include <ctorch/data/pipeline.hpp>
#include <ctorch/models/registry.hpp>

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ctorch::train {

// The device the options ask for: CUDA (its index chosen by bindDevice) or the CPU, with --amp-dtype
// auto made that device's autocast type in `o` (validated again). Throws UsageError for --device cuda
// without a GPU, --amp float16 or --backend nccl on the CPU, or what float16 rules out.
torch::Device chooseDevice(TrainOptions& o);
// Gloo on the CPU; NCCL on CUDA unless --backend gloo; the collectives' --timeout.
ProcessGroupOptions processGroupOptions(const TrainOptions& o, const torch::Device& device);
// cuda:LOCAL_RANK (cuda:0 when each rank sees one GPU), made the current device; the CPU as is.
torch::Device bindDevice(const torch::Device& device);

// The default process group for the duration of the run.
class ProcessGroupScope {
 public:
  explicit ProcessGroupScope(const ProcessGroupOptions& options);
  ~ProcessGroupScope();
  ProcessGroupScope(const ProcessGroupScope&) = delete;
  ProcessGroupScope& operator=(const ProcessGroupScope&) = delete;
  // The current default group (in-place recovery replaces it; nothing here may keep the old one).
  c10d::ProcessGroup& group();
};

struct TrainData {
  std::shared_ptr<const data::InMemoryDataset> train, test;
  std::shared_ptr<const data::BatchPipeline> trainPipeline, testPipeline;
  bool augmented = false;  // crop + flip on the training batches
};

// The layout --memory-format resolves to, and why (the model line prints both).
struct MemoryFormatDecision {
  at::MemoryFormat format = at::MemoryFormat::Contiguous;
  std::string reason;  // "auto: CUDA and a convolutional model", "--memory-format", ...
  bool ignored = false;  // channels-last asked for a model without 4-D weights: nothing to convert
};
// auto: channels-last on CUDA for a model with 4-D weights (`convolutional`), contiguous on the CPU
// (measured no faster there: docs/performance.md), under FSDP (--sharding grad-op|full|hybrid*: its flat
// parameters are contiguous) and for other models. An explicit channels-last
// for a model without 4-D weights is accepted and changes nothing (`ignored`).
MemoryFormatDecision chooseMemoryFormat(const TrainOptions& o, bool cuda, bool convolutional);

// Both splits of --dataset, limited and seeded as the options say, with their pipelines.
TrainData loadData(const TrainOptions& o);
// The model's options from --model and the data's shape; UsageError when they do not fit.
models::ModelOptions modelOptionsFor(const TrainOptions& o, const data::InMemoryDataset& train);
// Heap bytes one sample's forward pass keeps for backward, measured on a throw-away copy of the model
// with a few zero samples before the real one is seeded and built. CPU only (on a GPU the activations
// are not on this heap); 0 when it cannot be measured.
std::int64_t measureActivationBytes(const models::ModelOptions& options, const std::vector<std::int64_t>& sampleShape);
// Bytes of one float sample of this shape.
std::int64_t sampleBytes(const std::vector<std::int64_t>& shape);
// "[1, 28, 28]".
std::string shapeText(const std::vector<std::int64_t>& shape);

}  // namespace ctorch::train
