// DistributedDataParallel for LibTorch modules, on c10d's Reducer (the engine under Python's DDP):
//   ctorch::DistributedDataParallel ddp(model, ctorch::DDPOptions().bucketCapMb(25));
//   auto loss = torch::mse_loss(ddp(x), y);  loss.backward();  // gradients averaged across ranks
// Construction and every forward are collectives: all ranks must make the same calls.
#pragma once

#include "ctorch/comm_hook.hpp"
#include "ctorch/distributed.hpp"
#include "ctorch/errors.hpp"
#include "ctorch/module_traversal.hpp"
#include "ctorch/stateful.hpp"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace c10d {
class CommHookInterface;
}

namespace ctorch {

// Where a rank's time in the shared-memory hook's reductions went (DistributedDataParallel::
// sharedMemoryStats()).
struct GradientReductionStats {
  std::int64_t calls = 0;               // buckets reduced
  std::chrono::nanoseconds total{0};    // inside the reductions: copies, sums, waits
  std::chrono::nanoseconds waiting{0};  // of which waiting at a barrier for the other ranks
};

struct DDPOptions {
  // Reduction buckets hold at most this many MiB of gradients (Python's bucket_cap_mb).
  TORCH_ARG(double, bucketCapMb) = 25.0;
  // The first bucket (the last parameters, whose gradients are ready first) is kept small so its
  // allreduce starts early (Python's dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB).
  TORCH_ARG(double, firstBucketCapMb) = 1.0;
  // Traverse the autograd graph from the outputs every iteration and mark parameters that took no
  // part as ready, so models with unused parameters do not stall the Reducer.
  TORCH_ARG(bool, findUnusedParameters) = false;
  // Gradients become views into the allreduce buckets: saves a copy and the memory of one gradient
  // set. Zero them with zeroGrad(), not Optimizer::zero_grad().
  TORCH_ARG(bool, gradientAsBucketView) = false;
  // Broadcast buffers (BatchNorm running statistics) from rank 0 before each forward.
  TORCH_ARG(bool, broadcastBuffers) = true;
  // The set of used parameters and the graph never change between iterations.
  TORCH_ARG(bool, staticGraph) = false;
  // Start from these buckets (parameter indices per bucket, in reduction order, as
  // bucketAssignment() returns them) instead of computing them. The Reducer still rebuilds them after
  // the first iteration where it would anyway, which changes nothing when they came from the same
  // model. A process that resumes a run passes the assignment its predecessor ended with: with more
  // than two ranks Gloo's ring sums each gradient element in an order set by its place in the
  // bucket, so the same layout is what keeps a restarted run bit-identical.
  TORCH_ARG(std::optional<std::vector<std::vector<size_t>>>, bucketAssignment);
  TORCH_ARG(CommHook, commHook) = CommHook::kNone;
  // With kSharedMemory: reduce each bucket when it is ready, or all at the end of the backward pass.
  TORCH_ARG(GradientReduction, gradientReduction) = GradientReduction::kOverlapped;
  // The group to reduce over; unset: the default group (ctorch::initProcessGroup()).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, processGroup);

 public:
  // Throws ConfigError for values that cannot work.
  void validate() const;
};

class NoSyncGuard;
class GraphParticipant;  // ctorch/cuda_graph.hpp

namespace detail {

// The non-template engine behind DistributedDataParallel<M> (Reducer, Logger, buffer sync), and
// what a checkpoint needs of it (ctorch/stateful.hpp; ddp/ddp_state.cpp): the whole model in the
// snapshot, the bucket layout beside it (a resumed run reduces in the same order: bit-identical
// with more than two ranks), and the group re-formed in place.
class DDPCore : public Stateful {
 public:
  DDPCore(std::shared_ptr<torch::nn::Module> module, DDPOptions options);
  ~DDPCore();
  DDPCore(const DDPCore&) = delete;
  DDPCore& operator=(const DDPCore&) = delete;

  // Before the module's forward: Reducer bookkeeping, bucket rebuild, buffer broadcast. Returns true
  // when endForward needs the tensors of the output (unused-parameter search, the _DDPSink).
  bool beginForward();
  // After the module's forward. `outputs` is null when the output's type cannot be inspected.
  // Returns replacements for the output tensors (in the same order) or an empty vector.
  std::vector<at::Tensor> endForward(const std::vector<at::Tensor>* outputs, const char* outputType);

  bool requireBackwardGradSync() const;
  void setRequireBackwardGradSync(bool on);
  void registerCommHook(std::unique_ptr<c10d::CommHookInterface> hook);
  void zeroGrad(bool setToNone);
  bool rebuildBuckets();
  std::vector<std::vector<size_t>> bucketAssignment() const;
  // Builds the Reducer again with these buckets (or the current ones), before the first forward;
  // with gradientAsBucketView, gradients that are still undefined are defined as zeros first.
  void resetReducer(const std::optional<std::vector<std::vector<size_t>>>& buckets);
  // In-place recovery: lets go of the failed group (Reducer, hooks, shared memory, the group itself),
  // then joins the re-formed one as a freshly constructed DDP would (the shared-memory segment is
  // a collective) with these buckets. Every rank calls rejoin at the same point.
  void releaseGroup();
  void rejoin(c10::intrusive_ptr<c10d::ProcessGroup> group,
              const std::optional<std::vector<std::vector<size_t>>>& buckets);
  const DDPOptions& options() const;
  // Why the next step cannot be captured in a CUDA graph (ctorch/cuda_graph.hpp), in one line;
  // nullopt when it can.
  std::optional<std::string> captureBlocker() const;
  // Counts the Reducers built (construction, resetReducer, rejoin): a CUDA graph captured with one
  // holds its buckets and communicator.
  std::int64_t reducerGeneration() const;
  // The hook gradients travel through (CommHook::kCustom after registerCommHook).
  CommHook commHookInUse() const;
  std::optional<GradientReductionStats> sharedMemoryStats() const;
  c10::intrusive_ptr<c10d::ProcessGroup> processGroup() const;
  torch::nn::Module& module();

  // ---- Stateful
  std::string stateName() const override;
  torch::nn::Module* trackedModule() override;
  void saveEntries(ItemDict& userState) const override;
  std::vector<std::string> entryNames() const override;
  void checkEntries(const Snapshot& snapshot) const override;
  void prepareLoad(const ItemDict* userState) override;
  void stepEnded() override;
  std::string whyNotInPlace() const override;
  void leaveGroup() override;
  void joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace detail

// Turns gradient synchronisation off for its lifetime (Python's no_sync()): gradients accumulate
// locally and the first backward after the scope averages everything accumulated.
class [[nodiscard]] NoSyncGuard {
 public:
  explicit NoSyncGuard(detail::DDPCore& core) : core_(&core), previous_(core.requireBackwardGradSync()) {
    core.setRequireBackwardGradSync(false);
  }
  NoSyncGuard(NoSyncGuard&& other) noexcept
      : core_(std::exchange(other.core_, nullptr)), previous_(other.previous_) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard() {
    if (core_) core_->setRequireBackwardGradSync(previous_);
  }

 private:
  detail::DDPCore* core_;
  bool previous_;
};

// Wraps a module: `ModuleType` is a module holder (torch::nn::Linear, a TORCH_MODULE) or a
// std::shared_ptr<SomeModule>. Construction verifies parameter shapes across ranks, broadcasts
// parameters and buffers from rank 0 and builds the Reducer; forward() calls the module's own
// forward with any arguments and prepares the Reducer for the backward that follows.
template <typename ModuleType>
class DistributedDataParallel {
 public:
  explicit DistributedDataParallel(ModuleType module, DDPOptions options = DDPOptions())
      : module_(std::move(module)),
        core_(std::make_unique<detail::DDPCore>(detail::modulePointer(module_), std::move(options))) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    const bool wantOutputs = core_->beginForward();
    auto output = module_->forward(std::forward<Args>(args)...);
    if (!wantOutputs) {
      core_->endForward(nullptr, nullptr);
      return output;
    }
    std::vector<at::Tensor> tensors;
    auto collect = [&](at::Tensor& t) { tensors.push_back(t); };
    const bool inspectable = detail::visitTensors(output, collect);
    auto replacements = core_->endForward(inspectable ? &tensors : nullptr, typeid(output).name());
    if (!replacements.empty()) {
      size_t next = 0;
      auto replace = [&](at::Tensor& t) { t = replacements.at(next++); };
      detail::visitTensors(output, replace);
    }
    return output;
  }

  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // Reads like a LibTorch module holder: ddp->forward(x).
  DistributedDataParallel* operator->() { return this; }

  // The wrapped module (save and load its state through this).
  ModuleType& module() { return module_; }
  const ModuleType& module() const { return module_; }

  // Parameters of the wrapped module, for the optimizer.
  std::vector<at::Tensor> parameters() const { return detail::modulePointer(module_)->parameters(); }

  // Skips gradient synchronisation while the returned guard lives (gradient accumulation):
  //   { auto guard = ddp.noSync(); ddp(x1).sum().backward(); }  ddp(x2).sum().backward();
  NoSyncGuard noSync() { return NoSyncGuard(*core_); }

  // Zeroes (or, with setToNone, drops) the wrapped module's gradients the way Python's optimizer does;
  // safe with gradientAsBucketView, where Optimizer::zero_grad() throws in LibTorch 1.13.
  void zeroGrad(bool setToNone = false) { core_->zeroGrad(setToNone); }

  // A C++ communication hook (c10d::CommHookInterface), before the first forward. Cannot be combined
  // with DDPOptions::commHook.
  void registerCommHook(std::unique_ptr<c10d::CommHookInterface> hook) {
    core_->registerCommHook(std::move(hook));
  }

  void train(bool on = true) { core_->module().train(on); }
  void eval() { train(false); }
  bool isTraining() const { return detail::modulePointer(module_)->is_training(); }

  const DDPOptions& options() const { return core_->options(); }
  // How gradients travel: kNone (the Reducer's allreduce), kAllreduce, kFp16Compress, kSharedMemory,
  // or kCustom (registerCommHook); toString(hook) names it. Asked for kSharedMemory, it is kNone
  // where the ranks do not share memory.
  CommHook commHookInUse() const { return core_->commHookInUse(); }
  // The shared-memory hook's time in the reductions so far (its own thread's with kOverlapped),
  // and how much of it was waiting for the other ranks; empty when it is not in use.
  std::optional<GradientReductionStats> sharedMemoryStats() const { return core_->sharedMemoryStats(); }
  c10::intrusive_ptr<c10d::ProcessGroup> processGroup() const { return core_->processGroup(); }
  // Parameter indices per bucket, in reduction order (changes once, after the first iteration).
  std::vector<std::vector<size_t>> bucketAssignment() const { return core_->bucketAssignment(); }

  // Regroups the buckets now if the Reducer is due to (after its first synchronised backward),
  // instead of at the start of the next forward; returns whether it did. A collective when it
  // rebuilds: every rank must call it at the same point. A trainer that snapshots
  // bucketAssignment() after a step calls this first, so the snapshot holds the layout the next
  // step uses.
  bool rebuildBuckets() { return core_->rebuildBuckets(); }

  // What a checkpoint needs of it (ctorch/stateful.hpp): `training.track(ddp)` saves the model
  // with DDP's bucket layout and lets DDP follow a group re-formed in place.
  operator Stateful&() { return *core_; }

 private:
  // CUDA graphs reach the Reducer through the engine (ctorch/cuda_graph.hpp); nothing else does.
  template <typename M>
  friend std::unique_ptr<GraphParticipant> graphParticipant(DistributedDataParallel<M>& ddp);
  detail::DDPCore& core() { return *core_; }

 private:
  ModuleType module_;
  std::unique_ptr<detail::DDPCore> core_;
};

} // namespace ctorch
