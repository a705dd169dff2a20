// Fully sharded data parallelism for LibTorch modules (ZeRO-3; Python's FullyShardedDataParallel /
// FSDP2's fully_shard): each rank holds 1/N of every unit's parameters, gradients and optimizer state;
// a unit's parameters are gathered just before its forward and again before its backward, freed after
// each, and its gradients are reduce-scattered as soon as its backward is done.
//
//   struct NetImpl : torch::nn::Module {        // a unit is called through ctorch::unitForward
//     torch::Tensor forward(torch::Tensor x) {
//       for (auto& block : blocks) x = ctorch::unitForward(block, x);
//       return head(x);
//     }
//   };
//   ctorch::FullyShardedDataParallel fsdp(net, ctorch::FSDPOptions().autoWrapPolicy(
//       ctorch::moduleTypeWrapPolicy<BlockImpl>()));
//   torch::optim::Adam adam(fsdp.parameters(), 1e-3);         // this rank's shards
//   ... adam.zero_grad(); fsdp(x).loss().backward(); adam.step(); ...
//
// LibTorch has no module hooks, so the places where a unit's parameters are needed are marked in the
// model: each unit's parent calls it through ctorch::unitForward (a plain call when no FSDP holds it).
// The first forward checks that every unit was reached that way and names any that was not (its
// parameters are kept gathered through that forward, so nothing reads freed memory).
// Construction and every forward and backward are collectives: all ranks make the same calls.
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/fsdp_unit.hpp"
#include "ctorch/module_traversal.hpp"
#include "ctorch/state_dict.hpp"
#include "ctorch/stateful.hpp"
#include "ctorch/unit_sequential.hpp"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace c10d {
class ProcessGroup;
}

namespace ctorch {

// Which submodules become units of their own (the rest of the parameters stay in their nearest
// enclosing unit; the root module is always a unit). Given each submodule's dotted name and the
// module, in registration order, outermost first.
using WrapPolicy = std::function<bool(const std::string& name, const torch::nn::Module& module)>;

// Python's size_based_auto_wrap_policy: a submodule whose parameters (counted over its whole subtree)
// number at least `minParameters` elements, innermost first, so that each large Linear or block is
// its own unit.
WrapPolicy sizeBasedWrapPolicy(std::int64_t minParameters);

// Python's ModuleWrapPolicy: every submodule of one of these implementation types (BlockImpl, not
// the Block holder).
template <class... ModuleImpls>
WrapPolicy moduleTypeWrapPolicy() {
  return [](const std::string&, const torch::nn::Module& module) {
    return ((dynamic_cast<const ModuleImpls*>(&module) != nullptr) || ...);
  };
}

// Mixed precision (Python FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype,
// cast_forward_inputs)). The shards, their gradients and the optimizer stay in the parameters' own
// dtype (float32: the full-precision master); only what is gathered and what is reduced changes.
struct MixedPrecisionPolicy {
  // The dtype of the gathered parameters the forward and backward compute with: each rank's shard is
  // cast to it and then all-gathered (bf16: half the bytes sent and held). Unset: the shards' dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, paramDtype);
  // The dtype gradients are reduce-scattered in (and, with hybrid sharding, all-reduced across the
  // nodes); the averaged shard of the gradient is cast back to the shard's dtype. Unset: paramDtype.
  // With float16 the gradients are divided by about sqrt(ranks) before the sum and by the rest after
  // it (Python's overflow guard); otherwise summed, then divided by the number of ranks.
  TORCH_ARG(std::optional<c10::ScalarType>, reduceDtype);
  // The dtype the root module's floating-point outputs are cast to. Unset: left as computed.
  TORCH_ARG(std::optional<c10::ScalarType>, outputDtype);
  // Cast the floating-point tensor arguments of the root's forward and of every unit's forward to
  // paramDtype (Python's cast_forward_inputs=True).
  TORCH_ARG(bool, castForwardInputs) = true;

  bool enabled() const { return paramDtype_ || reduceDtype_ || outputDtype_; }
};

struct FSDPOptions {
  // The group the parameters are sharded over (default: the default process group).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, processGroup);
  // Hybrid sharding (Python's HYBRID_SHARD / FSDP2's 2-D mesh): processGroup is a node's ranks, this
  // group the ranks holding the same shard on every node (ctorch::hybridShardGroups() makes both).
  // After each unit's reduce-scatter in the node, its shard of the gradient (1/N of it) is
  // all-reduced across the nodes and averaged over the whole world, as DDP averages; parameters and
  // buffers start from, and are broadcast from, the world's rank 0. Unset: plain FSDP.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, replicateGroup);
  // Unset: the root is the only unit (the whole model gathered through the step, gradients and
  // optimizer state sharded: ZeRO-2's memory).
  TORCH_ARG(WrapPolicy, autoWrapPolicy);
  // Free a unit's gathered parameters after its forward and gather them again for its backward
  // (FULL_SHARD; Python's reshard_after_forward=True). false keeps them from the forward to the end of
  // the backward (SHARD_GRAD_OP, ZeRO-2: one gather per step instead of two).
  TORCH_ARG(bool, reshardAfterForward) = true;
  // Gather the unit that comes next (in the previous step's order) while the current one computes, in
  // the forward and in the backward (Python's forward_prefetch / BACKWARD_PRE).
  TORCH_ARG(bool, prefetch) = true;
  // Broadcast buffers (BatchNorm running statistics) from rank 0 before each forward, as DDP does.
  TORCH_ARG(bool, broadcastBuffers) = true;
  // Start every rank from rank 0's parameters and buffers (Python's sync_module_states).
  TORCH_ARG(bool, syncModuleStates) = true;
  // Gather and compute in a lower precision, reduce gradients in a chosen one (see
  // MixedPrecisionPolicy). Default: everything in the parameters' own dtype.
  TORCH_ARG(MixedPrecisionPolicy, mixedPrecision);
};

namespace detail {

// The non-template engine behind FullyShardedDataParallel (units, flat shards, the communication
// thread, the autograd hooks).
// The engine behind FullyShardedDataParallel<M>, and what a checkpoint needs of it
// (ctorch/stateful.hpp; fsdp/fsdp_state.cpp): every rank writes its parameter shard and its
// optimizer's state shard, resharded on resume when the world size changed.
class FSDPCore : public Stateful {
 public:
  FSDPCore(std::shared_ptr<torch::nn::Module> root, FSDPOptions options);
  ~FSDPCore();
  FSDPCore(const FSDPCore&) = delete;
  FSDPCore& operator=(const FSDPCore&) = delete;

  void beginRootForward();
  void endRootForward(const std::vector<at::Tensor>& outputs);
  std::vector<at::Tensor> parameters() const;
  std::vector<std::pair<std::string, at::Tensor>> namedParameters() const;
  void zeroGrad(bool setToNone);
  double clipGradNorm(double maxNorm);
  void setRequiresGradientSync(bool on);
  torch::OrderedDict<std::string, at::Tensor> fullStateDict();
  void summonFullParameters(const std::function<void()>& fn);
  void loadFullStateDict(const torch::OrderedDict<std::string, at::Tensor>& state);
  ItemDict shardStateDict() const;
  void loadShardStateDicts(const std::vector<ItemDict>& shards);
  ItemDict optimizerShardStateDict(const torch::optim::Optimizer& optimizer) const;
  void loadOptimizerShardStateDicts(torch::optim::Optimizer& optimizer, const std::vector<ItemDict>& shards);
  std::vector<std::string> unitNames() const;
  std::size_t localParameterBytes() const;
  std::size_t localGradientBytes() const;
  std::size_t largestUnitBytes() const;
  at::Tensor castForwardInput(const at::Tensor& input) const;
  at::Tensor castOutput(const at::Tensor& output) const;
  const FSDPOptions& options() const;
  c10::intrusive_ptr<c10d::ProcessGroup> processGroup() const;
  torch::nn::Module& module();
  // In-place recovery of a sharded run (ResilientTraining::recover): releaseGroup() lets go of the
  // failed group (waits out what the communication thread still runs on it, dropping its failures),
  // frees every gathered unit and drops the failed step's gradients; rejoin() continues on the
  // re-formed group (the same ranks: the shards stay). Only for a model sharded over the default
  // group (followsDefaultGroup(): no processGroup or replicateGroup of its own).
  void releaseGroup();
  void rejoin(c10::intrusive_ptr<c10d::ProcessGroup> group);
  bool followsDefaultGroup() const;

  // ---- Stateful
  std::string stateName() const override;
  torch::nn::Module* trackedModule() override;
  void saveEntries(ItemDict& userState) const override;
  std::vector<std::string> entryNames() const override;
  bool sharded() const override { return true; }
  bool modelInShards() const override { return true; }
  ItemDict shardState(torch::optim::Optimizer* optimizer) const override;
  Snapshot shardFile(const ShardContext& context) const override;
  void loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) override;
  std::vector<at::Tensor> steppedParameters() const override { return parameters(); }
  std::string whyNotInPlace() const override;
  void leaveGroup() override { releaseGroup(); }
  void joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) override;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

} // namespace detail

template <class ModuleType>
class FullyShardedDataParallel {
 public:
  // Splits the module into units (options.autoWrapPolicy), flattens each unit's parameters into one
  // buffer per trainable/frozen kind, keeps this rank's 1/N of it and frees the rest. The module's own
  // parameter tensors stay (unit forwards see them gathered); optimize parameters() instead.
  // Throws ConfigError for a unit whose parameters mix dtypes or devices.
  explicit FullyShardedDataParallel(ModuleType module, FSDPOptions options = {})
      : module_(std::move(module)),
        core_(std::make_unique<detail::FSDPCore>(detail::modulePointer(module_), std::move(options))) {}

  // A root torch::nn::Sequential calls its children through their units (unit_sequential.hpp).
  // With a MixedPrecisionPolicy, the tensor arguments are cast to its paramDtype first
  // (castForwardInputs) and the outputs to its outputDtype.
  template <typename... Args>
  auto forward(Args&&... args) {
    core_->beginRootForward();
    auto output = [&] {
      if constexpr (std::is_base_of_v<torch::nn::SequentialImpl, std::remove_reference_t<decltype(*module_)>>)
        return detail::sequentialUnitForward<at::Tensor>(*module_, castInput(std::forward<Args>(args))...);
      else
        return module_->forward(castInput(std::forward<Args>(args))...);
    }();
    std::vector<at::Tensor> tensors;
    auto collect = [&](at::Tensor& t) {
      t = core_->castOutput(t);
      tensors.push_back(t);
    };
    detail::visitTensors(output, collect);
    core_->endRootForward(tensors);
    return output;
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  FullyShardedDataParallel* operator->() { return this; }

  ModuleType& module() { return module_; }
  // This rank's flat shards, one or two per unit (trainable; frozen ones with requires_grad false),
  // for the optimizer. After backward each trainable shard's grad is its slice of the gradient
  // averaged over the ranks.
  std::vector<at::Tensor> parameters() const { return core_->parameters(); }
  // "<unit>.flat" / "<unit>.flat_frozen" (the root unit is ""): the shards by name.
  std::vector<std::pair<std::string, at::Tensor>> namedParameters() const { return core_->namedParameters(); }
  void zeroGrad(bool setToNone = true) { core_->zeroGrad(setToNone); }
  // Clips the gradient by its global norm, computed over every rank's shards (Python's
  // FSDP.clip_grad_norm_), and returns that norm. A collective (of the shard group: with hybrid
  // sharding the nodes hold equal shards and each computes the same norm).
  double clipGradNorm(double maxNorm) { return core_->clipGradNorm(maxNorm); }
  // Gradient accumulation (Python's set_requires_gradient_sync): while off, backward keeps the
  // whole gradients on each rank, to be reduce-scattered with the next synchronised backward.
  void setRequiresGradientSync(bool on) { core_->setRequiresGradientSync(on); }
  // The module's full state dict (parameter and buffer names as module->named_parameters() and
  // named_buffers() give them, i.e. Python's keys), gathered on every rank. A collective.
  torch::OrderedDict<std::string, at::Tensor> fullStateDict() { return core_->fullStateDict(); }
  // Runs `fn` with every unit's parameters gathered (Python's summon_full_params, read-only: what fn
  // writes into them is lost), e.g. to write model.pt with ctorch::saveStateDict(module). A
  // collective; the parameters are freed again even when fn throws.
  void summonFullParameters(const std::function<void()>& fn) { core_->summonFullParameters(fn); }
  // Loads a full state dict (each rank keeps its shards of it). Every name must be present.
  void loadFullStateDict(const torch::OrderedDict<std::string, at::Tensor>& state) { core_->loadFullStateDict(state); }
  // This rank's shards with where they lie in each unit's unpadded flat buffer: what a sharded
  // snapshot keeps per rank. Any world size's shards load into any other's (loadShardStateDicts
  // takes all of them).
  ItemDict shardStateDict() const { return core_->shardStateDict(); }
  void loadShardStateDicts(const std::vector<ItemDict>& shards) { core_->loadShardStateDicts(shards); }
  // What a checkpoint needs of it (ctorch/stateful.hpp): `training.track(fsdp)` writes every rank's
  // shards of the parameters and of the tracked optimizer's state (built over fsdp.parameters()).
  operator Stateful&() { return *core_; }
  // The state of an optimizer built over parameters() (momentum, Adam's moments, ...), cut the same
  // way: this rank's part, which loadOptimizerShardStateDicts reassembles at any world size.
  // ConfigError when the optimizer does not hold these parameters or the shards do not fit.
  ItemDict optimizerShardStateDict(const torch::optim::Optimizer& optimizer) const {
    return core_->optimizerShardStateDict(optimizer);
  }
  void loadOptimizerShardStateDicts(torch::optim::Optimizer& optimizer, const std::vector<ItemDict>& shards) {
    core_->loadOptimizerShardStateDicts(optimizer, shards);
  }

  std::vector<std::string> unitNames() const { return core_->unitNames(); }
  std::size_t localParameterBytes() const { return core_->localParameterBytes(); }
  std::size_t localGradientBytes() const { return core_->localGradientBytes(); }
  // The bytes of the largest unit's gathered parameters (what one forward adds at its peak; in the
  // MixedPrecisionPolicy's paramDtype when it has one).
  std::size_t largestUnitBytes() const { return core_->largestUnitBytes(); }
  const FSDPOptions& options() const { return core_->options(); }
  c10::intrusive_ptr<c10d::ProcessGroup> processGroup() const { return core_->processGroup(); }
  void train(bool on = true) { core_->module().train(on); }
  void eval() { train(false); }

 private:
  template <class A>
  decltype(auto) castInput(A&& arg) {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) return core_->castForwardInput(arg);
    else return std::forward<A>(arg);
  }

  ModuleType module_;
  std::unique_ptr<detail::FSDPCore> core_;
};

} // namespace ctorch
