// DistributedDataParallel on c10d's Reducer, step for step as torch/nn/parallel/distributed.py
// (1.13) drives it: construction (verify, broadcast, bucket, Reducer, Logger) and forward
// (prepare_for_forward, rebuild_buckets, buffer broadcast, prepare_for_backward, _DDPSink).
#include "ctorch/ddp.hpp"

#include "core/compat.hpp"
#include "ddp/shared_memory_allreduce.hpp"
#include "ddp/shared_memory_hook.hpp"
#include "core/exception_text.hpp"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/nn/modules/embedding.h>

#include <c10/util/Type.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_set>

namespace ctorch {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
// Python: self.broadcast_bucket_size = int(250 * 1024 * 1024).
constexpr size_t kBroadcastBucketBytes = 250u * 1024u * 1024u;

// What the _DDPSink's backward needs: the Reducer, and whether to queue delay_all_reduce (static
// graph, first iteration). Held by the autograd graph through an IValue capsule.
struct SinkState : torch::CustomClassHolder {
  std::shared_ptr<c10d::Reducer> reducer;
  bool delayAllReduce = false;
  std::shared_ptr<std::atomic<bool>> delayEnqueued;  // the DDP's flag: set once, by the first backward
};

// Python's _DDPSink: passes the outputs through unchanged (cloned) so that (1) outputs left out of
// the loss get an undefined gradient the Reducer understands, and (2) with a static graph, the first
// backward queues reducer.delay_all_reduce() to run after all gradients are computed. Its inputs
// must arrive as at::TensorList: Function::apply only looks for tensors in Tensor and TensorList
// arguments, and silently ignores a std::vector<Tensor>.
struct DDPSink : torch::autograd::Function<DDPSink> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<SinkState> state, at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    torch::autograd::variable_list outputs;
    outputs.reserve(inputs.size());
    for (const auto& t : inputs) outputs.push_back(t.clone());
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto capsule = ctx->saved_data["state"].toCapsule();
    auto* state = static_cast<SinkState*>(capsule.get());
    if (state->delayAllReduce && !state->delayEnqueued->exchange(true)) {
      std::shared_ptr<c10d::Reducer> reducer = state->reducer;
      torch::autograd::Engine::get_default_engine().queue_callback([reducer] { reducer->delay_all_reduce(); });
    }
    torch::autograd::variable_list result;
    result.reserve(grads.size() + 1);
    result.emplace_back();  // the state argument
    for (auto& g : grads) result.push_back(std::move(g));
    return result;
  }
};

// Reducer and c10d errors become DistributedError with the message only (no C++ backtrace), plus
// the C++ spelling of the option Python's messages name.
[[noreturn]] void rethrow(const std::exception& e, const char* during) {
  const std::string message = detail::messageOf(e);
  std::string text = std::string("DistributedDataParallel ") + during + ": " + message;
  if (message.find("find_unused_parameters=True") != std::string::npos)
    text += " [ctorch: DDPOptions().findUnusedParameters(true)]";
  detail::throwDistributed(text, message);
}

// Each tensor once, detached, in module order: what Python's named_parameters()/named_buffers() (which
// drop duplicates of shared tensors) feed to broadcast_coalesced. The same list on every rank, C++ or
// Python, or the coalesced broadcasts do not line up.
std::vector<at::Tensor> uniqueDetached(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& t : tensors)
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t.detach());
  return out;
}

// A given bucket assignment must hold every parameter index exactly once.
void checkBucketAssignment(const std::vector<std::vector<size_t>>& buckets, size_t parameters) {
  std::vector<int> seen(parameters, 0);
  for (const auto& bucket : buckets) {
    if (bucket.empty()) throw ConfigError("DDPOptions::bucketAssignment has an empty bucket");
    for (size_t index : bucket) {
      if (index >= parameters)
        throw ConfigError("DDPOptions::bucketAssignment names parameter " + std::to_string(index) + ", but the module has " +
                          std::to_string(parameters) + " parameters that require a gradient");
      if (seen[index]++)
        throw ConfigError("DDPOptions::bucketAssignment names parameter " + std::to_string(index) + " twice");
    }
  }
  for (size_t i = 0; i < parameters; ++i)
    if (!seen[i])
      throw ConfigError("DDPOptions::bucketAssignment leaves out parameter " + std::to_string(i) + " (of " +
                        std::to_string(parameters) + ")");
}

bool producesSparseGradient(const torch::nn::Module& m) {
  if (auto* e = dynamic_cast<const torch::nn::EmbeddingImpl*>(&m)) return e->options.sparse();
  if (auto* e = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(&m)) return e->options.sparse();
  return false;
}

} // namespace

void DDPOptions::validate() const {
  auto positive = [](double v, const char* name) {
    if (!(v > 0.0) || v * kMiB > static_cast<double>(std::numeric_limits<int64_t>::max())) {
      std::ostringstream os;
      os << "DDPOptions::" << name << " must be a positive number of MiB, got " << v;
      throw ConfigError(os.str());
    }
  };
  positive(bucketCapMb_, "bucketCapMb");
  positive(firstBucketCapMb_, "firstBucketCapMb");
  if (commHook_ == CommHook::kCustom)
    throw ConfigError("DDPOptions::commHook cannot be CommHook::kCustom: give your hook to registerCommHook");
}

struct detail::DDPCore::Impl {
  std::shared_ptr<torch::nn::Module> module;
  DDPOptions options;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::vector<at::Tensor> params;  // the Reducer's: requires_grad, deduplicated, in module order
  std::vector<bool> expectSparse;  // per parameter
  std::unordered_map<size_t, std::string> names;  // parameter index -> qualified name
  std::shared_ptr<c10d::Reducer> reducer;
  std::shared_ptr<c10d::Logger> logger;
  bool requireBackwardGradSync = true;
  bool requireForwardParamSync = true;
  bool staticGraph = false;
  bool hookRegistered = false;
  bool customHook = false;  // registerCommHook: cannot be registered again on a rejoin
  bool cpu = true;          // parameters on the CPU (the shared-memory hook's domain)
  // CommHook::kSharedMemory, when every rank could map the segment (else the Reducer's allreduce).
  std::shared_ptr<SharedMemoryAllreduce> sharedMemory;
  int64_t numIterations = 0;
  int64_t reducerGeneration = 0;  // Reducers built so far
  // Static graph: whether the first synchronised backward has queued delay_all_reduce. 1.13's Python
  // keys this on num_iterations == 1 only, which queues it again from a no_sync backward of the next
  // step (an internal assert in the Reducer); 2.x keeps this flag, and so do we.
  std::shared_ptr<std::atomic<bool>> delayEnqueued = std::make_shared<std::atomic<bool>>(false);

  bool unusedSearch() const { return options.findUnusedParameters() && !staticGraph; }
  // The _DDPSink goes on the outputs for the unused-parameter search, and on the first synchronised
  // iteration of a static graph.
  bool needsSink(bool grad) const {
    return grad && (unusedSearch() || (staticGraph && requireBackwardGradSync && numIterations == 1 &&
                                       !delayEnqueued->load()));
  }

  // Buckets, the Reducer and its Logger (and the hooks and flags they carry). Without
  // unused-parameter search (or with a static graph) everything starts in one bucket and the
  // Reducer rebuilds them in gradient-ready order after the first iteration.
  void buildReducer(const std::optional<std::vector<std::vector<size_t>>>& assignment) {
    const auto bucketBytes = static_cast<int64_t>(options.bucketCapMb() * kMiB);
    const auto firstBucketBytes = static_cast<int64_t>(options.firstBucketCapMb() * kMiB);
    std::vector<size_t> limits;
    if (options.staticGraph() || !options.findUnusedParameters())
      limits = {static_cast<size_t>(std::numeric_limits<int64_t>::max())};  // Python: sys.maxsize
    else
      limits = {static_cast<size_t>(firstBucketBytes), static_cast<size_t>(bucketBytes)};
    auto [indices, perBucketLimits] = c10d::compute_bucket_assignment_by_size(params, limits, expectSparse);
    // Reversed: gradients become ready roughly in reverse order of definition.
    std::reverse(indices.begin(), indices.end());
    std::reverse(perBucketLimits.begin(), perBucketLimits.end());
    if (assignment) {
      indices = *assignment;
      checkBucketAssignment(indices, params.size());
      // The limits only matter to a rebuild, which computes its own; keep Python's shape of them.
      perBucketLimits.assign(indices.size(), static_cast<size_t>(bucketBytes));
      if (!perBucketLimits.empty()) perBucketLimits.front() = static_cast<size_t>(firstBucketBytes);
    }
    // The previous Reducer (resetReducer) removes its autograd hooks when it goes.
    logger.reset();
    reducer.reset();
    ++reducerGeneration;
    reducer = compat::makeReducer(params, std::move(indices), std::move(perBucketLimits), group, expectSparse,
                                  bucketBytes, options.findUnusedParameters(), options.gradientAsBucketView(),
                                  names, firstBucketBytes);
    logger = std::make_shared<c10d::Logger>(reducer);
    reducer->set_logger(logger);
    if (compat::loggerCanDescribe(group))
      logger->set_construction_data_and_log(module->name(), {}, -1, options.broadcastBuffers(),
                                            /*has_sync_bn=*/false, options.staticGraph());
    if (options.staticGraph()) {
      staticGraph = true;
      reducer->set_static_graph();
      logger->set_static_graph();
    }
    hookRegistered = false;
    if (sharedMemory) {
      logger->set_comm_hook("SHARED_MEMORY");
      reducer->register_comm_hook(detail::makeSharedMemoryHook(
          sharedMemory, group, options.gradientReduction() == GradientReduction::kAfterBackward));
      hookRegistered = true;
    } else if (options.commHook() == CommHook::kAllreduce || options.commHook() == CommHook::kFp16Compress) {
      const bool fp16 = options.commHook() == CommHook::kFp16Compress;
      logger->set_comm_hook(fp16 ? "FP16_COMPRESS" : "ALLREDUCE");
      reducer->register_builtin_comm_hook(fp16 ? c10d::BuiltinCommHookType::FP16_COMPRESS
                                               : c10d::BuiltinCommHookType::ALLREDUCE);
      hookRegistered = true;
    }
  }

  // A collective too: every rank learns whether all of them share the segment.
  void createSharedMemory() {
    if (options.commHook() == CommHook::kSharedMemory && cpu)
      sharedMemory = SharedMemoryAllreduce::create(
          group, SharedMemoryAllreduceOptions().timeout(compat::glooTimeout(group).value_or(std::chrono::minutes(30))));
  }

  // With gradientAsBucketView, gradients that exist when the Reducer is built become bucket views
  // at once, and it then averages every step with one in-place division. Left undefined, a
  // process's first step instead multiplies by 1/world while copying into the bucket, which rounds
  // differently when the world size is not a power of two: a resumed process would not repeat its
  // predecessor.
  void defineGradients() {
    if (!options.gradientAsBucketView()) return;
    torch::NoGradGuard noGrad;
    for (auto& p : params)
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
  }

  // Python's _sync_buffers: the buffers are collected again each time (a module may reassign them).
  void broadcastBuffers() {
    auto buffers = uniqueDetached(module->buffers());
    if (buffers.empty()) return;
    torch::NoGradGuard noGrad;
    c10d::broadcast_coalesced(group, buffers, kBroadcastBucketBytes, 0);
  }
};

detail::DDPCore::DDPCore(std::shared_ptr<torch::nn::Module> module, DDPOptions options)
    : impl_(std::make_unique<Impl>()) {
  options.validate();
  Impl& s = *impl_;
  s.module = std::move(module);
  s.options = options;
  s.group = options.processGroup() ? options.processGroup() : getDefaultGroup();

  // Python's _build_params_for_reducer: per module, its own parameters that require grad, in
  // module order, each parameter once.
  std::vector<bool>& expectSparse = s.expectSparse;
  std::unordered_map<size_t, std::string>& names = s.names;
  std::unordered_set<const void*> seen;
  for (const auto& item : s.module->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const bool sparse = producesSparseGradient(*item.value());
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (!p.value().requires_grad() || !seen.insert(p.value().unsafeGetTensorImpl()).second) continue;
      names[s.params.size()] = item.key().empty() ? p.key() : item.key() + "." + p.key();
      s.params.push_back(p.value());
      expectSparse.push_back(sparse);
    }
  }
  if (s.params.empty())
    throw ConfigError("DistributedDataParallel is not needed when a module has no parameter that requires a gradient");
  std::set<c10::DeviceType> deviceTypes;
  for (const auto& p : s.params) deviceTypes.insert(p.device().type());
  if (deviceTypes.size() != 1) {
    std::string found;
    for (auto t : deviceTypes) found += (found.empty() ? "" : " and ") + c10::DeviceTypeName(t);
    throw ConfigError("DistributedDataParallel's module must have all its parameters on one type of device, "
                      "found " + found);
  }

  s.cpu = *deviceTypes.begin() == c10::DeviceType::CPU;
  if (detail::joiningInPlace()) {
    // A replacement: the survivors are not constructing anything; the state (and the group's
    // shared-memory segment) come when ResilientTraining::resume() joins them (rejoin).
    s.buildReducer(options.bucketAssignment());
    return;
  }
  try {
    // Verify model equivalence, then make every rank start from rank 0's parameters and buffers.
    c10d::verify_params_across_processes(s.group, s.params, compat::kNullopt);
    {
      auto states = uniqueDetached(s.module->parameters());
      for (auto& b : uniqueDetached(s.module->buffers())) states.push_back(b);
      torch::NoGradGuard noGrad;
      if (!states.empty()) c10d::broadcast_coalesced(s.group, states, kBroadcastBucketBytes, 0);
    }

    // A collective too: every rank learns whether all of them share the segment.
    s.createSharedMemory();
    s.buildReducer(options.bucketAssignment());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "construction failed");
  }
}

detail::DDPCore::~DDPCore() = default;

bool detail::DDPCore::beginForward() {
  Impl& s = *impl_;
  const bool grad = torch::GradMode::is_enabled();
  try {
    if (grad && s.requireBackwardGradSync) {
      s.logger->set_runtime_stats_and_log();
      ++s.numIterations;
      s.reducer->prepare_for_forward();
    }
    // Before the forward allocates activations: the rebuild may hold old and new buckets at once.
    if (grad) s.reducer->rebuild_buckets();  // a collective when it rebuilds (once)
    if (s.requireForwardParamSync && s.options.broadcastBuffers()) s.broadcastBuffers();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "forward");
  }
  return s.needsSink(grad);
}

std::vector<at::Tensor> detail::DDPCore::endForward(const std::vector<at::Tensor>* outputs, const char* outputType) {
  Impl& s = *impl_;
  const bool grad = torch::GradMode::is_enabled();
  const bool unusedSearch = s.unusedSearch();
  const bool sink = s.needsSink(grad);
  if (sink && outputs == nullptr)
    throw ConfigError(std::string("DistributedDataParallel with ") +
                      (unusedSearch ? "findUnusedParameters" : "staticGraph") +
                      " must see the tensors the module's forward returns, but it cannot look inside '" +
                      (outputType ? c10::demangle(outputType) : std::string("?")) +
                      "': return a Tensor, or a std::vector / std::tuple / std::pair / std::optional of them");
  try {
    if (grad && s.requireBackwardGradSync) {
      s.requireForwardParamSync = true;
      // Only the unused-parameter search needs the outputs (to traverse the graph from them).
      s.reducer->prepare_for_backward(unusedSearch ? *outputs : std::vector<at::Tensor>{});
    } else {
      s.requireForwardParamSync = false;
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "forward");
  }
  if (!sink) return {};

  // Only tensors with a grad_fn go through the sink (Python keeps the others as they are).
  std::vector<at::Tensor> through;
  for (const auto& t : *outputs)
    if (t.defined() && t.grad_fn()) through.push_back(t);
  if (through.empty()) return {};
  auto state = c10::make_intrusive<SinkState>();
  state->reducer = s.reducer;
  state->delayAllReduce = s.staticGraph;
  state->delayEnqueued = s.delayEnqueued;
  auto passed = DDPSink::apply(state, at::TensorList(through));
  std::vector<at::Tensor> result;
  result.reserve(outputs->size());
  size_t next = 0;
  for (const auto& t : *outputs) result.push_back(t.defined() && t.grad_fn() ? passed.at(next++) : t);
  return result;
}

bool detail::DDPCore::requireBackwardGradSync() const { return impl_->requireBackwardGradSync; }
void detail::DDPCore::setRequireBackwardGradSync(bool on) {
  if (!on && impl_->staticGraph && !compat::kStaticGraphNoSync)
    throw ConfigError("DistributedDataParallel: noSync() with staticGraph is refused on LibTorch " +
                      std::string(TORCH_VERSION) +
                      ": its Reducer averages such accumulated gradients wrongly (measured against one process); "
                      "accumulate without staticGraph, or synchronise every micro-batch");
  impl_->requireBackwardGradSync = on;
}

void detail::DDPCore::registerCommHook(std::unique_ptr<c10d::CommHookInterface> hook) {
  Impl& s = *impl_;
  if (s.hookRegistered)
    throw ConfigError("DistributedDataParallel: a communication hook is already registered (DDPOptions::commHook "
                      "or an earlier registerCommHook)");
  if (s.numIterations > 0)
    throw ConfigError("DistributedDataParallel: register the communication hook before the first forward");
  try {
    s.logger->set_comm_hook("custom C++ hook");
    s.reducer->register_comm_hook(std::move(hook));
    s.hookRegistered = true;
    s.customHook = true;
  } catch (const std::exception& e) {
    rethrow(e, "registerCommHook");
  }
}

void detail::DDPCore::resetReducer(const std::optional<std::vector<std::vector<size_t>>>& buckets) {
  Impl& s = *impl_;
  if (s.numIterations > 0)
    throw ConfigError("DistributedDataParallel: the bucket layout can only be replaced before the first forward");
  if (s.hookRegistered && s.options.commHook() == CommHook::kNone)
    throw ConfigError("DistributedDataParallel: replace the bucket layout before registerCommHook()");
  s.defineGradients();
  try {
    s.buildReducer(buckets);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "bucket layout");
  }
}

void detail::DDPCore::releaseGroup() {
  Impl& s = *impl_;
  s.logger.reset();
  s.reducer.reset();  // removes its autograd hooks; its work on the failed group goes with it
  s.sharedMemory.reset();
  s.group.reset();
}

void detail::DDPCore::rejoin(c10::intrusive_ptr<c10d::ProcessGroup> group,
                             const std::optional<std::vector<std::vector<size_t>>>& buckets) {
  Impl& s = *impl_;
  if (s.customHook)
    throw ConfigError("DistributedDataParallel: in-place recovery cannot re-register a custom communication hook "
                      "(registerCommHook); use DDPOptions::commHook");
  releaseGroup();
  s.group = std::move(group);
  s.numIterations = 0;
  s.requireBackwardGradSync = true;
  s.requireForwardParamSync = true;
  s.staticGraph = false;
  s.delayEnqueued = std::make_shared<std::atomic<bool>>(false);
  try {
    s.createSharedMemory();
    s.defineGradients();
    s.buildReducer(buckets);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    rethrow(e, "rejoining the re-formed group");
  }
}

bool detail::DDPCore::rebuildBuckets() {
  try {
    return impl_->reducer->rebuild_buckets();
  } catch (const std::exception& e) {
    rethrow(e, "bucket rebuild");
  }
}

void detail::DDPCore::zeroGrad(bool setToNone) {
  auto params = impl_->module->parameters();
  compat::zeroGrad(params, setToNone);
}

std::vector<std::vector<size_t>> detail::DDPCore::bucketAssignment() const {
  return impl_->logger->get_per_bucket_variable_indices();
}

const DDPOptions& detail::DDPCore::options() const { return impl_->options; }

std::int64_t detail::DDPCore::reducerGeneration() const { return impl_->reducerGeneration; }

std::optional<std::string> detail::DDPCore::captureBlocker() const {
  const Impl& s = *impl_;
  if (s.cpu) return std::string("DDP's parameters are on the CPU");
  if (!s.reducer) return std::string("DDP has no process group (in-place recovery under way)");
  const std::string backend = compat::backendNameFor(s.group, s.params.front().device().type());
  // Gloo reduces CUDA tensors through host copies and waits for them: nothing a graph can hold.
  if (backend != "nccl")
    return "DDP reduces gradients with " + (backend.empty() ? std::string("an unknown backend") : backend) +
           ", which a CUDA graph cannot capture (NCCL can)";
  if (s.unusedSearch())
    return std::string("DDP's unused-parameter search walks the autograd graph on the host every step "
                       "(findUnusedParameters without staticGraph)");
  if (s.customHook) return std::string("DDP has a custom communication hook, which may work on the host");
  // The Reducer times iterations 1-10 and every 100th with CUDA events and reads them at the next
  // forward (Logger::set_runtime_stats_and_log: an event synchronise). The count before this
  // forward and the one it starts must both be untimed (c10d's kDDPRuntimeLoggingSampleRate, 100).
  auto timed = [](int64_t n) { return n > 0 && (n <= 10 || n % 100 == 0); };
  if (timed(s.numIterations) || timed(s.numIterations + 1))
    return "DDP's Reducer times iteration " + std::to_string(timed(s.numIterations) ? s.numIterations : s.numIterations + 1) +
           " (iterations 1-10 and every 100th), which synchronises with the host";
  if (s.staticGraph && !s.delayEnqueued->load())
    return std::string("DDP's static graph has not finished its first iteration");
  return std::nullopt;
}
std::optional<GradientReductionStats> detail::DDPCore::sharedMemoryStats() const {
  if (!impl_->sharedMemory) return std::nullopt;
  const auto s = impl_->sharedMemory->stats();
  return GradientReductionStats{s.calls, s.total, s.waiting};
}

CommHook detail::DDPCore::commHookInUse() const {
  const Impl& s = *impl_;
  if (s.sharedMemory) return CommHook::kSharedMemory;
  switch (s.options.commHook()) {
    case CommHook::kAllreduce:
    case CommHook::kFp16Compress: return s.options.commHook();
    default: return s.hookRegistered ? CommHook::kCustom : CommHook::kNone;
  }
}
c10::intrusive_ptr<c10d::ProcessGroup> detail::DDPCore::processGroup() const { return impl_->group; }
torch::nn::Module& detail::DDPCore::module() { return *impl_->module; }

} // namespace ctorch
