// Pipeline parallelism (Python's torch.distributed.pipelining): a torch::nn::Sequential cut into S
// stages, one per rank of a pipeline group; activations and their gradients travel between
// neighbouring ranks with c10d send/recv; GPipe or 1F1B over M micro-batches per step.
//   auto sizes = ctorch::balancedPartition(model, S);                  // or your own: {2, 3, 1}
//   ctorch::PipelineStage stage(ctorch::pipelineSplit(model, sizes, rank), rank, S);
//   ctorch::Schedule1F1B schedule(stage, /*microBatches=*/4, lossFn);
//   auto losses = schedule.step(x, y);   // x read on the first stage, y on the last; docs/pipeline.md
//   optimizer.step();                    // each stage steps its own parameters
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/stateful.hpp"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class ProcessGroup;
class Work;
}

namespace ctorch {

// ---- Partition (pure) --------------------------------------------------------------------------------
// The number of children of each of `stages` contiguous stages (each at least one) whose largest
// parameter count is as small as it can be; ties go to the earlier cut. Throws ConfigError when
// there are fewer children than stages or stages < 1.
std::vector<std::size_t> balancedPartition(const torch::nn::Sequential& model, int stages);

// Stage `stage` of `model` cut by `stageSizes` (children per stage): a Sequential holding the
// model's own child modules (the same parameters, not copies). Throws ConfigError when the sizes do
// not add up to the model's children, one is zero, or `stage` is outside them.
torch::nn::Sequential pipelineSplit(const torch::nn::Sequential& model, const std::vector<std::size_t>& stageSizes,
                                    int stage);

// ---- Schedules as action lists (pure) ------------------------------------------------------------------
enum class PipelineScheduleKind {
  kGPipe,  // every forward, then every backward (M micro-batches' activations held at once)
  k1F1B,   // warm-up forwards, then one forward one backward: at most S - stage in flight
};
const char* toString(PipelineScheduleKind kind);
// "gpipe" or "1f1b" (case-insensitive); throws ConfigError naming the value otherwise.
PipelineScheduleKind parsePipelineSchedule(const std::string& name);

struct PipelineAction {
  enum class Kind { kForward, kBackward };
  Kind kind;
  int microBatch;
  bool operator==(const PipelineAction& other) const { return kind == other.kind && microBatch == other.microBatch; }
};
// What `stage` of `numStages` does in one step, in order. Backwards run in micro-batch order under
// both schedules, so gradients accumulate in the order gradient accumulation would add them.
std::vector<PipelineAction> pipelineActions(PipelineScheduleKind kind, int stage, int numStages, int microBatches);

// The seed a stage's forward of one micro-batch runs under when PipelineStageOptions::seed is set
// (dropout draws the same masks in a single process that seeds each stage's part the same way).
std::uint64_t pipelineMicroBatchSeed(std::uint64_t seed, std::int64_t step, int microBatch, int stage);

// ---- A stage -------------------------------------------------------------------------------------------
struct PipelineStageOptions {
  // The pipeline group: stage i is its rank i. Unset: the default group (initProcessGroup()).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, group);
  // Each forward of a micro-batch runs with the default generator of the stage's device seeded by
  // pipelineMicroBatchSeed(seed, step, micro-batch, stage), the generator's state restored after
  // (the loop's own random stream is not disturbed). Unset: the generator is used as it is.
  TORCH_ARG(std::optional<std::uint64_t>, seed);
};

class PipelineStage {
 public:
  // `module` is this rank's part of the model (pipelineSplit). Throws ConfigError when the group's
  // size is not numStages or this rank's place in it is not stageIndex, or there is no group.
  PipelineStage(torch::nn::Sequential module, int stageIndex, int numStages, PipelineStageOptions options = {});

  torch::nn::Sequential& module() { return module_; }
  int stageIndex() const { return stageIndex_; }
  int numStages() const { return numStages_; }
  bool isFirst() const { return stageIndex_ == 0; }
  bool isLast() const { return stageIndex_ == numStages_ - 1; }
  const PipelineStageOptions& options() const { return options_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

 private:
  torch::nn::Sequential module_;
  int stageIndex_, numStages_;
  PipelineStageOptions options_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

// ---- Running a schedule ----------------------------------------------------------------------------------
// The last stage's loss of one micro-batch's output and target (a scalar).
using PipelineLossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

struct PipelineScheduleOptions {
  // Backward runs on loss / M, so that the gradients are the mean over the micro-batches, as
  // gradient accumulation over M micro-steps computes them (Python's scale_grads=True). Off: the sum.
  TORCH_ARG(bool, scaleLoss) = true;
  // Pipeline x data parallelism: after the step's last backward the stage's gradients are averaged
  // over this group (the ranks holding the same stage in every pipeline: pipelineGroups()), in one
  // flat allreduce per dtype. Unset: no averaging.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, dataParallelGroup);
};

// What one step did on this stage: for the bubble measurement and the activation-memory bound.
struct PipelineStepStats {
  std::chrono::duration<double> compute{0};  // forwards, backwards, the loss
  std::chrono::duration<double> waiting{0};  // in recv waits (the bubble, seen from this stage)
  std::chrono::duration<double> total{0};    // the whole step, the data-parallel average included
  int maxInFlight = 0;                       // micro-batches forwarded and not yet backwarded, at most
  bool shapesExchanged = false;              // this step agreed activation shapes anew
};

// A checkpoint sees a pipeline stage through its schedule, a Stateful (pipeline/pipeline_state.cpp):
// every rank writes its stage's parameters, buffers and the tracked optimizer's state (built over the
// stage's parameters), the stage's layout and the step count in its shard file.
class PipelineSchedule : public Stateful {
 public:
  // Throws ConfigError for microBatches < 1, or a last stage without a loss function.
  PipelineSchedule(PipelineStage& stage, int microBatches, PipelineScheduleKind kind, PipelineLossFn loss = {},
                   PipelineScheduleOptions options = {});
  virtual ~PipelineSchedule();
  PipelineSchedule(const PipelineSchedule&) = delete;
  PipelineSchedule& operator=(const PipelineSchedule&) = delete;

  // One training step: the first stage splits `input` into M micro-batches along dim 0 (as
  // torch.tensor_split), the last splits `target` the same way, every stage runs its actions, and
  // gradients accumulate in the stage's parameters (zero them before, step the optimizer after).
  // Returns the last stage's M losses (detached, unscaled); empty on the other stages. A collective
  // of the pipeline group: every stage calls it once per step. Activation shapes are agreed on the
  // first step and again whenever the input's micro-batch shapes change; in between, fixed receive
  // buffers. Throws ConfigError for a batch of fewer rows than micro-batches or a missing input or
  // target, DistributedError (DistributedTimeout) when a neighbour fails or does not answer within
  // the group's timeout.
  std::vector<at::Tensor> step(const at::Tensor& input = {}, const at::Tensor& target = {});

  // Forward only (evaluation): the last stage's outputs of the M micro-batches, concatenated; an
  // undefined tensor on the other stages. No gradients, nothing kept.
  at::Tensor evaluate(const at::Tensor& input = {});

  const PipelineStepStats& lastStepStats() const { return stats_; }
  // Steps taken (the step of pipelineMicroBatchSeed). A resumed loop sets it to its own step count.
  std::int64_t stepCount() const { return steps_; }
  void setStepCount(std::int64_t steps) { steps_ = steps; }
  int microBatches() const { return microBatches_; }
  PipelineScheduleKind kind() const { return kind_; }
  PipelineStage& stage() const { return stage_; }

  // ---- Stateful
  std::string stateName() const override { return "PipelineSchedule"; }
  torch::nn::Module* trackedModule() override;
  void saveEntries(ItemDict& userState) const override;
  std::vector<std::string> entryNames() const override;
  bool sharded() const override { return true; }
  bool modelInShards() const override { return true; }
  ItemDict shardState(torch::optim::Optimizer* optimizer) const override;
  Snapshot shardFile(const ShardContext& context) const override;
  void loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) override;
  std::string whyNotInPlace() const override;

 private:
  struct Impl;
  class StepRun;  // one run of the schedule, one function per action (schedule.cpp)
  std::vector<at::Tensor> run(const at::Tensor& input, const at::Tensor& target, bool training);

  PipelineStage& stage_;
  int microBatches_;
  PipelineScheduleKind kind_;
  PipelineLossFn loss_;
  PipelineScheduleOptions options_;
  std::int64_t steps_ = 0;
  PipelineStepStats stats_;
  std::unique_ptr<Impl> impl_;
};

// Python's ScheduleGPipe(stage, n_microbatches, loss_fn) and Schedule1F1B.
class ScheduleGPipe : public PipelineSchedule {
 public:
  ScheduleGPipe(PipelineStage& stage, int microBatches, PipelineLossFn loss = {}, PipelineScheduleOptions options = {})
      : PipelineSchedule(stage, microBatches, PipelineScheduleKind::kGPipe, std::move(loss), std::move(options)) {}
};
class Schedule1F1B : public PipelineSchedule {
 public:
  Schedule1F1B(PipelineStage& stage, int microBatches, PipelineLossFn loss = {}, PipelineScheduleOptions options = {})
      : PipelineSchedule(stage, microBatches, PipelineScheduleKind::k1F1B, std::move(loss), std::move(options)) {}
};

// Every stage's current parameters and buffers into this rank's copy of the whole model: `model` as
// the stages were cut from it (pipelineSplit with `stageSizes`), stage t's from the pipeline group's
// rank t (one broadcast per stage and dtype). For what needs the whole model on a rank: an evaluation,
// the final weights. A collective of the pipeline group: every stage calls it at the same point.
// Throws DistributedError when a stage fails or does not answer within the group's timeout.
void pipelineGatherModel(const torch::nn::Sequential& model, const std::vector<std::size_t>& stageSizes,
                         const PipelineStage& stage);

// ---- Pipeline x data parallelism ---------------------------------------------------------------------
// World = replicas x stages, ranks numbered pipeline by pipeline (pipeline r holds ranks r*S .. r*S+S-1,
// consecutive ranks, so a node's ranks form whole pipelines where S divides the node's size).
struct PipelineGroups {
  c10::intrusive_ptr<c10d::ProcessGroup> pipeline;      // this rank's pipeline: PipelineStageOptions::group
  c10::intrusive_ptr<c10d::ProcessGroup> dataParallel;  // the ranks of this stage in every pipeline;
                                                        // empty with one pipeline
  int stage = 0, replica = 0, stages = 1, replicas = 1;
};
// Makes every pipeline group and every stage's data-parallel group (newGroup, on every rank of the
// default group, in that order) and returns this rank's. Throws ConfigError when `stages` does not
// divide the world.
PipelineGroups pipelineGroups(int stages);

} // namespace ctorch
