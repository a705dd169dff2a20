// Taking training state out of live objects (model, RNGs, sampler) and putting it back, and whole
// snapshots of them; an optimizer's state in Python's layout is optimizer_state.cpp.
#include "ctorch/snapshot.hpp"
#include "snapshot/generic_dict.hpp"

#include "core/compat.hpp"
#include "snapshot/digest.hpp"
#include "ctorch/version.hpp"

#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim.h>
#include <torch/version.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include "snapshot/capture_pool.hpp"
#include "snapshot/optimizer_state.hpp"

#include <functional>
#include <mutex>
#include <set>

namespace ctorch {

namespace detail {
namespace {
thread_local CapturePool* tlsPool = nullptr;
thread_local std::size_t tlsNext = 0;
} // namespace

CapturePoolScope::CapturePoolScope(CapturePool* pool) : previous_(tlsPool), previousNext_(tlsNext) {
  tlsPool = pool;
  tlsNext = 0;
}

CapturePoolScope::~CapturePoolScope() {
  tlsPool = previous_;
  tlsNext = previousNext_;
}
} // namespace detail

namespace detail {

namespace {
at::Tensor freshCopy(const at::Tensor& t) { return t.detach().to(at::kCPU).clone(at::MemoryFormat::Contiguous); }
} // namespace

at::Tensor portableCopy(const at::Tensor& t) {
  detail::CapturePool* pool = detail::tlsPool;
  if (!pool || !t.defined()) return freshCopy(t);
  const std::size_t i = detail::tlsNext++;
  if (i >= pool->tensors.size()) pool->tensors.resize(i + 1);
  at::Tensor& kept = pool->tensors[i];
  // Reusable only when nobody else holds it: the snapshot that used it was written and dropped.
  if (kept.defined() && kept.use_count() == 1 && kept.storage().use_count() == 1 &&
      kept.sizes() == t.sizes() && kept.scalar_type() == t.scalar_type()) {
    at::NoGradGuard noGrad;
    kept.copy_(t.detach());
    return kept;
  }
  kept = freshCopy(t);
  return kept;
}

std::string shapeText(at::IntArrayRef sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

} // namespace detail

namespace {

using detail::GroupPlan;
using detail::applyOptimizerRestore;
using detail::planOptimizerRestore;
using detail::portableCopy;
using detail::shapeText;

// Parameters and buffers in Python's state_dict order: each module's own parameters, then its
// own buffers, modules in pre-order (named_modules order).
std::vector<std::pair<std::string, at::Tensor>> namedState(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false))
      if (p.value().defined()) out.emplace_back(prefix + p.key(), p.value());
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false))
      if (b.value().defined()) out.emplace_back(prefix + b.key(), b.value());
  }
  return out;
}

std::vector<std::string> modelDifferences(const torch::nn::Module& model,
                                          const c10::Dict<std::string, at::Tensor>& state) {
  std::vector<std::string> diffs, missing, unexpected;
  const auto mine = namedState(model);
  std::set<std::string> names;
  for (const auto& [name, t] : mine) {
    names.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      missing.push_back(name);
      continue;
    }
    const at::Tensor& src = it->value();
    if (src.sizes() != t.sizes())
      diffs.push_back("parameter '" + name + "' has shape " + shapeText(src.sizes()) +
                      " in the snapshot, " + shapeText(t.sizes()) + " in the model");
    else if (src.scalar_type() != t.scalar_type())
      diffs.push_back("parameter '" + name + "' has dtype " + c10::toString(src.scalar_type()) +
                      " in the snapshot, " + c10::toString(t.scalar_type()) + " in the model");
  }
  for (const auto& e : state)
    if (!names.count(e.key())) unexpected.push_back(e.key());
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size() && i < 10; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > 10) s += ", ... (" + std::to_string(v.size()) + " in all)";
    return s;
  };
  if (!missing.empty()) diffs.push_back("missing in the snapshot: " + list(missing));
  if (!unexpected.empty()) diffs.push_back("in the snapshot but not in the model: " + list(unexpected));
  return diffs;
}

// ---- Sampler dry run ------------------------------------------------------------------------------------
std::optional<std::string> samplerDifference(const DistributedSampler& sampler,
                                             const std::optional<SamplerState>& saved) {
  if (!saved) return std::string("the snapshot has no sampler state but this run uses a sampler");
  DistributedSampler trial(sampler);
  try {
    trial.loadState(*saved);
  } catch (const std::exception& e) {
    return std::string("sampler: ") + e.what();
  }
  return std::nullopt;
}

} // namespace

// ---- Public pieces ------------------------------------------------------------------------------------
c10::Dict<std::string, at::Tensor> captureModelState(const torch::nn::Module& model) {
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& [name, t] : namedState(model)) out.insert(name, portableCopy(t));
  return out;
}

std::vector<std::string> restoreModelState(torch::nn::Module& model,
                                           const c10::Dict<std::string, at::Tensor>& state) {
  auto diffs = modelDifferences(model, state);
  if (!diffs.empty()) return diffs;
  torch::NoGradGuard noGrad;
  for (auto& [name, t] : namedState(model)) t.copy_(state.at(name));
  return {};
}

RngState captureRngState() {
  RngState s;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cpu = gen.get_state();
  }
  if (torch::cuda::is_available()) {
    const auto n = torch::cuda::device_count();
    for (std::size_t i = 0; i < n; ++i) {
      at::Generator gen = at::globalContext().defaultGenerator(
          at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(gen.mutex());
      s.cuda.push_back(gen.get_state());
    }
  }
  return s;
}

std::vector<std::string> restoreRngState(const RngState& s) {
  std::vector<std::string> notes;
  if (s.cpu.defined()) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.cpu);
  } else {
    notes.push_back("no CPU generator state in the snapshot; the CPU generator is left as it is");
  }
  const std::size_t present = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
  for (std::size_t i = 0; i < std::min(present, s.cuda.size()); ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(
        at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(i)));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.cuda[i]);
  }
  if (present != s.cuda.size())
    notes.push_back("the snapshot holds " + std::to_string(s.cuda.size()) +
                    " CUDA generator states and this process sees " + std::to_string(present) +
                    " CUDA devices; restored " + std::to_string(std::min(present, s.cuda.size())));
  return notes;
}

// ---- Whole snapshots --------------------------------------------------------------------------------------
Snapshot captureSnapshot(const TrainingObjects& objects, const SnapshotIdentity& identity,
                         const TrainingProgress& progress) {
  if (!objects.model) throw std::invalid_argument("captureSnapshot: TrainingObjects::model is null");
  if (identity.worldSize < 1)
    throw std::invalid_argument("captureSnapshot: world size must be >= 1, got " +
                                std::to_string(identity.worldSize));
  Snapshot s;
  s.header.worldSize = identity.worldSize;
  s.header.modelName = identity.modelName;
  s.header.config = identity.config;
  c10::Dict<std::string, std::string> config;
  for (const auto& [k, v] : identity.config) config.insert(k, v);
  s.header.configHash = contentDigest(config, "config");
  s.header.createdAt = std::chrono::system_clock::now();
  s.header.ctorchVersion = versionString();
  s.header.torchVersion = TORCH_VERSION;
  s.modelState = captureModelState(*objects.model);
  if (objects.optimizer) s.optimizerState = captureOptimizerState(*objects.optimizer, &s.optimizerType);
  s.epochsRun = progress.epochsRun;
  s.stepInEpoch = progress.stepInEpoch;
  s.globalStep = progress.globalStep;
  if (objects.sampler) s.sampler = objects.sampler->state();
  s.rng = captureRngState();
  return s;
}

void restoreSnapshot(const Snapshot& snapshot, const TrainingObjects& objects,
                     const RestoreOptions& options) {
  // Everything is checked first; nothing changes unless all of it fits.
  std::vector<std::string> problems;
  if (options.model) {
    if (!objects.model) throw std::invalid_argument("restoreSnapshot: TrainingObjects::model is null");
    auto d = modelDifferences(*objects.model, snapshot.modelState);
    problems.insert(problems.end(), d.begin(), d.end());
  }
  std::vector<GroupPlan> optimizerPlan;
  if (options.optimizer && objects.optimizer)
    optimizerPlan = planOptimizerRestore(*objects.optimizer, snapshot.optimizerType,
                                         snapshot.optimizerState, problems);
  if (options.sampler && objects.sampler)
    if (auto d = samplerDifference(*objects.sampler, snapshot.sampler)) problems.push_back(*d);
  if (!problems.empty())
    throw SnapshotIncompatible(snapshot.source.empty() ? "(in memory)" : snapshot.source, problems);

  if (options.model) restoreModelState(*objects.model, snapshot.modelState);
  if (options.optimizer && objects.optimizer) applyOptimizerRestore(*objects.optimizer, optimizerPlan);
  if (options.sampler && objects.sampler) objects.sampler->loadState(*snapshot.sampler);
  if (options.rng) {
    const bool own = options.rank >= 0 && options.rank < static_cast<std::int64_t>(snapshot.rankRng.size());
    restoreRngState(own ? snapshot.rankRng[static_cast<std::size_t>(options.rank)] : snapshot.rng);
  }
}

} // namespace ctorch
