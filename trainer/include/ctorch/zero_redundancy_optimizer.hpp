// ZeRO stage 1 for LibTorch, Python's torch.distributed.optim.ZeroRedundancyOptimizer: each rank holds
// and steps the optimizer state of its share of the parameters only; after the step every share is
// broadcast from its owner, so all ranks hold the same updated parameters. Use it beside DDP (whose
// allreduce leaves every rank the averaged gradients) in place of a whole optimizer:
//
//   ctorch::DistributedDataParallel ddp(model);
//   ctorch::ZeroRedundancyOptimizer optimizer(ddp.parameters(), [](std::vector<at::Tensor> share) {
//     return std::make_unique<torch::optim::Adam>(share, torch::optim::AdamOptions(1e-3));
//   });
//   ... loss.backward(); optimizer.step(); optimizer.zeroGrad(); ...
//
// Exact: a parameter's update is computed by its owner with the same operations a whole optimizer
// applies to it, so the parameters are bit-identical to DDP with that optimizer (docs/sharding.md).
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/state_dict.hpp"
#include "ctorch/stateful.hpp"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

namespace ctorch {

struct ZeroOptions {
  // The group the parameters are shared over (default: the default process group).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, processGroup);
  // After the step, a contiguous parameter of at least this many bytes is broadcast from its owner in
  // place (no copy, as Python's ZeroRedundancyOptimizer sends each parameter); smaller ones travel
  // packed in one buffer per owner, kept between steps (fewer messages). 0: every contiguous
  // parameter in place.
  TORCH_ARG(std::int64_t, broadcastInPlaceBytes) = 64 * 1024;
};

// Which rank owns each parameter: Python's sorted-greedy packing (largest parameters first, each to
// the rank holding the fewest elements so far, the lowest such rank on a tie). Whole parameters,
// never split. `numels` in the parameters' order; returns the owner of each.
std::vector<int> partitionParameters(const std::vector<std::int64_t>& numels, int worldSize);

// A checkpoint sees it as a Stateful (zero/zero_state.cpp): the run's optimizer, its state in
// every rank's shard file, resharded on resume when the world size changed.
class ZeroRedundancyOptimizer : public ShardedOptimizerState {
 public:
  // Builds this rank's optimizer over its share (an empty share builds none).
  using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> share)>;

  // The parameters share one dtype and device (ConfigError otherwise).
  ZeroRedundancyOptimizer(std::vector<at::Tensor> parameters, OptimizerFactory makeOptimizer,
                          ZeroOptions options = {});
  ~ZeroRedundancyOptimizer();
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // The local optimizer's step on this rank's share, then every share broadcast from its owner.
  // A collective: every rank calls it at the same point. A failed broadcast throws DistributedError.
  void step();
  // The second half of step() alone, for a loop that steps localOptimizer() itself (e.g. through
  // amp::GradScaler::step): every share broadcast from its owner.
  void broadcastShares();
  // Every parameter's gradient set to none (or zeroed, `setToNone` false), owned or not.
  void zeroGrad(bool setToNone = true);

  const std::vector<at::Tensor>& parameters() const { return parameters_; }
  int ownerOf(std::size_t parameterIndex) const { return owners_.at(parameterIndex); }
  // This rank's optimizer (null when it owns no parameter), e.g. for its learning rate.
  torch::optim::Optimizer* localOptimizer() { return local_.get(); }
  // The bytes of optimizer state held on this rank (its share's momentum, Adam's moments, ...).
  std::size_t localStateBytes() const;

  // This rank's shard of the optimizer state, in Python's state_dict layout with the parameters'
  // GLOBAL indices (their places in parameters()): {"state": {index: {...}}, "param_groups": [{...,
  // "params": [index, ...]}], "optimizer_type": "Adam", "world_size": N, "rank": r}. What a sharded
  // snapshot keeps per rank.
  ItemDict shardStateDict() const override;
  // Restores this rank's share from shards saved at any world size (each rank passes every shard it
  // has, at least those holding its parameters): the states of the parameters it owns now are taken
  // from whichever shard holds them, so a run resumes on another number of ranks. Throws ConfigError
  // naming what does not fit (another optimizer, a parameter no shard holds, a shape).
  void loadShardStateDicts(const std::vector<ItemDict>& shards) override;

  // In-place recovery of a sharded run (ResilientTraining::recover, ResilienceOptions::shardCopies):
  // releaseGroup() lets go of the failed group, rejoin() continues on the re-formed one (the same
  // ranks, so the shares stay). Only for an optimizer on the default group (followsDefaultGroup()).
  void releaseGroup();
  void rejoin(c10::intrusive_ptr<c10d::ProcessGroup> group);
  bool followsDefaultGroup() const { return followsDefaultGroup_; }

  // ---- Stateful
  std::string stateName() const override { return "ZeroRedundancyOptimizer"; }
  std::string whyNotInPlace() const override;
  void leaveGroup() override;
  void joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) override;

 private:
  std::vector<at::Tensor> parameters_;
  std::vector<int> owners_;

  std::vector<std::vector<std::size_t>> shares_;  // per rank: indices of the parameters it owns
  std::unique_ptr<torch::optim::Optimizer> local_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  bool followsDefaultGroup_ = false;
  std::int64_t inPlaceBytes_ = 0;
  // Per owner: one buffer its small (or non-contiguous) parameters travel packed in, kept between
  // steps; its large contiguous parameters are broadcast in place.
  std::vector<at::Tensor> packBuffers_;
};

} // namespace ctorch
