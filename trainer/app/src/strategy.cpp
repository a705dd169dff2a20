// ctorch-train's strategies (strategy.hpp): DDP with the whole optimizer or ZeRO-1's shares, FSDP,
// and the parameter server, each with its step, what it tracks and how it describes itself.
#include "ctorch/train/strategy.hpp"

#include "ctorch/train/strategy_table.hpp"
#include "strategies.hpp"

#include <ctorch/cuda_graph.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/fully_sharded_data_parallel.hpp>
#include <ctorch/hybrid_shard_groups.hpp>
#include <ctorch/memory_format.hpp>
#include <ctorch/optim.hpp>
#include <ctorch/models/resnet.hpp>
#include <ctorch/parameter_server.hpp>
#include <ctorch/pipeline.hpp>
#include <ctorch/zero_redundancy_optimizer.hpp>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <iostream>
#include <stdexcept>

namespace ctorch::train {

// Python's defaults apart from the learning rate and weight decay (and SGD's momentum); SGD, Adam and
// AdamW step all parameters at once (--optimizer-impl).
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const TrainOptions& o, const std::vector<torch::Tensor>& params) {
  switch (o.optimizer) {
    case OptimizerKind::kAdam:
      return std::make_unique<optim::Adam>(params, torch::optim::AdamOptions(o.lr).weight_decay(o.weightDecay),
                                           o.optimizerKernels);
    case OptimizerKind::kAdamW:
      return std::make_unique<optim::AdamW>(params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weightDecay),
                                            o.optimizerKernels);
    case OptimizerKind::kRmsprop:
      return std::make_unique<torch::optim::RMSprop>(params,
                                                     torch::optim::RMSpropOptions(o.lr).weight_decay(o.weightDecay));
    case OptimizerKind::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(params,
                                                     torch::optim::AdagradOptions(o.lr).weight_decay(o.weightDecay));
    case OptimizerKind::kSgd:
      break;
  }
  return std::make_unique<optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weightDecay), o.optimizerKernels);
}

namespace {

using Clock = std::chrono::steady_clock;
using Model = models::Model;
using DDP = DistributedDataParallel<std::shared_ptr<Model>>;
using FSDP = FullyShardedDataParallel<std::shared_ptr<Model>>;

// The model as a step drives it: a whole replica behind DDP, or shards behind FSDP (--sharding
// grad-op|full|hybrid|hybrid-grad-op).
class Replica {
 public:
  virtual ~Replica() = default;
  virtual void zeroGrad() = 0;
  virtual torch::Tensor operator()(const torch::Tensor& x) = 0;
  // Gradient accumulation: the micro-steps before the last keep their gradients local (DDP's
  // no_sync, held in `noSync`; FSDP's set_requires_gradient_sync(false)).
  virtual void synchronise(bool on, std::optional<NoSyncGuard>& noSync) = 0;
  // The gradient's global norm clipped.
  virtual void clipGradNorm(double maxNorm) = 0;
};

class DdpReplica final : public Replica {
 public:
  explicit DdpReplica(DDP& ddp) : ddp_(ddp) {}
  void zeroGrad() override { ddp_.zeroGrad(); }
  torch::Tensor operator()(const torch::Tensor& x) override { return ddp_(x); }
  void synchronise(bool on, std::optional<NoSyncGuard>& noSync) override {
    if (!on) noSync.emplace(ddp_.noSync());
  }
  // DDP's gradients are the same on every rank, so every rank clips alike.
  void clipGradNorm(double maxNorm) override { torch::nn::utils::clip_grad_norm_(ddp_.parameters(), maxNorm); }

 private:
  DDP& ddp_;
};

class FsdpReplica final : public Replica {
 public:
  explicit FsdpReplica(FSDP& fsdp) : fsdp_(fsdp) {}
  void zeroGrad() override { fsdp_.zeroGrad(); }
  torch::Tensor operator()(const torch::Tensor& x) override { return fsdp_(x); }
  void synchronise(bool on, std::optional<NoSyncGuard>&) override { fsdp_.setRequiresGradientSync(on); }
  // The norm summed over every rank's shards.
  void clipGradNorm(double maxNorm) override { fsdp_.clipGradNorm(maxNorm); }

 private:
  FSDP& fsdp_;
};

// The units of FullyShardedDataParallel in ctorch-train's models: each ResNet block, and each layer
// the model calls directly (its convolutions and Linears), which the models call through
// ctorch::unitForward. The rest (BatchNorm of the stem) stays in the root unit.
WrapPolicy trainerWrapPolicy() {
  return [](const std::string& name, const torch::nn::Module& module) {
    if (dynamic_cast<const models::BasicBlockImpl*>(&module) != nullptr) return true;
    const bool direct = name.find('.') == std::string::npos;
    return direct && (dynamic_cast<const torch::nn::LinearImpl*>(&module) != nullptr ||
                      dynamic_cast<const torch::nn::Conv2dImpl*>(&module) != nullptr);
  };
}

std::string gradientPath(const DDP& ddp) {
  const CommHook hook = ddp.commHookInUse();
  if (hook == CommHook::kSharedMemory)
    return std::string("shared memory (every rank on this host), ") +
           (ddp.options().gradientReduction() == GradientReduction::kAfterBackward
                ? "after the backward pass, on the computing thread"
                : "each bucket when ready, on a helper thread");
  if (hook == CommHook::kNone) return "the process group's allreduce";
  return std::string("the ") + toString(hook) + " hook";
}

std::string shardingPath(const FSDP& fsdp) {
  const bool full = fsdp.options().reshardAfterForward();
  const auto& replicate = fsdp.options().replicateGroup();
  if (!replicate)
    return "reduce-scatter into " + std::to_string(fsdp.parameters().size()) + " flat shards of " +
           std::to_string(fsdp.unitNames().size()) + " units (FSDP, " + (full ? "FULL_SHARD" : "SHARD_GRAD_OP") + ")";
  return "reduce-scatter into " + std::to_string(fsdp.parameters().size()) + " flat shards of " +
         std::to_string(fsdp.unitNames().size()) + " units over each node's " + std::to_string(fsdp.processGroup()->getSize()) +
         " ranks, then an allreduce of the shards across " + std::to_string(replicate->getSize()) + " nodes (FSDP, " +
         (full ? "HYBRID_SHARD" : "_HYBRID_SHARD_ZERO2") + ")";
}

// --sharding hybrid|hybrid-grad-op: the shard group of this node's ranks and the replicate group across
// the nodes (ctorch::hybridShardGroups refuses a world that is not nodes x equal local sizes). One
// node: its ranks shard as --sharding full|grad-op, with no replicate group; said once.
FSDPOptions fsdpOptionsFor(const TrainOptions& o) {
  FSDPOptions options;
  options.autoWrapPolicy(trainerWrapPolicy()).reshardAfterForward(reshardsAfterForward(o.sharding));
  auto dtype = [](const std::string& name) { return name == "float32" ? torch::kFloat : amp::parseDtype(name); };
  if (!o.fsdpParamDtype.empty()) options.mixedPrecision().paramDtype(dtype(o.fsdpParamDtype));
  if (!o.fsdpReduceDtype.empty()) options.mixedPrecision().reduceDtype(dtype(o.fsdpReduceDtype));
  // The loss and the metrics in float32, as torchtitan computes its loss from upcast logits.
  if (!o.fsdpParamDtype.empty()) options.mixedPrecision().outputDtype(torch::kFloat);
  if (!isHybrid(o.sharding)) return options;
  const auto groups = hybridShardGroups();
  options.processGroup(groups.shard).replicateGroup(groups.replicate);
  if (!groups.replicate && isMainProcess())
    std::cerr << "ctorch-train: --sharding " << toString(o.sharding) << " on one node of " << groups.layout.shardSize
              << " ranks: sharded over them as --sharding " << (reshardsAfterForward(o.sharding) ? "full" : "grad-op")
              << ", with no replica to average with\n"
              << std::flush;
  return options;
}
// The wall time since the previous call (or the construction): a step's phases one after another.
struct Lap {
  Clock::time_point mark = Clock::now();
  double operator()() {
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - mark).count();
    mark = now;
    return seconds;
  }
};

// The next micro-batch on `device`, its images in `format` (the model's), counted in the sampler and
// in `out` (its wait as data time).
std::pair<torch::Tensor, torch::Tensor> nextMicroBatch(const StepInputs& in, StepOutcome& out, Lap& lap) {
  auto batch = in.loader.next();
  out.phases.data += lap();
  if (!batch) throw std::logic_error("the batch loader ended before the sampler's epoch did");
  in.sampler.advance(batch->size());
  out.samples += batch->size();
  return {toMemoryFormat(batch->inputs.to(in.device, /*non_blocking=*/true), in.memoryFormat),
          batch->targets.to(in.device, /*non_blocking=*/true)};
}

// `optimizer`: the one this rank steps (with ZeRO its share's, null when it owns no parameter);
// `zero`: then broadcasts every share after the step.
StepOutcome trainStep(const StepInputs& in, Replica& ddp, torch::optim::Optimizer* optimizer,
                      ZeroRedundancyOptimizer* zero) {
  const TrainOptions& o = in.options;
  const torch::Device& device = in.device;
  amp::GradScaler& scaler = in.scaler;
  ddp.zeroGrad();
  // The last step of an epoch may have fewer micro-batches left; every rank has as many as the others.
  const std::int64_t micro = std::min(o.gradAccumSteps, ceilDiv(in.sampler.remaining(), o.batchSize));
  StepOutcome out;
  torch::Tensor lossSum = torch::zeros({}, torch::TensorOptions().device(device));
  Lap lap;
  for (std::int64_t m = 0; m < micro; ++m) {
    const auto [inputs, targets] = nextMicroBatch(in, out, lap);
    // Gradients are all-reduced on the last micro-step only (DDP's no_sync on the others).
    std::optional<NoSyncGuard> noSync;
    ddp.synchronise(m + 1 == micro, noSync);
    torch::Tensor loss;
    {
      amp::Autocast autocast(device.type(), amp::parseDtype(o.ampDtype), o.amp);
      loss = lossFor(in.model.output(), ddp(inputs), targets);
    }
    scaler.scale(micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
    lossSum += loss.detach();
    out.phases.forwardBackward += lap();
  }
  if (o.clipGradNorm > 0) {
    // DDP's gradients are averaged already, the same on every rank: their norm is the global one
    // and every rank clips alike (every parameter's, also those another rank's ZeRO share steps).
    // The scaler's factor comes off first (Python's unscale_ + clip).
    if (optimizer) scaler.unscale(*optimizer);
    ddp.clipGradNorm(o.clipGradNorm);
  }
  if (optimizer) scaler.step(*optimizer);
  if (zero) zero->broadcastShares();
  scaler.update();
  out.loss = lossSum.item<double>() / static_cast<double>(micro);
  out.phases.optimizer += lap();
  return out;
}

// --cuda-graphs: one micro-batch, no clipping (options.cpp refuses the rest). The step function reads
// the static inputs and returns the loss without reading it (an .item() would end the capture); the
// loss is read after the step, from the graph's output once captured. An eager step (warm-up, another
// shape, a blocker) says why once per reason.
StepOutcome graphedTrainStep(const StepInputs& in, CudaGraphStep& graphed, Replica& ddp,
                             torch::optim::Optimizer& optimizer, std::string& lastReason) {
  const TrainOptions& o = in.options;
  amp::GradScaler& scaler = in.scaler;
  StepOutcome out;
  Lap lap;
  const auto [inputs, targets] = nextMicroBatch(in, out, lap);
  const auto outputs = graphed.run({inputs, targets}, [&](const std::vector<at::Tensor>& statics) {
    ddp.zeroGrad();
    torch::Tensor loss;
    {
      amp::Autocast autocast(in.device.type(), amp::parseDtype(o.ampDtype), o.amp);
      loss = lossFor(in.model.output(), ddp(statics[0]), statics[1]);
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
    return std::vector<at::Tensor>{loss.detach()};
  });
  const auto& decision = graphed.lastDecision();
  const bool warmupCount = decision.reason.rfind("warm-up step ", 0) == 0;
  if (!decision.reason.empty() && !warmupCount && decision.reason != lastReason && isMainProcess())
    std::cerr << "ctorch-train: --cuda-graphs: step runs eagerly: " << decision.reason << std::endl;
  if (decision.action == cuda_graph::Action::kCapture && isMainProcess())
    std::cerr << "ctorch-train: --cuda-graphs: the step is captured; replaying it from now on" << std::endl;
  lastReason = decision.reason;
  out.phases.forwardBackward += lap();
  out.loss = outputs.at(0).item<double>();
  return out;
}

// --sync parameter-server. A worker accumulates its micro-batches' gradients locally (nothing to
// synchronise before the push), then ParameterServer::step pushes them and returns with the updated
// weights. A server reads no data: it consumes its copy of the sampler as a worker does (so that
// every rank agrees on the step count and the epoch's end) and serves the step (the optimizer runs
// there).
StepOutcome parameterServerStep(const StepInputs& in, ParameterServer& ps) {
  const TrainOptions& o = in.options;
  DistributedSampler& sampler = in.sampler;
  const std::int64_t micro = std::min(o.gradAccumSteps, ceilDiv(sampler.remaining(), o.batchSize));
  StepOutcome out;
  Lap lap;
  if (ps.isServer()) {
    sampler.advance(std::min(sampler.remaining(), micro * o.batchSize));
    if (!ps.serveStep()) throw std::logic_error("the workers finished before the sampler's epoch did");
    out.phases.optimizer = lap();
    return out;
  }
  ps.zeroGrad();
  torch::Tensor lossSum = torch::zeros({}, torch::TensorOptions().device(in.device));
  for (std::int64_t m = 0; m < micro; ++m) {
    const auto [inputs, targets] = nextMicroBatch(in, out, lap);
    torch::Tensor loss;
    {
      amp::Autocast autocast(in.device.type(), amp::parseDtype(o.ampDtype), o.amp);
      loss = lossFor(in.model.output(), in.model.forward(inputs), targets);
    }
    (micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
    lossSum += loss.detach();
    out.phases.forwardBackward += lap();
  }
  ps.step();
  out.loss = lossSum.item<double>() / static_cast<double>(micro);
  out.phases.optimizer += lap();
  return out;
}

// ---- the strategies ------------------------------------------------------------------------------

// DDP: every rank a whole replica; the whole optimizer on every rank, or (--sharding optimizer)
// ZeRO-1's share of it.
class DataParallel final : public Strategy {
 public:
  DataParallel(const TrainOptions& o, const std::shared_ptr<Model>& model) : o_(o) {
    // --cuda-graphs: DDP keeps the gradient accumulators, whose backward runs on the stream current at
    // its construction: the graph's side stream.
    std::optional<CudaGraphStep::StreamScope> graphStream;
    if (o.cudaGraphs) {
      graphed_ = std::make_unique<CudaGraphStep>(model->parameters());
      graphStream.emplace(graphed_->sideStream(model->parameters().front().device()));
    }
    ddp_ = std::make_unique<DDP>(model, DDPOptions()
                                            .bucketCapMb(o.bucketCapMb)
                                            .commHook(o.commHook)
                                            .gradientReduction(o.gradientReduction)
                                            .findUnusedParameters(o.findUnusedParameters)
                                            .gradientAsBucketView(o.gradientAsBucketView));
    replica_ = std::make_unique<DdpReplica>(*ddp_);
    if (o.sharding == ShardingChoice::kOptimizer)
      zero_ = std::make_unique<ZeroRedundancyOptimizer>(
          ddp_->parameters(), [this](std::vector<at::Tensor> share) { return makeOptimizer(o_, share); });
    else
      optimizer_ = makeOptimizer(o, ddp_->parameters());
    graphStream.reset();
    if (graphed_) graphed_->add(graphParticipant(*ddp_)).add(graphParticipant(*optimizer_));
  }
  int dataRanks() const override { return getWorldSize(); }
  int samplerRank() const override { return getRank(); }
  StepOutcome step(const StepInputs& in) override {
    if (graphed_) {
      if (!scalerAdded_) graphed_->add(graphParticipant(in.scaler)), scalerAdded_ = true;
      return graphedTrainStep(in, *graphed_, *replica_, *optimizer_, lastGraphReason_);
    }
    return trainStep(in, *replica_, stepping(), zero_.get());
  }
  torch::optim::Optimizer* stepping() override { return zero_ ? zero_->localOptimizer() : optimizer_.get(); }
  void track(ResilientTraining& t) override {
    t.track(*ddp_);
    if (zero_) t.track(*zero_);
    else t.track(*optimizer_);
  }
  std::string averaging(int worldSize) const override {
    return worldSize > 1 ? "; gradients averaged by " + gradientPath(*ddp_) : std::string();
  }
  std::optional<GradientReductionStats> reductionStats() const override { return ddp_->sharedMemoryStats(); }

 private:
  const TrainOptions& o_;
  std::unique_ptr<DDP> ddp_;
  std::unique_ptr<DdpReplica> replica_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;  // the whole optimizer (--sharding none)
  std::unique_ptr<ZeroRedundancyOptimizer> zero_;       // --sharding optimizer (ZeRO-1)
  std::unique_ptr<CudaGraphStep> graphed_;              // --cuda-graphs
  bool scalerAdded_ = false;
  std::string lastGraphReason_;
};

// FSDP (--sharding grad-op|full|hybrid|hybrid-grad-op): parameters, gradients and the optimizer's state
// sharded (over each node's ranks with hybrid).
class FullySharded final : public Strategy {
 public:
  FullySharded(const TrainOptions& o, const std::shared_ptr<Model>& model) {
    fsdp_ = std::make_unique<FSDP>(model, fsdpOptionsFor(o));
    replica_ = std::make_unique<FsdpReplica>(*fsdp_);
    optimizer_ = makeOptimizer(o, fsdp_->parameters());
  }
  int dataRanks() const override { return getWorldSize(); }
  int samplerRank() const override { return getRank(); }
  StepOutcome step(const StepInputs& in) override {
    return trainStep(in, *replica_, optimizer_.get(), nullptr);
  }
  torch::optim::Optimizer* stepping() override { return optimizer_.get(); }
  void track(ResilientTraining& t) override { t.track(*fsdp_).track(*optimizer_); }
  std::string averaging(int worldSize) const override {
    return worldSize > 1 ? "; gradients averaged by " + shardingPath(*fsdp_) : std::string();
  }
  EvalForward prepareEvaluation() override {
    return [this](const torch::Tensor& x) { return (*fsdp_)(x); };
  }
  void withFullWeights(const std::function<void()>& write) override { fsdp_->summonFullParameters(write); }

 private:
  std::unique_ptr<FSDP> fsdp_;
  std::unique_ptr<FsdpReplica> replica_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// --sync parameter-server: workers compute gradients, the servers (the last ranks) average them and
// run the optimizer over their shares.
class ParameterServing final : public Strategy {
 public:
  ParameterServing(const TrainOptions& o, const std::shared_ptr<Model>& model) : o_(o), model_(model) {
    ps_ = std::make_unique<ParameterServer>(
        model->parameters(), [this](std::vector<at::Tensor> share) { return makeOptimizer(o_, share); },
        ParameterServerOptions().servers(o.psServers).timeout(std::chrono::milliseconds(o.timeout)));
  }
  int dataRanks() const override { return ps_->numWorkers(); }
  // A server keeps worker 0's count of the data.
  int samplerRank() const override { return ps_->isServer() ? 0 : getRank(); }
  StepOutcome step(const StepInputs& in) override {
    return parameterServerStep(in, *ps_);
  }
  torch::optim::Optimizer* stepping() override { return ps_->localOptimizer(); }
  // Rank 0 is a worker: its model holds the current weights.
  void track(ResilientTraining& t) override { t.track(static_cast<torch::nn::Module&>(*model_)).track(*ps_); }
  std::string averaging(int worldSize) const override {
    const int workers = ps_->numWorkers();
    return "; gradients averaged by " + std::to_string(ps_->numServers()) + " parameter server" +
           (ps_->numServers() == 1 ? " (rank " + std::to_string(workers) + ")"
                                   : "s (ranks " + std::to_string(workers) + "-" + std::to_string(worldSize - 1) + ")") +
           ", which run the optimizer";
  }
  EvalForward prepareEvaluation() override {
    ps_->syncReplicas();  // a server's replica is current in its own share only
    return EvalForward();
  }

 private:
  const TrainOptions& o_;
  std::shared_ptr<Model> model_;
  std::unique_ptr<ParameterServer> ps_;
};

// --pipeline-stages S: the model's sequence (Model::sequential) cut into S balanced stages, one per
// rank of each pipeline of S consecutive ranks; each batch runs as --micro-batches M under
// --schedule; each stage's optimizer steps its own parameters; the replicas of a stage average their
// gradients. Every rank keeps the whole model (the other stages' weights are brought up to date
// for an evaluation and the final weights).
class Pipelined final : public Strategy {
 public:
  Pipelined(const TrainOptions& o, const std::shared_ptr<Model>& model) : o_(o), whole_(model->sequential()) {
    if (whole_.is_empty()) throw ConfigError("--pipeline-stages: model " + o.model + " is not a sequence of layers");
    groups_ = pipelineGroups(o.pipelineStages);
    sizes_ = balancedPartition(whole_, o.pipelineStages);
    stage_ = std::make_unique<PipelineStage>(pipelineSplit(whole_, sizes_, groups_.stage), groups_.stage, o.pipelineStages,
                                             PipelineStageOptions().group(groups_.pipeline).seed(static_cast<std::uint64_t>(o.seed)));
    PipelineScheduleOptions options;
    if (groups_.replicas > 1) options.dataParallelGroup(groups_.dataParallel);
    const models::ModelOutput output = model->output();
    schedule_ = std::make_unique<PipelineSchedule>(
        *stage_, o.microBatches, o.pipelineSchedule,
        [output](const at::Tensor& prediction, const at::Tensor& target) { return lossFor(output, prediction, target); },
        options);
    optimizer_ = makeOptimizer(o, stage_->module()->parameters());
  }
  int dataRanks() const override { return groups_.replicas; }
  int samplerRank() const override { return groups_.replica; }
  StepOutcome step(const StepInputs& in) override {
    StepOutcome out;
    Lap lap;
    const auto [inputs, targets] = nextMicroBatch(in, out, lap);
    if (inputs.size(0) < o_.microBatches) {
      // An epoch's last batch with fewer rows than micro-batches (the same on every rank: the
      // sampler pads the replicas' shares alike): not trained on, said once.
      if (!saidShortBatch_ && isMainProcess())
        std::cerr << "ctorch-train: an epoch's last batch of " << inputs.size(0) << " rows is fewer than the "
                  << o_.microBatches << " micro-batches: skipped" << std::endl;
      saidShortBatch_ = true;
      return out;
    }
    optimizer_->zero_grad();
    const auto losses = schedule_->step(stage_->isFirst() ? inputs : at::Tensor(), stage_->isLast() ? targets : at::Tensor());
    out.phases.forwardBackward += lap();
    optimizer_->step();
    // The last stage's loss (the mean over the micro-batches); the other stages add nothing to the
    // sum over the ranks, which is divided by the number of pipelines.
    if (!losses.empty()) out.loss = torch::stack(losses).mean().item<double>();
    out.phases.optimizer += lap();
    return out;
  }
  torch::optim::Optimizer* stepping() override { return optimizer_.get(); }
  void track(ResilientTraining& t) override { t.track(*schedule_).track(*optimizer_); }
  std::string averaging(int worldSize) const override {
    std::string text = "; a pipeline of " + std::to_string(groups_.stages) + " stages (this rank: stage " +
                       std::to_string(groups_.stage) + ", " + std::to_string(sizes_[static_cast<std::size_t>(groups_.stage)]) +
                       " of the model's " + std::to_string(whole_->size()) + " layers), " + std::to_string(o_.microBatches) +
                       " micro-batches per batch (" + (o_.pipelineSchedule == PipelineScheduleKind::kGPipe ? "GPipe" : "1F1B") + ")";
    if (groups_.replicas > 1)
      text += ", each stage's gradients averaged over its " + std::to_string(groups_.replicas) + " replicas";
    (void)worldSize;
    return text;
  }
  EvalForward prepareEvaluation() override {
    pipelineGatherModel(whole_, sizes_, *stage_);  // every rank evaluates its share with the whole model
    return EvalForward();
  }
  void withFullWeights(const std::function<void()>& write) override {
    pipelineGatherModel(whole_, sizes_, *stage_);
    write();
  }

 private:
  const TrainOptions& o_;
  torch::nn::Sequential whole_;
  PipelineGroups groups_;
  std::vector<std::size_t> sizes_;
  std::unique_ptr<PipelineStage> stage_;
  std::unique_ptr<PipelineSchedule> schedule_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  bool saidShortBatch_ = false;
};

} // namespace

std::unique_ptr<Strategy> makeDataParallel(const TrainOptions& o, const std::shared_ptr<models::Model>& model) {
  return std::make_unique<DataParallel>(o, model);
}
std::unique_ptr<Strategy> makeFullySharded(const TrainOptions& o, const std::shared_ptr<models::Model>& model) {
  return std::make_unique<FullySharded>(o, model);
}
std::unique_ptr<Strategy> makeParameterServing(const TrainOptions& o, const std::shared_ptr<models::Model>& model) {
  return std::make_unique<ParameterServing>(o, model);
}
std::unique_ptr<Strategy> makePipelined(const TrainOptions& o, const std::shared_ptr<models::Model>& model) {
  return std::make_unique<Pipelined>(o, model);
}

std::unique_ptr<Strategy> makeStrategy(const TrainOptions& o, const std::shared_ptr<models::Model>& model) {
  return chosenStrategy(o).make(o, model);
}

} // namespace ctorch::train
