// FullyShardedDataParallel's engine, shared by its sources: the communication thread, a unit's flat
// buffers (their storage freed and refilled in place), and the gather / reshard / backward steps.
#pragma once

#include "ctorch/fully_sharded_data_parallel.hpp"

#include "ctorch/flat_collectives.hpp"

#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

namespace ctorch::detail {

// One thread runs every collective of one FullyShardedDataParallel, in the order they were asked for:
// the same order on every rank, while the compute threads go on (prefetch, reduce-scatter in backward).
class FSDPCommThread {
 public:
  FSDPCommThread() : thread_([this] { run(); }) {}
  ~FSDPCommThread() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  std::shared_future<void> submit(std::function<void()> job) {
    Job item{std::move(job), {}};
    auto done = item.done.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(item));
    }
    wake_.notify_one();
    return done;
  }
  // Runs `job` after everything asked before it and waits for it (rethrowing its failure).
  void run(std::function<void()> job) { submit(std::move(job)).get(); }

 private:
  // A job's function is destroyed as soon as it has run, before its future is ready: the buffers it
  // captured (a unit's whole gradient) go then, not when the last copy of the future does.
  struct Job {
    std::function<void()> fn;
    std::promise<void> done;
  };
  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr failure;
      try {
        job.fn();
      } catch (...) {
        failure = std::current_exception();
      }
      job.fn = nullptr;
      if (failure) job.done.set_exception(failure);
      else job.done.set_value();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::thread thread_;
};

// Fresh memory for a storage on the storage's own device: CUDA's caching allocator allocates on the
// calling thread's current device, and a gather may start on a thread whose current device is another
// (autograd's device threads, the communication thread, a user's thread).
inline void allocateOn(c10::StorageImpl& impl, std::size_t bytes) {
  const c10::DeviceGuard onDevice(impl.device());
  impl.set_data_ptr_noswap(impl.allocator()->allocate(bytes));
  impl.set_nbytes(bytes);
}

// Freed unit buffers kept for the next gather of the same size, at most `capacity` bytes (set to what
// the previous step had gathered at once): the memory a step gathers is reused, not returned to the
// system and faulted in again every step.
class BufferPool {
 public:
  void give(const c10::Storage& storage) {
    auto* impl = storage.unsafeGetStorageImpl();
    const std::size_t bytes = impl->nbytes();
    at::DataPtr ptr = impl->set_data_ptr(at::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
    if (held_ + bytes <= capacity_) {
      held_ += bytes;
      free_.emplace_back(bytes, std::move(ptr));
    }
  }
  void take(const c10::Storage& storage, std::size_t bytes) {
    auto* impl = storage.unsafeGetStorageImpl();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->first == bytes && it->second.device() == impl->device()) {
        impl->set_data_ptr_noswap(std::move(it->second));
        held_ -= bytes;
        free_.erase(it);
        impl->set_nbytes(bytes);
        return;
      }
    allocateOn(*impl, bytes);
  }
  void setCapacity(std::size_t bytes) {
    capacity_ = bytes;
    while (held_ > capacity_ && !free_.empty()) {
      held_ -= free_.back().first;
      free_.pop_back();
    }
  }

 private:
  std::size_t capacity_ = 0, held_ = 0;
  std::vector<std::pair<std::size_t, at::DataPtr>> free_;
};

inline void freeStorage(const c10::Storage& storage) {
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

inline void allocateStorage(const c10::Storage& storage, std::size_t bytes) { allocateOn(*storage.unsafeGetStorageImpl(), bytes); }

// A weak reference to a gradient accumulator, as autograd's set_grad_accumulator takes it.
template <class Pointer>
auto weakOf(const Pointer& accumulator) {
  if constexpr (std::is_same_v<Pointer, std::shared_ptr<torch::autograd::Node>>)
    return std::weak_ptr<torch::autograd::Node>(accumulator);  // LibTorch 1.13
  else
    return c10::weak_intrusive_ptr<torch::autograd::Node>(accumulator);  // later 2.x
}

// The parameters of one unit of one kind (trainable or frozen), flattened: `full` aliases the storage
// every parameter of it now lives in (freed while sharded), `shard` is this rank's slice of it.
// With a MixedPrecisionPolicy `full` (and the parameters aliasing it) is in paramDtype while `shard`
// keeps the parameters' own dtype (the master).
struct FlatParameter {
  std::string name;  // "<unit>.flat" or "<unit>.flat_frozen"
  std::vector<at::Tensor> params;
  std::vector<std::int64_t> offsets;
  std::int64_t numel = 0, shardNumel = 0;
  at::Tensor full, shard;
  c10::Storage storage;
  at::ScalarType reduceDtype = at::kFloat;  // what its gradients are reduce-scattered in
  // Gradient accumulation without sync, when reduceDtype is not the gathered parameters' dtype: each
  // parameter's gradient so far, upcast to reduceDtype (Python's unsharded_accumulated_grad).
  std::vector<at::Tensor> accumulated;
  bool mixed() const { return full.scalar_type() != shard.scalar_type(); }
  std::size_t fullBytes() const { return static_cast<std::size_t>(full.numel() * full.element_size()); }
};

struct FSDPUnit {
  FSDPCore::Impl* core = nullptr;
  std::string name;  // "" for the root
  const torch::nn::Module* module = nullptr;
  std::size_t index = 0;
  std::vector<FlatParameter> flats;  // trainable first, then frozen (either may be absent)
  std::int64_t trainableCount = 0;
  // Per step:
  bool gathered = false;
  std::shared_future<void> pending;  // the gather in flight
  bool enteredThisForward = false;
  std::int64_t gradsReady = 0;
  bool reduced = false;
};

struct FSDPCore::Impl : std::enable_shared_from_this<FSDPCore::Impl> {
  static constexpr std::size_t kReduceScattersInFlight = 2;
  BufferPool pool;
  std::size_t gatheredNow = 0, gatheredPeak = 0;
  std::shared_ptr<torch::nn::Module> root;
  FSDPOptions options;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0, world = 1;
  // Hybrid sharding: the group of the ranks holding the same shard on the other nodes (null: none),
  // this rank's place in it and its size. Gradients are averaged over world * replicas ranks.
  c10::intrusive_ptr<c10d::ProcessGroup> replicate;
  int replicaRank = 0, replicas = 1;
  std::vector<std::unique_ptr<FSDPUnit>> units;  // units[0] is the root
  // The parameters' gradient accumulators, kept alive for their hooks (a shared_ptr in LibTorch 1.13,
  // an intrusive_ptr in later 2.x).
  std::vector<decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()))> accumulators;
  std::recursive_mutex mutex;
  std::unique_ptr<FSDPCommThread> comm;
  std::vector<std::shared_future<void>> inFlight;  // reduce-scatters of this backward
  bool verified = false;       // the first forward showed every unit is reached through unitForward
  bool gradientSync = true;
  bool lastForwardSynchronised = true;
  bool callbackQueued = false;
  std::vector<std::size_t> order, lastOrder;  // units in the order their forward began

  // ---- gathering ----------------------------------------------------------------------------------
  void startGather(FSDPUnit& unit) {
    if (unit.gathered) return;
    unit.gathered = true;
    std::vector<std::pair<at::Tensor, at::Tensor>> jobs;
    for (auto& flat : unit.flats) {
      pool.take(flat.storage, flat.fullBytes());
      gatheredNow += flat.fullBytes();
      gatheredPeak = std::max(gatheredPeak, gatheredNow);
      jobs.emplace_back(flat.shard.detach(), flat.full);
    }
    auto g = group;
    const int w = world;
    unit.pending = comm->submit([g, w, jobs]() mutable {
      for (auto& [shard, full] : jobs) {
        if (w == 1) full.copy_(shard);
        else allGather(g, shard.scalar_type() == full.scalar_type() ? shard : shard.to(full.scalar_type()), full);
      }
    });
  }
  void ensureGathered(FSDPUnit& unit) {
    startGather(unit);
    if (unit.pending.valid()) {
      auto pending = std::move(unit.pending);
      unit.pending = {};
      pending.get();
    }
  }
  void reshard(FSDPUnit& unit) {
    if (!unit.gathered) return;
    if (unit.pending.valid()) {
      auto pending = std::move(unit.pending);
      unit.pending = {};
      pending.get();
    }
    for (auto& flat : unit.flats) {
      gatheredNow -= flat.fullBytes();
      pool.give(flat.storage);
    }
    unit.gathered = false;
  }
  void prefetch(std::size_t unitIndex, int direction) {
    if (!options.prefetch() || !verified) return;
    for (std::size_t i = 0; i < lastOrder.size(); ++i)
      if (lastOrder[i] == unitIndex) {
        const auto next = static_cast<std::ptrdiff_t>(i) + direction;
        if (next >= 0 && next < static_cast<std::ptrdiff_t>(lastOrder.size())) startGather(*units[lastOrder[next]]);
        return;
      }
  }

  // ---- the full-precision master under mixed precision ---------------------------------------------
  // A flat buffer's shards gathered as they are (the master's dtype), into a buffer of its own.
  at::Tensor gatherMaster(const FlatParameter& flat) {
    auto whole = at::empty({flat.shardNumel * world}, flat.shard.options().requires_grad(false));
    auto g = group;
    const int w = world;
    auto shard = flat.shard.detach();
    comm->run([g, w, shard, whole]() mutable {
      if (w == 1) whole.copy_(shard);
      else allGather(g, shard, whole);
    });
    return whole;
  }
  // Points each parameter of `flat` at its place in `base`, a whole flat buffer. A parameter whose
  // dtype changes loses its link to its gradient accumulator (autograd's set_data), so the
  // accumulators holding the gradient hooks are linked back when the parameters return to `full`.
  static void pointParametersAt(FlatParameter& flat, const at::Tensor& base) {
    for (std::size_t i = 0; i < flat.params.size(); ++i)
      flat.params[i].set_data(base.narrow(0, flat.offsets[i], flat.params[i].numel()).view(flat.params[i].sizes()));
  }
  void relinkAccumulators() {
    std::size_t k = 0;
    for (auto& unit : units)
      for (auto& flat : unit->flats)
        for (auto& p : flat.params)
          if (p.requires_grad()) torch::autograd::impl::set_grad_accumulator(p, weakOf(accumulators.at(k++)));
  }

  // ---- backward -----------------------------------------------------------------------------------
  void queueFinalCallback() {
    if (callbackQueued) return;
    callbackQueued = true;
    std::weak_ptr<Impl> weak = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto self = weak.lock()) self->finishBackward();
    });
  }
  void preBackward(FSDPUnit& unit) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    queueFinalCallback();
    ensureGathered(unit);
    if (!options.reshardAfterForward() || !options.prefetch()) return;
    if (unit.index == 0) {  // the backward begins: the last unit of the forward comes first
      if (!lastOrder.empty()) startGather(*units[lastOrder.back()]);
    } else {
      prefetch(unit.index, -1);
    }
  }
  void gradReady(FSDPUnit& unit) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    queueFinalCallback();
    if (++unit.gradsReady == unit.trainableCount) postBackward(unit);
  }
  // The unit's gradients are all accumulated: reduce-scatter them (averaged) into its shards' grads,
  // drop the whole gradients and free the gathered parameters.
  void postBackward(FSDPUnit& unit) {
    if (unit.reduced) return;
    unit.reduced = true;
    if (!gradientSync) {
      for (auto& flat : unit.flats)
        if (flat.shard.requires_grad()) accumulateInReduceDtype(flat);
    } else {
      for (auto& flat : unit.flats) {
        if (!flat.shard.requires_grad()) continue;
        accumulateInReduceDtype(flat);
        auto padded = at::zeros({flat.shardNumel * world}, flat.full.options().dtype(flat.reduceDtype));
        for (std::size_t i = 0; i < flat.params.size(); ++i) {
          auto& grad = flat.params[i].mutable_grad();
          auto& sum = flat.accumulated.empty() ? grad : flat.accumulated[i];
          if (!sum.defined()) continue;
          padded.narrow(0, flat.offsets[i], flat.params[i].numel()).copy_(sum.reshape({-1}));
          grad = at::Tensor();
          sum = at::Tensor();
        }
        auto shard = flat.shard;
        auto g = group;
        auto r = replicate;
        const int w = world, replicaCount = replicas;
        // A backward outruns the communication: without a bound every unit's padded gradient would wait
        // in the queue at once (the whole model's gradients). Two in flight keep the overlap.
        while (inFlight.size() >= kReduceScattersInFlight) {
          auto oldest = std::move(inFlight.front());
          inFlight.erase(inFlight.begin());
          oldest.get();
        }
        inFlight.push_back(comm->submit([g, r, w, replicaCount, padded, shard]() mutable {
          // float16 overflows where float32 and bfloat16 do not: Python divides by about sqrt(ranks)
          // before the sum and by the rest after it; otherwise the sum is divided once, after.
          const auto [before, after] = divideFactors(padded.scalar_type(), w * replicaCount);
          if (before != 1) padded.div_(before);
          at::Tensor mine = at::empty({shard.numel()}, padded.options());
          if (w == 1) mine.copy_(padded);
          else reduceScatter(g, padded, mine);
          // Hybrid: the node's sum of this shard, summed over the nodes (1/N of the gradient crosses
          // them), then averaged over every rank of the world, as DDP averages.
          if (replicaCount > 1) allReduceAcross(r, mine, replicaCount);
          mine.div_(after);
          if (mine.scalar_type() != shard.scalar_type()) mine = mine.to(shard.scalar_type());
          auto& grad = shard.mutable_grad();
          if (grad.defined()) grad.add_(mine);
          else grad = mine;
        }));
      }
    }
    reshard(unit);
  }
  // A unit's gradients computed in a dtype other than the one they are reduced in (bfloat16
  // parameters, float32 reduction) are summed in the reduce dtype across unsynchronised backwards, as
  // Python's FSDP2 does; otherwise they stay in the parameters' grads, where autograd sums them.
  static void accumulateInReduceDtype(FlatParameter& flat) {
    if (flat.reduceDtype == flat.full.scalar_type()) return;
    if (flat.accumulated.empty()) flat.accumulated.resize(flat.params.size());
    torch::NoGradGuard noGrad;
    for (std::size_t i = 0; i < flat.params.size(); ++i) {
      auto& grad = flat.params[i].mutable_grad();
      if (!grad.defined()) continue;
      auto& sum = flat.accumulated[i];
      if (sum.defined()) sum.add_(grad);
      else sum = grad.to(flat.reduceDtype);
      grad = at::Tensor();
    }
  }
  // The sum of `t` over the replicate group. Gloo's allreduce has no bfloat16 ("Invalid scalar type"),
  // so a CPU bfloat16 gradient goes around the flat collectives' ring instead (a reduce-scatter then an
  // all-gather: the same bytes as a ring allreduce, summed in bfloat16, at 2 nodes a + b as any
  // allreduce gives).
  static void allReduceAcross(const c10::intrusive_ptr<c10d::ProcessGroup>& r, at::Tensor& t, int replicaCount) {
    if (t.scalar_type() == at::kBFloat16 && t.is_cpu()) {
      const auto per = shardNumel(t.numel(), replicaCount);
      auto padded = at::zeros({per * replicaCount}, t.options());
      padded.narrow(0, 0, t.numel()).copy_(t);
      auto part = at::empty({per}, t.options());
      reduceScatter(r, padded, part);
      allGather(r, part, padded);
      t.copy_(padded.narrow(0, 0, t.numel()));
      return;
    }
    std::vector<at::Tensor> tensors{t};
    r->allreduce(tensors)->wait();
  }
  // Python's _get_gradient_divide_factors for a SUM reduction: float16 splits the division into a
  // power of two before the sum and the rest after it; any other dtype divides once, after.
  static std::pair<double, double> divideFactors(at::ScalarType dtype, int ranks) {
    if (dtype != at::kHalf) return {1.0, static_cast<double>(ranks)};
    int before = 1;
    while (ranks % before == 0 && ranks / before > before) before *= 2;
    return {static_cast<double>(before), static_cast<double>(ranks) / before};
  }
  void finishBackward() {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    for (auto& unit : units)
      if (unit->trainableCount > 0 && unit->gradsReady > 0) postBackward(*unit);  // some parameter unused
    auto flights = std::move(inFlight);
    inFlight.clear();
    std::exception_ptr failure;
    for (auto& f : flights) {
      try {
        f.get();
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    for (auto& unit : units) {
      try {
        reshard(*unit);
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      unit->gradsReady = 0;
      unit->reduced = false;
    }
    callbackQueued = false;
    pool.setCapacity(gatheredPeak);  // what this step gathered at once, kept for the next one
    gatheredPeak = 0;
    if (failure) std::rethrow_exception(failure);
  }
  // Every rank of the world takes rank 0's values: across the nodes first (the ranks with this
  // rank's shard index), then within the node from its first rank, which now holds rank 0's.
  static void broadcastFromWorldRankZero(const c10::intrusive_ptr<c10d::ProcessGroup>& shardGroup,
                                         const c10::intrusive_ptr<c10d::ProcessGroup>& replicateGroup,
                                         const std::vector<at::Tensor>& tensors) {
    for (const auto& g : {replicateGroup, shardGroup}) {
      if (!g || g->getSize() == 1) continue;
      for (const auto& t : tensors) {
        std::vector<at::Tensor> one{t};
        g->broadcast(one)->wait();
      }
    }
  }
  void addPreBackwardHooks(FSDPUnit& unit, const std::vector<at::Tensor>& outputs) {
    std::weak_ptr<Impl> weak = shared_from_this();
    FSDPUnit* u = &unit;
    for (const auto& out : outputs)
      if (out.defined() && out.requires_grad()) {
        auto t = out;
        t.register_hook([weak, u](const at::Tensor&) {
          if (auto self = weak.lock()) self->preBackward(*u);
        });
      }
  }
};

} // namespace ctorch::detail
