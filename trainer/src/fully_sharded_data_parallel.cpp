// FullyShardedDataParallel's engine: units and their flat shards, the gathered buffers whose storage is
// freed and refilled in place, the communication thread, and the autograd hooks around each unit.
#include "ctorch/fully_sharded_data_parallel.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/flat_collectives.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <cmath>
#include <condition_variable>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace ctorch {

WrapPolicy sizeBasedWrapPolicy(std::int64_t minParameters) {
  if (minParameters < 1)
    throw ConfigError("sizeBasedWrapPolicy: minParameters must be at least 1, got " + std::to_string(minParameters));
  return [minParameters](const std::string&, const torch::nn::Module& module) {
    std::int64_t n = 0;
    for (const auto& p : module.parameters()) n += p.numel();
    return n >= minParameters;
  };
}

namespace detail {

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
    std::packaged_task<void()> task(std::move(job));
    auto done = task.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(task));
    }
    wake_.notify_one();
    return done;
  }
  // Runs `job` after everything asked before it and waits for it (rethrowing its failure).
  void run(std::function<void()> job) { submit(std::move(job)).get(); }

 private:
  void run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::packaged_task<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

namespace {

void freeStorage(const c10::Storage& storage) {
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

void allocateStorage(const c10::Storage& storage, std::size_t bytes) {
  auto* impl = storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

std::vector<std::int64_t> contiguousStrides(at::IntArrayRef sizes) {
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<std::int64_t>(sizes[i], 1);
  return strides;
}

} // namespace

// The parameters of one unit of one kind (trainable or frozen), flattened: `full` aliases the storage
// every parameter of it now lives in (freed while sharded), `shard` is this rank's slice of it.
struct FlatParameter {
  std::string name;  // "<unit>.flat" or "<unit>.flat_frozen"
  std::vector<at::Tensor> params;
  std::vector<std::int64_t> offsets;
  std::int64_t numel = 0, shardNumel = 0;
  at::Tensor full, shard;
  c10::Storage storage;
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
  std::shared_ptr<torch::nn::Module> root;
  FSDPOptions options;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0, world = 1;
  std::vector<std::unique_ptr<FSDPUnit>> units;  // units[0] is the root
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
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
      allocateStorage(flat.storage, flat.fullBytes());
      jobs.emplace_back(flat.shard.detach(), flat.full);
    }
    auto g = group;
    const int w = world;
    unit.pending = comm->submit([g, w, jobs]() mutable {
      for (auto& [shard, full] : jobs) {
        if (w == 1) full.copy_(shard);
        else allGather(g, shard, full);
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
    for (auto& flat : unit.flats) freeStorage(flat.storage);
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
    if (gradientSync) {
      for (auto& flat : unit.flats) {
        if (!flat.shard.requires_grad()) continue;
        auto padded = at::zeros({flat.shardNumel * world}, flat.full.options());
        for (std::size_t i = 0; i < flat.params.size(); ++i) {
          auto& grad = flat.params[i].mutable_grad();
          if (!grad.defined()) continue;
          padded.narrow(0, flat.offsets[i], flat.params[i].numel()).copy_(grad.reshape({-1}));
          grad = at::Tensor();
        }
        auto shard = flat.shard;
        auto g = group;
        const int w = world;
        inFlight.push_back(comm->submit([g, w, padded, shard]() mutable {
          at::Tensor mine = at::empty({shard.numel()}, padded.options());
          if (w == 1) mine.copy_(padded);
          else reduceScatter(g, padded, mine);
          mine.div_(w);
          auto& grad = shard.mutable_grad();
          if (grad.defined()) grad.add_(mine);
          else grad = mine;
        }));
      }
    }
    reshard(unit);
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
    if (failure) std::rethrow_exception(failure);
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

namespace {

std::mutex registryMutex;
std::unordered_map<const torch::nn::Module*, FSDPUnit*>& registry() {
  static std::unordered_map<const torch::nn::Module*, FSDPUnit*> units;
  return units;
}

FlatParameter makeFlat(const std::string& name, std::vector<at::Tensor> params, bool trainable, int rank, int world,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& group, bool syncFromRank0) {
  FlatParameter flat;
  flat.name = name;
  const auto options = params.front().options();
  for (const auto& p : params) {
    if (p.scalar_type() != options.dtype().toScalarType() || p.device() != options.device())
      throw ConfigError("FullyShardedDataParallel: the parameters of unit '" + name +
                        "' must share one dtype and device (found " + std::string(c10::toString(params.front().scalar_type())) +
                        " on " + params.front().device().str() + " and " + c10::toString(p.scalar_type()) + " on " +
                        p.device().str() + ")");
    flat.offsets.push_back(flat.numel);
    flat.numel += p.numel();
  }
  flat.shardNumel = shardNumel(flat.numel, world);
  torch::NoGradGuard noGrad;
  flat.full = at::zeros({flat.shardNumel * world}, options.requires_grad(false));
  for (std::size_t i = 0; i < params.size(); ++i)
    flat.full.narrow(0, flat.offsets[i], params[i].numel()).copy_(params[i].detach().reshape({-1}));
  if (syncFromRank0 && world > 1) {
    std::vector<at::Tensor> tensors{flat.full};
    group->broadcast(tensors)->wait();
  }
  flat.shard = flat.full.narrow(0, rank * flat.shardNumel, flat.shardNumel).clone();
  if (trainable) flat.shard.requires_grad_(true);
  flat.storage = flat.full.storage();
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto alias = at::empty({0}, flat.full.options());
    alias.set_(flat.storage, flat.offsets[i], params[i].sizes(), contiguousStrides(params[i].sizes()));
    params[i].set_data(alias);
  }
  flat.params = std::move(params);
  freeStorage(flat.storage);
  return flat;
}

} // namespace

FSDPUnit* unitOf(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(registryMutex);
  const auto it = registry().find(module);
  return it == registry().end() ? nullptr : it->second;
}

void beginUnitForward(FSDPUnit& unit) {
  auto& core = *unit.core;
  std::lock_guard<std::recursive_mutex> lock(core.mutex);
  if (!unit.enteredThisForward) {
    unit.enteredThisForward = true;
    core.order.push_back(unit.index);
  }
  core.ensureGathered(unit);
  core.prefetch(unit.index, +1);
}

void endUnitForward(FSDPUnit& unit, const std::vector<at::Tensor>& outputs) {
  auto& core = *unit.core;
  std::lock_guard<std::recursive_mutex> lock(core.mutex);
  const bool grad = at::GradMode::is_enabled();
  if (grad) core.addPreBackwardHooks(unit, outputs);
  if (core.verified && (core.options.reshardAfterForward() || !grad)) core.reshard(unit);
}

FSDPCore::FSDPCore(std::shared_ptr<torch::nn::Module> root, FSDPOptions options)
    : impl_(std::make_shared<Impl>()) {
  auto& s = *impl_;
  s.root = std::move(root);
  s.options = std::move(options);
  s.group = s.options.processGroup() ? s.options.processGroup() : getDefaultGroup();
  s.rank = s.group->getRank();
  s.world = s.group->getSize();
  // Units: the root, then each submodule the policy picks (outermost first); a module's own
  // parameters belong to its nearest enclosing unit, and one held by two units (tied weights) to
  // the root, which stays gathered for the whole step.
  std::map<std::string, std::size_t> unitByName{{"", 0}};
  std::vector<std::string> names{""};
  std::vector<const torch::nn::Module*> modules{s.root.get()};
  const auto named = s.root->named_modules("", /*include_self=*/false);
  for (const auto& item : named)
    if (s.options.autoWrapPolicy() && s.options.autoWrapPolicy()(item.key(), *item.value())) {
      unitByName[item.key()] = names.size();
      names.push_back(item.key());
      modules.push_back(item.value().get());
    }
  auto ownerOf = [&](const std::string& moduleName) {
    for (std::string prefix = moduleName;;) {
      if (const auto it = unitByName.find(prefix); it != unitByName.end()) return it->second;
      const auto dot = prefix.rfind('.');
      prefix = dot == std::string::npos ? "" : prefix.substr(0, dot);
    }
  };
  std::unordered_map<c10::TensorImpl*, std::size_t> owner;
  std::vector<at::Tensor> ordered;
  auto assign = [&](const std::string& moduleName, const torch::nn::Module& module) {
    for (const auto& p : module.named_parameters(/*recurse=*/false)) {
      const auto unit = ownerOf(moduleName);
      auto [it, fresh] = owner.emplace(p.value().unsafeGetTensorImpl(), unit);
      if (fresh) ordered.push_back(p.value());
      else if (it->second != unit) it->second = 0;
    }
  };
  assign("", *s.root);
  for (const auto& item : named) assign(item.key(), *item.value());
  if (s.options.syncModuleStates() && s.world > 1) {
    torch::NoGradGuard noGrad;
    for (auto& b : s.root->buffers()) {
      std::vector<at::Tensor> tensors{b};
      s.group->broadcast(tensors)->wait();
    }
  }
  for (std::size_t u = 0; u < names.size(); ++u) {
    std::vector<at::Tensor> trainable, frozen;
    for (const auto& p : ordered)
      if (owner.at(p.unsafeGetTensorImpl()) == u) (p.requires_grad() ? trainable : frozen).push_back(p);
    if (u != 0 && trainable.empty() && frozen.empty()) continue;  // a unit with nothing of its own
    auto unit = std::make_unique<FSDPUnit>();
    unit->core = impl_.get();
    unit->name = names[u];
    unit->module = modules[u];
    unit->index = s.units.size();
    const std::string prefix = names[u].empty() ? "" : names[u] + ".";
    if (!trainable.empty())
      unit->flats.push_back(makeFlat(prefix + "flat", trainable, true, s.rank, s.world, s.group, s.options.syncModuleStates()));
    if (!frozen.empty())
      unit->flats.push_back(makeFlat(prefix + "flat_frozen", frozen, false, s.rank, s.world, s.group, s.options.syncModuleStates()));
    unit->trainableCount = static_cast<std::int64_t>(trainable.size());
    s.units.push_back(std::move(unit));
  }
  // Each trainable parameter tells its unit when its gradient is accumulated.
  std::weak_ptr<Impl> weak = impl_;
  for (auto& unit : s.units)
    for (auto& flat : unit->flats)
      for (auto& p : flat.params) {
        if (!p.requires_grad()) continue;
        auto accumulator = torch::autograd::impl::grad_accumulator(p);
        FSDPUnit* u = unit.get();
        accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [weak, u](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
              if (auto self = weak.lock()) self->gradReady(*u);
              return outputs;
            }));
        s.accumulators.push_back(std::move(accumulator));
      }
  s.comm = std::make_unique<FSDPCommThread>();
  std::lock_guard<std::mutex> lock(registryMutex);
  for (std::size_t i = 1; i < s.units.size(); ++i) {
    auto [it, fresh] = registry().emplace(s.units[i]->module, s.units[i].get());
    if (!fresh)
      throw ConfigError("FullyShardedDataParallel: module '" + s.units[i]->name +
                        "' is already a unit of another FullyShardedDataParallel");
  }
}

FSDPCore::~FSDPCore() {
  {
    std::lock_guard<std::mutex> lock(registryMutex);
    for (const auto& unit : impl_->units)
      if (const auto it = registry().find(unit->module); it != registry().end() && it->second == unit.get())
        registry().erase(it);
  }
  impl_->comm.reset();  // finishes what is queued
}

void FSDPCore::beginRootForward() {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  if (s.callbackQueued || !s.inFlight.empty())
    throw ConfigError("FullyShardedDataParallel: a forward began while the previous backward is still running");
  // DDP's rule, kept so that the two stay bit-identical: buffers are broadcast before a forward unless
  // the previous one was not synchronised (gradient accumulation).
  const bool syncBuffers = s.lastForwardSynchronised;
  s.lastForwardSynchronised = s.gradientSync && at::GradMode::is_enabled();
  if (syncBuffers && s.options.broadcastBuffers() && s.world > 1) {
    auto buffers = s.root->buffers();
    if (!buffers.empty()) {
      auto g = s.group;
      s.comm->run([g, buffers]() mutable {
        torch::NoGradGuard noGrad;
        for (auto& b : buffers) {
          std::vector<at::Tensor> tensors{b};
          g->broadcast(tensors)->wait();
        }
      });
    }
  }
  s.order.clear();
  for (auto& unit : s.units) unit->enteredThisForward = false;
  if (!s.verified)
    for (auto& unit : s.units) s.startGather(*unit);
  s.units[0]->enteredThisForward = true;
  s.ensureGathered(*s.units[0]);
  if (!s.verified)
    for (auto& unit : s.units) s.ensureGathered(*unit);
}

void FSDPCore::endRootForward(const std::vector<at::Tensor>& outputs) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  if (!s.verified) {
    std::vector<std::string> missed;
    for (const auto& unit : s.units)
      if (!unit->enteredThisForward) missed.push_back("'" + unit->name + "'");
    if (!missed.empty()) {
      std::string list;
      for (const auto& m : missed) list += (list.empty() ? "" : ", ") + m;
      throw ConfigError("FullyShardedDataParallel: unit " + list +
                        " was not called through ctorch::unitForward in the forward; call it that way in its "
                        "parent's forward, or leave it out of the wrap policy");
    }
    s.verified = true;
  }
  s.lastOrder = s.order;
  bool backward = false;
  for (const auto& out : outputs) backward = backward || (out.defined() && out.requires_grad());
  if (!backward || !at::GradMode::is_enabled()) {
    for (auto& unit : s.units) s.reshard(*unit);
    return;
  }
  if (s.options.reshardAfterForward())
    for (std::size_t i = 1; i < s.units.size(); ++i) s.reshard(*s.units[i]);
  s.addPreBackwardHooks(*s.units[0], outputs);
}

std::vector<at::Tensor> FSDPCore::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& unit : impl_->units)
    for (const auto& flat : unit->flats) out.push_back(flat.shard);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> FSDPCore::namedParameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& unit : impl_->units)
    for (const auto& flat : unit->flats) out.emplace_back(flat.name, flat.shard);
  return out;
}

void FSDPCore::zeroGrad(bool setToNone) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  for (auto& unit : impl_->units)
    for (auto& flat : unit->flats) {
      auto& grad = flat.shard.mutable_grad();
      if (grad.defined()) {
        if (setToNone) grad = at::Tensor();
        else grad.zero_();
      }
      for (auto& p : flat.params) p.mutable_grad() = at::Tensor();
    }
}

double FSDPCore::clipGradNorm(double maxNorm) {
  auto& s = *impl_;
  if (!(maxNorm > 0)) throw ConfigError("clipGradNorm: the maximum norm must be positive, got " + std::to_string(maxNorm));
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  auto squares = at::zeros({1}, at::kDouble);
  std::vector<at::Tensor> grads;
  for (auto& unit : s.units)
    for (auto& flat : unit->flats)
      if (flat.shard.grad().defined()) {
        grads.push_back(flat.shard.grad());
        squares += flat.shard.grad().to(at::kDouble).pow(2).sum().cpu();
      }
  if (s.world > 1) {
    auto g = s.group;
    s.comm->run([g, squares]() mutable {
      std::vector<at::Tensor> tensors{squares};
      g->allreduce(tensors)->wait();
    });
  }
  const double total = std::sqrt(squares.item<double>());
  const double coefficient = maxNorm / (total + 1e-6);
  if (coefficient < 1)
    for (auto& grad : grads) grad.mul_(coefficient);
  return total;
}

void FSDPCore::setRequiresGradientSync(bool on) {
  std::lock_guard<std::recursive_mutex> lock(impl_->mutex);
  impl_->gradientSync = on;
}

torch::OrderedDict<std::string, at::Tensor> FSDPCore::fullStateDict() {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  std::unordered_map<c10::TensorImpl*, at::Tensor> values;
  for (auto& unit : s.units) {
    const bool was = unit->gathered;
    s.ensureGathered(*unit);
    for (auto& flat : unit->flats)
      for (auto& p : flat.params) values[p.unsafeGetTensorImpl()] = p.detach().clone();
    if (!was) s.reshard(*unit);
  }
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& p : s.root->named_parameters()) state.insert(p.key(), values.at(p.value().unsafeGetTensorImpl()));
  for (const auto& b : s.root->named_buffers()) state.insert(b.key(), b.value().detach().clone());
  return state;
}

void FSDPCore::loadFullStateDict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  std::unordered_map<c10::TensorImpl*, at::Tensor> byImpl;
  for (const auto& p : s.root->named_parameters()) {
    const auto* value = state.find(p.key());
    if (value == nullptr) throw ConfigError("loadFullStateDict: the state dict has no parameter '" + p.key() + "'");
    if (!value->sizes().equals(p.value().sizes()))
      throw ConfigError("loadFullStateDict: parameter '" + p.key() + "' has shape " + c10::str(value->sizes()) +
                        ", the model's is " + c10::str(p.value().sizes()));
    byImpl[p.value().unsafeGetTensorImpl()] = *value;
  }
  for (auto& b : s.root->named_buffers()) {
    const auto* value = state.find(b.key());
    if (value == nullptr) throw ConfigError("loadFullStateDict: the state dict has no buffer '" + b.key() + "'");
    b.value().copy_(*value);
  }
  for (auto& unit : s.units)
    for (auto& flat : unit->flats) {
      auto whole = at::zeros({flat.shardNumel * s.world}, flat.shard.options().requires_grad(false));
      for (std::size_t i = 0; i < flat.params.size(); ++i)
        whole.narrow(0, flat.offsets[i], flat.params[i].numel()).copy_(byImpl.at(flat.params[i].unsafeGetTensorImpl()).reshape({-1}));
      flat.shard.copy_(whole.narrow(0, s.rank * flat.shardNumel, flat.shardNumel));
      if (unit->gathered) flat.full.copy_(whole);
    }
}

ItemDict FSDPCore::shardStateDict() const {
  const auto& s = *impl_;
  ItemDict out = newItemDict();
  c10::impl::GenericDict flats(c10::StringType::get(), c10::AnyType::get());
  for (const auto& unit : s.units)
    for (const auto& flat : unit->flats) {
      const std::int64_t begin = std::min<std::int64_t>(s.rank * flat.shardNumel, flat.numel);
      const std::int64_t end = std::min<std::int64_t>(begin + flat.shardNumel, flat.numel);
      c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
      entry.insert("numel", flat.numel);
      entry.insert("begin", begin);
      entry.insert("data", flat.shard.detach().narrow(0, 0, end - begin).clone());
      flats.insert(flat.name, entry);
    }
  out.insert("flat_parameters", flats);
  c10::impl::GenericDict buffers(c10::StringType::get(), c10::AnyType::get());
  for (const auto& b : s.root->named_buffers()) buffers.insert(b.key(), b.value().detach().clone());
  out.insert("buffers", buffers);
  out.insert("world_size", static_cast<std::int64_t>(s.world));
  out.insert("rank", static_cast<std::int64_t>(s.rank));
  return out;
}

void FSDPCore::loadShardStateDicts(const std::vector<ItemDict>& shards) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  if (shards.empty()) throw ConfigError("loadShardStateDicts: no shards given");
  for (auto& unit : s.units)
    for (auto& flat : unit->flats) {
      const std::int64_t begin = std::min<std::int64_t>(s.rank * flat.shardNumel, flat.numel);
      const std::int64_t end = std::min<std::int64_t>(begin + flat.shardNumel, flat.numel);
      auto mine = at::zeros({flat.shardNumel}, flat.shard.options().requires_grad(false));
      std::int64_t covered = 0;
      for (const auto& shard : shards) {
        if (!shard.contains("flat_parameters")) throw ConfigError("loadShardStateDicts: a shard holds no flat_parameters");
        const auto entries = shard.at("flat_parameters").toGenericDict();
        if (!entries.contains(flat.name))
          throw ConfigError("loadShardStateDicts: the shards do not hold '" + flat.name + "' (another model or wrap policy?)");
        const auto entry = entries.at(flat.name).toGenericDict();
        if (entry.at("numel").toInt() != flat.numel)
          throw ConfigError("loadShardStateDicts: '" + flat.name + "' holds " + std::to_string(entry.at("numel").toInt()) +
                            " elements in the shards, " + std::to_string(flat.numel) + " in the model");
        const auto data = entry.at("data").toTensor();
        const std::int64_t from = std::max(begin, entry.at("begin").toInt());
        const std::int64_t to = std::min(end, entry.at("begin").toInt() + data.numel());
        if (from >= to) continue;
        mine.narrow(0, from - begin, to - from).copy_(data.narrow(0, from - entry.at("begin").toInt(), to - from));
        covered += to - from;
      }
      if (covered < end - begin)
        throw ConfigError("loadShardStateDicts: the shards do not cover rank " + std::to_string(s.rank) + "'s part of '" +
                          flat.name + "' (elements " + std::to_string(begin) + " to " + std::to_string(end) + ")");
      flat.shard.copy_(mine);
    }
  // Buffers are replicated; rank 0's are the ones the next forward broadcasts.
  const ItemDict* first = &shards.front();
  for (const auto& shard : shards)
    if (shard.contains("rank") && shard.at("rank").toInt() == 0) first = &shard;
  const auto buffers = first->at("buffers").toGenericDict();
  for (auto& b : s.root->named_buffers()) {
    if (!buffers.contains(b.key())) throw ConfigError("loadShardStateDicts: the shards hold no buffer '" + b.key() + "'");
    b.value().copy_(buffers.at(b.key()).toTensor());
  }
}

std::vector<std::string> FSDPCore::unitNames() const {
  std::vector<std::string> out;
  for (const auto& unit : impl_->units) out.push_back(unit->name);
  return out;
}

std::size_t FSDPCore::localParameterBytes() const {
  std::size_t n = 0;
  for (const auto& unit : impl_->units)
    for (const auto& flat : unit->flats) n += flat.shard.nbytes();
  return n;
}

std::size_t FSDPCore::localGradientBytes() const {
  std::size_t n = 0;
  for (const auto& unit : impl_->units)
    for (const auto& flat : unit->flats) {
      if (flat.shard.grad().defined()) n += flat.shard.grad().nbytes();
      for (const auto& p : flat.params)
        if (p.grad().defined()) n += p.grad().nbytes();
    }
  return n;
}

std::size_t FSDPCore::largestUnitBytes() const {
  std::size_t most = 0;
  for (const auto& unit : impl_->units) {
    std::size_t n = 0;
    for (const auto& flat : unit->flats) n += flat.fullBytes();
    most = std::max(most, n);
  }
  return most;
}

const FSDPOptions& FSDPCore::options() const { return impl_->options; }
c10::intrusive_ptr<c10d::ProcessGroup> FSDPCore::processGroup() const { return impl_->group; }
torch::nn::Module& FSDPCore::module() { return *impl_->root; }

} // namespace detail
} // namespace ctorch
