// FullyShardedDataParallel's lifecycle: units chosen by the wrap policy and flattened into shards, the
// hooks that tie them to autograd, the root and unit forwards, gradient clipping across the shards.
#include "fsdp/engine.hpp"

#include "ctorch/distributed.hpp"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <cmath>
#include <map>
#include <mutex>
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
namespace {

std::vector<std::int64_t> contiguousStrides(at::IntArrayRef sizes) {
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * std::max<std::int64_t>(sizes[i], 1);
  return strides;
}

std::mutex registryMutex;
std::unordered_map<const torch::nn::Module*, FSDPUnit*>& registry() {
  static std::unordered_map<const torch::nn::Module*, FSDPUnit*> units;
  return units;
}

// A floating-point tensor in `dtype` (unset: as it is); anything else as it is (Python's _cast_fp_tensor).
at::Tensor castFloating(const at::Tensor& t, const std::optional<at::ScalarType>& dtype) {
  if (!dtype || !t.defined() || !t.is_floating_point() || t.scalar_type() == *dtype) return t;
  return t.to(*dtype);
}

FlatParameter makeFlat(const std::string& name, std::vector<at::Tensor> params, bool trainable, int rank, int world,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& replicate, bool syncFromRank0,
                       const MixedPrecisionPolicy& precision) {
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
  if (syncFromRank0) FSDPCore::Impl::broadcastFromWorldRankZero(group, replicate, {flat.full});
  flat.shard = flat.full.narrow(0, rank * flat.shardNumel, flat.shardNumel).clone();
  if (trainable) flat.shard.requires_grad_(true);
  // Mixed precision: the gathered buffer (and the parameters viewing it) in paramDtype; the shard
  // above keeps the master's dtype.
  const auto gathered = flat.shard.is_floating_point() ? precision.paramDtype().value_or(flat.shard.scalar_type())
                                                       : flat.shard.scalar_type();
  if (gathered != flat.full.scalar_type()) flat.full = at::empty({flat.shardNumel * world}, flat.full.options().dtype(gathered));
  flat.reduceDtype = flat.shard.is_floating_point() ? precision.reduceDtype().value_or(gathered) : gathered;
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

at::Tensor castUnitInput(const FSDPUnit& unit, const at::Tensor& input) {
  const auto& precision = unit.core->options.mixedPrecision();
  return precision.castForwardInputs() ? castFloating(input, precision.paramDtype()) : input;
}

at::Tensor castUnitOutput(const FSDPUnit& unit, const at::Tensor& output) {
  return castFloating(output, unit.core->options.mixedPrecision().outputDtype());
}

FSDPCore::FSDPCore(std::shared_ptr<torch::nn::Module> root, FSDPOptions options)
    : impl_(std::make_shared<Impl>()) {
  auto& s = *impl_;
  s.root = std::move(root);
  s.options = std::move(options);
  s.group = s.options.processGroup() ? s.options.processGroup() : getDefaultGroup();
  s.rank = s.group->getRank();
  s.world = s.group->getSize();
  const auto& precision = s.options.mixedPrecision();
  for (const auto& [what, dtype] : {std::pair{"paramDtype", precision.paramDtype()}, std::pair{"reduceDtype", precision.reduceDtype()},
                                    std::pair{"outputDtype", precision.outputDtype()}})
    if (dtype && !c10::isFloatingType(*dtype))
      throw ConfigError(std::string("FullyShardedDataParallel: MixedPrecisionPolicy::") + what + " must be a floating-point dtype, got " +
                        c10::toString(*dtype));
  if (s.options.replicateGroup()) {
    if (!s.options.processGroup())
      throw ConfigError("FullyShardedDataParallel: FSDPOptions::replicateGroup needs processGroup (the shard group) "
                        "too, the default group being the whole world: take both from ctorch::hybridShardGroups()");
    s.replicate = s.options.replicateGroup();
    s.replicaRank = s.replicate->getRank();
    s.replicas = s.replicate->getSize();
  }
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
  // A replacement joining a running group in place (ResilienceOptions::shardCopies) runs no
  // collective here: the survivors are not constructing; its shards come with the recovery.
  const bool sync = s.options.syncModuleStates() && !joiningInPlace();
  if (sync) {
    torch::NoGradGuard noGrad;
    Impl::broadcastFromWorldRankZero(s.group, s.replicate, s.root->buffers());
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
      unit->flats.push_back(makeFlat(prefix + "flat", trainable, true, s.rank, s.world, s.group, s.replicate, sync, s.options.mixedPrecision()));
    if (!frozen.empty())
      unit->flats.push_back(makeFlat(prefix + "flat_frozen", frozen, false, s.rank, s.world, s.group, s.replicate, sync,
                                        s.options.mixedPrecision()));
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
  if (!s.group) throw DistributedError("FullyShardedDataParallel: no process group (in-place recovery under way)");
  if (s.callbackQueued || !s.inFlight.empty())
    throw ConfigError("FullyShardedDataParallel: a forward began while the previous backward is still running");
  // DDP's rule, kept so that the two stay bit-identical: buffers are broadcast before a forward unless
  // the previous one was not synchronised (gradient accumulation).
  const bool syncBuffers = s.lastForwardSynchronised;
  s.lastForwardSynchronised = s.gradientSync && at::GradMode::is_enabled();
  if (syncBuffers && s.options.broadcastBuffers() && s.world * s.replicas > 1) {
    auto buffers = s.root->buffers();
    if (!buffers.empty()) {
      auto g = s.group, r = s.replicate;
      s.comm->run([g, r, buffers]() mutable {
        torch::NoGradGuard noGrad;
        Impl::broadcastFromWorldRankZero(g, r, buffers);
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
      flat.accumulated.clear();
    }
}

double FSDPCore::clipGradNorm(double maxNorm) {
  auto& s = *impl_;
  if (!(maxNorm > 0)) throw ConfigError("clipGradNorm: the maximum norm must be positive, got " + std::to_string(maxNorm));
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  // Summed on the shards' device: the allreduce then goes to the backend of that device (NCCL for
  // CUDA tensors, which may be the group's only backend).
  at::Device device(at::kCPU);
  for (const auto& unit : s.units)
    if (!unit->flats.empty()) {
      device = unit->flats.front().shard.device();
      break;
    }
  auto squares = at::zeros({1}, at::TensorOptions(at::kDouble).device(device));
  std::vector<at::Tensor> grads;
  for (auto& unit : s.units)
    for (auto& flat : unit->flats)
      if (flat.shard.grad().defined()) {
        grads.push_back(flat.shard.grad());
        squares += flat.shard.grad().to(at::kDouble).pow(2).sum().to(squares.device());
      }
  // Over the shard group only: with hybrid sharding every node holds the same shards, so the nodes'
  // sums are equal and adding them would count each gradient once per node.
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
      for (const auto& sum : flat.accumulated)
        if (sum.defined()) n += sum.nbytes();
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

at::Tensor FSDPCore::castForwardInput(const at::Tensor& input) const { return castUnitInput(*impl_->units[0], input); }
at::Tensor FSDPCore::castOutput(const at::Tensor& output) const { return castUnitOutput(*impl_->units[0], output); }

const FSDPOptions& FSDPCore::options() const { return impl_->options; }
c10::intrusive_ptr<c10d::ProcessGroup> FSDPCore::processGroup() const { return impl_->group; }
torch::nn::Module& FSDPCore::module() { return *impl_->root; }

} // namespace detail
} // namespace ctorch

namespace ctorch::detail {

bool FSDPCore::followsDefaultGroup() const {
  return !impl_->options.processGroup() && !impl_->options.replicateGroup();
}

void FSDPCore::releaseGroup() {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  s.group.reset();
  // What the communication thread still runs fails with the group (its peers' sockets closed) or
  // completes: either way it is over before the units' buffers are touched.
  const auto drain = [](std::shared_future<void>& f) {
    if (!f.valid()) return;
    try {
      f.get();
    } catch (...) {
    }
    f = {};
  };
  for (auto& f : s.inFlight) drain(f);
  s.inFlight.clear();
  torch::NoGradGuard noGrad;
  for (auto& unit : s.units) {
    drain(unit->pending);
    if (unit->gathered) {
      for (auto& flat : unit->flats) {
        s.gatheredNow -= flat.fullBytes();
        s.pool.give(flat.storage);
      }
      unit->gathered = false;
    }
    unit->gradsReady = 0;
    unit->reduced = false;
    unit->enteredThisForward = false;
    // The failed step's gradients: whole ones not yet reduce-scattered, and what reached the shards.
    for (auto& flat : unit->flats) {
      for (auto& p : flat.params) p.mutable_grad() = at::Tensor();
      for (auto& sum : flat.accumulated) sum = at::Tensor();  // mixed precision's accumulation in the reduce dtype
      if (flat.shard.requires_grad()) flat.shard.mutable_grad() = at::Tensor();
    }
  }
  s.callbackQueued = false;
}

void FSDPCore::rejoin(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  if (!followsDefaultGroup())
    throw ConfigError("FullyShardedDataParallel::rejoin: its process groups are its own (hybrid sharding or "
                      "FSDPOptions::processGroup): they are not re-formed");
  if (!group || group->getRank() != s.rank || group->getSize() != s.world)
    throw ConfigError("FullyShardedDataParallel::rejoin: the group is not the one its shards were cut for (rank " +
                      std::to_string(s.rank) + " of " + std::to_string(s.world) + ")");
  s.group = std::move(group);
}

} // namespace ctorch::detail
