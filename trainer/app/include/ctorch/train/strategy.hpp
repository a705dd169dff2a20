// How ctorch-train's ranks share the work of a step: data parallel (DDP, with the whole optimizer on
// every rank or ZeRO-1's shares of it), fully sharded (FSDP, --sharding grad-op|full|hybrid|hybrid-grad-op), a parameter
// server (--sync parameter-server) or a pipeline (--pipeline-stages). One Strategy is chosen once from
// the options (makeStrategy, from the table in strategy_table.hpp); the loop (trainer.cpp) only calls
// it, so a new way of training is one class here and one table entry, not edits in the loop.
#pragma once

#include "ctorch/train/evaluate.hpp"
#include "ctorch/train/options.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/resilience.hpp>
#include <ctorch/sampler.hpp>
#include <ctorch/data/loader.hpp>
#include <ctorch/models/model.hpp>

#include <torch/optim/optimizer.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace ctorch::train {

// Where a step's wall time goes (seconds, this rank): waiting for batches, forward and backward
// (the backward includes waiting for DDP's last gradient allreduce), the optimizer (and loss
// scaling), and the agreement with the other ranks (ResilientTraining::stepDone: one small
// allreduce, a snapshot's capture when one is due).
struct StepPhases {
  double data = 0, forwardBackward = 0, optimizer = 0, agreement = 0;
  StepPhases& operator+=(const StepPhases& o) {
    data += o.data;
    forwardBackward += o.forwardBackward;
    optimizer += o.optimizer;
    agreement += o.agreement;
    return *this;
  }
};

struct StepOutcome {
  double loss = 0.0;           // mean over this rank's micro-batches
  std::int64_t samples = 0;    // on this rank
  StepPhases phases;
};

// What a step reads and what it writes besides the strategy's own objects.
struct StepInputs {
  data::BatchLoader& loader;
  DistributedSampler& sampler;
  amp::GradScaler& scaler;
  models::Model& model;
  const TrainOptions& options;
  const torch::Device& device;
  // The layout of the model's 4-D weights, which each input batch is given too (--memory-format).
  at::MemoryFormat memoryFormat = at::MemoryFormat::Contiguous;
};

class Strategy {
 public:
  virtual ~Strategy() = default;

  // The ranks that read data and compute gradients (all of them, or the parameter server's workers),
  // and the share of the sampler this rank consumes.
  virtual int dataRanks() const = 0;
  virtual int samplerRank() const = 0;
  // One optimizer step over this rank's micro-batches of the step.
  virtual StepOutcome step(const StepInputs& in) = 0;
  // The optimizer this rank steps, for the learning rate (null: none here).
  virtual torch::optim::Optimizer* stepping() = 0;
  // Registers the model and the optimizer's state (or the Stateful objects holding them:
  // ctorch/stateful.hpp) with the run's snapshots.
  virtual void track(ResilientTraining& training) = 0;
  // The model line's tail: how the gradients are averaged ("; gradients averaged by ...", empty for
  // one rank). What the line calls a data rank, and what turns in-place recovery off, are the
  // strategy table's (strategy_table.hpp).
  virtual std::string averaging(int worldSize) const = 0;
  // DDP's shared-memory reduction's counters (null: none).
  virtual std::optional<GradientReductionStats> reductionStats() const { return std::nullopt; }
  // The forward an evaluation runs (empty: the model's own), after the replicas are brought up to date.
  virtual EvalForward prepareEvaluation() { return EvalForward(); }
  // Runs `write` with the whole model's weights in the model (FSDP gathers them: every rank calls this).
  virtual void withFullWeights(const std::function<void()>& write) { write(); }
};

// The strategy the options ask for (the strategy table's chosen entry), over `model` (on its device
// already); collective: every rank calls it at the same point.
std::unique_ptr<Strategy> makeStrategy(const TrainOptions& o, const std::shared_ptr<models::Model>& model);

// ceil(a / b) for positive counts: steps of an epoch, micro-batches left.
inline std::int64_t ceilDiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Python's defaults apart from the learning rate and weight decay (and SGD's momentum).
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const TrainOptions& o, const std::vector<torch::Tensor>& params);

} // namespace ctorch::train
