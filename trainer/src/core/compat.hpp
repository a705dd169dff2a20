// THE compatibility header: every difference between LibTorch 1.13 and 2.x that ctorch depends on
// lives here, guarded by torch/version.h or by detecting the API itself where the 2.x minor release
// of a change is uncertain. Library sources include it; user code rarely needs it (zeroGrad).
#pragma once

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/optim/optimizer.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>
#ifdef USE_C10D_NCCL  // defined by the Torch CMake targets of CUDA builds with NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <sstream>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// 2.0 split process groups into a dispatching c10d::ProcessGroup and per-device c10d::Backend.
#define CTORCH_TORCH_HAS_BACKENDS (TORCH_VERSION_MAJOR >= 2)

namespace ctorch::compat {

// ---- optional -----------------------------------------------------------------------------------
// c10::optional is its own type in 1.13 and early 2.x and an alias of std::optional in later 2.x;
// naming it works in all of them, so c10 APIs taking optionals are called with this spelling.
template <class T>
using Optional = c10::optional<T>;
inline constexpr auto kNullopt = c10::nullopt;

// ---- backends -------------------------------------------------------------------------------------
// 1.13: ProcessGroupGloo/NCCL *are* ProcessGroups. 2.x: they are c10d::Backends registered per
// device type on a c10d::ProcessGroup, which dispatches each collective by the tensors' device.
#if CTORCH_TORCH_HAS_BACKENDS
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
#else
using BackendPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
#endif

enum class BackendKind { kGloo, kNccl };

inline const char* backendName(BackendKind kind) { return kind == BackendKind::kGloo ? "gloo" : "nccl"; }

// ---- the store layout of Python's init_process_group (default group, name "0") ---------------------
// Python wraps the rendezvous store in PrefixStore("default_pg") (same in every version), then
// 1.13: PrefixStore("0") and the backend uses that store;
// 2.x:  PrefixStore("0/") for the ProcessGroup and PrefixStore("<device>/") on top for each backend.
// Matching it keeps C++ and Python workers on the same keys in one job.
inline constexpr const char* kDefaultGroupName = "0";

// A group made later by new_group is named by Python's counter ("1", "2", ...) and keyed the same way
// under the default_pg store.
inline c10::intrusive_ptr<c10d::Store> groupStore(const c10::intrusive_ptr<c10d::Store>& defaultPgStore,
                                                 const std::string& groupName = kDefaultGroupName) {
#if CTORCH_TORCH_HAS_BACKENDS
  return c10::make_intrusive<c10d::PrefixStore>(groupName + "/", defaultPgStore);
#else
  return c10::make_intrusive<c10d::PrefixStore>(groupName, defaultPgStore);
#endif
}

// `device` is "cpu" or "cuda" (Python iterates its backend map by device name).
inline c10::intrusive_ptr<c10d::Store> backendStore(const c10::intrusive_ptr<c10d::Store>& group,
                                                   const std::string& device) {
#if CTORCH_TORCH_HAS_BACKENDS
  return c10::make_intrusive<c10d::PrefixStore>(device + "/", group);
#else
  (void)device;
  return group;
#endif
}

// TORCH_DISTRIBUTED_DEBUG=DETAIL wraps each backend in a ProcessGroupWrapper whose helper Gloo group
// lives under "pg_wrapper:<group name>": on the default_pg store in 1.13, on the backend's store in 2.x.
inline c10::intrusive_ptr<c10d::Store> wrapperHelperStore(
    const c10::intrusive_ptr<c10d::Store>& defaultPgStore, const c10::intrusive_ptr<c10d::Store>& backend) {
#if CTORCH_TORCH_HAS_BACKENDS
  (void)defaultPgStore;
  return c10::make_intrusive<c10d::PrefixStore>(std::string("pg_wrapper:") + kDefaultGroupName, backend);
#else
  (void)backend;
  return c10::make_intrusive<c10d::PrefixStore>(std::string("pg_wrapper:") + kDefaultGroupName,
                                                defaultPgStore);
#endif
}

// Same signature in both versions (Options derive from ProcessGroup::Options in 1.13, from
// Backend::Options in 2.x).
inline c10::intrusive_ptr<c10d::ProcessGroupGloo> makeGloo(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::vector<std::shared_ptr<::gloo::transport::Device>> devices, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices = std::move(devices);
  // Python's binding: two threads per device.
  options->threads = static_cast<int>(options->devices.size() * 2);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

#ifdef USE_C10D_NCCL
inline BackendPtr makeNccl(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                           std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/false);
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}
#endif

inline BackendPtr wrapForDebug(const BackendPtr& backend,
                               const c10::intrusive_ptr<c10d::ProcessGroupGloo>& helper) {
  return c10::make_intrusive<c10d::ProcessGroupWrapper>(backend, helper);
}

namespace detail {
template <class PG, class = void>
struct HasProcessGroupOptions : std::false_type {};
template <class PG>
struct HasProcessGroupOptions<PG, std::void_t<typename PG::Options>> : std::true_type {};

template <class T>
inline constexpr bool kAlwaysFalse = false;
} // namespace detail

// One backend and the device types it serves.
struct BoundBackend {
  BackendKind kind;
  std::vector<c10::DeviceType> devices;
  BackendPtr backend;
};

// Assembles the default process group from its backends. 1.13: the single backend is the group.
// 2.x: a ProcessGroup over `group` with each backend registered for its devices; `defaultKind` is
// the one used for barrier() and sequence numbers. Its construction changed within 2.x (an
// Options argument in earlier releases, setDefaultBackend in later ones), so the constructor is
// detected, not guessed from the version number.
template <class PG = c10d::ProcessGroup>
c10::intrusive_ptr<PG> makeProcessGroup(const c10::intrusive_ptr<c10d::Store>& group, int rank, int size,
                                        std::chrono::milliseconds timeout,
                                        const std::vector<BoundBackend>& backends, BackendKind defaultKind) {
  TORCH_CHECK(!backends.empty(), "ctorch: no backend to build a process group from");
#if CTORCH_TORCH_HAS_BACKENDS
  auto typeOf = [](BackendKind k) {
    return k == BackendKind::kGloo ? PG::BackendType::GLOO : PG::BackendType::NCCL;
  };
  c10::intrusive_ptr<PG> pg;
  if constexpr (detail::HasProcessGroupOptions<PG>::value) {
    auto options = c10::make_intrusive<typename PG::Options>(backendName(defaultKind), timeout);
    pg = c10::make_intrusive<PG>(group, rank, size, options);
  } else {
    (void)timeout;  // each backend carries its own timeout
    pg = c10::make_intrusive<PG>(group, rank, size);
    pg->setDefaultBackend(typeOf(defaultKind));
  }
  for (const auto& b : backends)
    for (auto device : b.devices) pg->setBackend(device, typeOf(b.kind), b.backend);
  return pg;
#else
  (void)group, (void)rank, (void)size, (void)timeout, (void)defaultKind;
  TORCH_CHECK(backends.size() == 1, "ctorch: LibTorch 1.13 process groups have exactly one backend");
  return backends.front().backend;
#endif
}

// ---- the agent's store (TORCHELASTIC_USE_AGENT_STORE=True) -------------------------------------------
// PyTorch before 2.6 wraps the agent's store in PrefixStore("/worker/attempt_<restart count>");
// 2.6 dropped the prefix (each restart round gets a fresh store instead). A C++ worker follows the
// convention of the PyTorch release it is built with, so that it meets Python ranks of the same
// release in one job; ctorchrun gives every round a fresh store, so both conventions are safe.
#define CTORCH_TORCH_AGENT_STORE_PREFIX \
  (TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 6))

inline c10::intrusive_ptr<c10d::Store> agentStore(const c10::intrusive_ptr<c10d::Store>& tcp,
                                                  const std::string& attemptPrefix) {
#if CTORCH_TORCH_AGENT_STORE_PREFIX
  return c10::make_intrusive<c10d::PrefixStore>(attemptPrefix, tcp);
#else
  (void)attemptPrefix;
  return tcp;
#endif
}

// ---- libuv ---------------------------------------------------------------------------------------------
// 2.2 added TCPStoreOptions::useLibUV (default true since 2.4, which throws "use_libuv was
// requested but PyTorch was built without libuv support" on builds without it, such as Debian's).
// Python decides from USE_LIBUV ("0" off); C++ workers do the same. 1.13 has no libuv backend.
namespace detail {
template <class O, class = void>
struct HasUseLibUV : std::false_type {};
template <class O>
struct HasUseLibUV<O, std::void_t<decltype(std::declval<O&>().useLibUV)>> : std::true_type {};
} // namespace detail

template <class O>
void setUseLibUV(O& options, bool useLibUV) {
  if constexpr (detail::HasUseLibUV<O>::value) options.useLibUV = useLibUV;
  else (void)options, (void)useLibUV;
}

// Python's rule for USE_LIBUV: unset or "1" means yes.
inline bool useLibUVFromEnvironment() {
  const char* v = std::getenv("USE_LIBUV");
  return v == nullptr || *v == '\0' || std::string(v) == "1";
}

// ---- the store-based barrier at the end of init_process_group ---------------------------------------
// 1.13 and 2.0 always wait until every rank has added 1 to "store_based_barrier_key:1" on the
// default_pg store (polling); 2.1+ only when TORCH_DIST_INIT_BARRIER=1, on
// "store_based_barrier_key:<group name>", and the last rank to arrive sets "<key>:last_worker".
struct InitBarrierRule {
  bool enabled = false;
  std::string key;
  bool lastWorkerKey = false;
};

inline InitBarrierRule initBarrierRule(bool torchDistInitBarrierSet) {
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 0)
  (void)torchDistInitBarrierSet;
  return {true, "store_based_barrier_key:1", false};
#else
  return {torchDistInitBarrierSet, std::string("store_based_barrier_key:") + kDefaultGroupName, true};
#endif
}

// Python sets Gloo's/NCCL's sequence number (rank 0 writes it to the store, the others wait for it)
// after the init barrier in 1.13, and right after creating each backend in 2.x. A rank that waits for
// it before the barrier while a Python rank 0 waits in the barrier first would deadlock: follow the
// version's order.
inline constexpr bool kSequenceNumberAfterInitBarrier = !CTORCH_TORCH_HAS_BACKENDS;
// 2.14 made setSequenceNumberForGroup a deprecated no-op that warns (sequence numbers start at 0 on
// every rank; nothing goes through the store), so it is called only where it still does something.
inline constexpr bool kSequenceNumberFromStore =
    TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 14);

// ---- the Reducer -------------------------------------------------------------------------------------
// 1.13 and earlier 2.x: (params, bucket indices, per-bucket size limits, group, expect_sparse, cap,
// find_unused, as_view, names, first cap). Later 2.x releases drop the size limits and add
// skip_all_reduce_unused_params / use_python_reducer; 2.14 adds bucket_bytes_cap_list (and a
// defaulted batched_grad_copy). Detected, like the ProcessGroup constructor.
template <class R = c10d::Reducer>
std::shared_ptr<R> makeReducer(std::vector<at::Tensor> params, std::vector<std::vector<size_t>> bucketIndices,
                               std::vector<size_t> perBucketSizeLimits,
                               c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<bool> expectSparse,
                               int64_t bucketBytesCap, bool findUnused, bool gradientAsBucketView,
                               std::unordered_map<size_t, std::string> names, int64_t firstBucketBytesCap) {
  using Tensors = std::vector<at::Tensor>;
  using Indices = std::vector<std::vector<size_t>>;
  using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
  using Names = std::unordered_map<size_t, std::string>;
  if constexpr (std::is_constructible_v<R, Tensors, Indices, std::vector<size_t>, Group, std::vector<bool>,
                                        int64_t, bool, bool, Names, int64_t>) {
    return std::make_shared<R>(std::move(params), std::move(bucketIndices), std::move(perBucketSizeLimits),
                               std::move(group), std::move(expectSparse), bucketBytesCap, findUnused,
                               gradientAsBucketView, std::move(names), firstBucketBytesCap);
  } else if constexpr (std::is_constructible_v<R, Tensors, Indices, Group, std::vector<bool>, int64_t, bool,
                                               bool, Names, int64_t, bool, bool, std::vector<int64_t>>) {
    // 2.14: per-bucket caps for rebuilding; empty = the Reducer's own rule, as Python's DDP passes
    // unless the user gave bucket_cap_mb_list.
    (void)perBucketSizeLimits;
    return std::make_shared<R>(std::move(params), std::move(bucketIndices), std::move(group),
                               std::move(expectSparse), bucketBytesCap, findUnused, gradientAsBucketView,
                               std::move(names), firstBucketBytesCap,
                               /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                               /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
  } else if constexpr (std::is_constructible_v<R, Tensors, Indices, Group, std::vector<bool>, int64_t, bool,
                                               bool, Names, int64_t, bool, bool>) {
    (void)perBucketSizeLimits;
    return std::make_shared<R>(std::move(params), std::move(bucketIndices), std::move(group),
                               std::move(expectSparse), bucketBytesCap, findUnused, gradientAsBucketView,
                               std::move(names), firstBucketBytesCap,
                               /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false);
  } else {
    static_assert(detail::kAlwaysFalse<R>, "ctorch: unknown c10d::Reducer constructor in this LibTorch");
  }
}

// ---- static graph with no_sync ---------------------------------------------------------------------------
// 1.13: gradient accumulation under no_sync with static_graph equals one process on the union of
// the batches. With LibTorch 2.14's Reducer it does not (max difference 0.05 on the MLP of the
// equivalence matrix), and Python 2.14's own rule (the _DDPSink on a no_sync forward) trips an
// internal assert in the Reducer; ctorch refuses the combination there rather than train wrongly.
inline constexpr bool kStaticGraphNoSync =
    TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 14);

// ---- the DDP logger -------------------------------------------------------------------------------------
// 2.x's c10d::Logger::set_construction_data_and_log reads Gloo's thread count through a static_cast
// of the group's CPU backend to ProcessGroupGloo. Under TORCH_DISTRIBUTED_DEBUG=DETAIL that backend
// is a ProcessGroupWrapper, and the cast reads garbage (a crash in LibTorch 2.14; Python's DDP takes
// the same path). The construction record is only logging: it is skipped where it cannot be made.
inline bool loggerCanDescribe(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
#if CTORCH_TORCH_HAS_BACKENDS
  try {
    auto backend = group->getBackend(c10::DeviceType::CPU);
    if (backend && backend->getBackendName() == "gloo")
      return dynamic_cast<c10d::ProcessGroupGloo*>(backend.get()) != nullptr;
  } catch (const std::exception&) {
    // no CPU backend: nothing for the logger to misread
  }
#else
  (void)group;
#endif
  return true;
}

// ---- a group's collective timeout ---------------------------------------------------------------------
// Gloo's options hold it: the group itself in 1.13, its CPU backend in 2.x. Unknown (another
// backend, or a debug wrapper around Gloo): nullopt.
inline std::optional<std::chrono::milliseconds> glooTimeout(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  try {
#if CTORCH_TORCH_HAS_BACKENDS
    auto backend = group->getBackend(c10::DeviceType::CPU);
    if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(backend.get())) return gloo->getOptions()->timeout;
#else
    if (auto* gloo = dynamic_cast<c10d::ProcessGroupGloo*>(group.get())) return gloo->getOptions()->timeout;
#endif
  } catch (const std::exception&) {
    // no CPU backend
  }
  return std::nullopt;
}

// ---- the backend that reduces a device type's tensors ------------------------------------------------
// 1.13: the group is its one backend; 2.x: the backend registered for the device type ("" when none).
inline std::string backendNameFor(const c10::intrusive_ptr<c10d::ProcessGroup>& group, c10::DeviceType device) {
  if (!group) return "";
#if CTORCH_TORCH_HAS_BACKENDS
  try {
    auto backend = group->getBackend(device);
    return backend ? backend->getBackendName() : std::string();
  } catch (const std::exception&) {
    return "";
  }
#else
  (void)device;
  try {
    return group->getBackendName();
  } catch (const std::exception&) {
    return "";
  }
#endif
}

// ---- flat reduce-scatter and all-gather (NCCL's) --------------------------------------------------------
// 1.13 and earlier 2.x: ProcessGroup::_reduce_scatter_base / _allgather_base. Later 2.x (2.14) names
// them reduce_scatter_single / all_gather_single and deprecates the old names. Detected.
namespace detail {
template <class PG, class = void>
struct HasSingleCollectives : std::false_type {};
template <class PG>
struct HasSingleCollectives<PG, std::void_t<decltype(std::declval<PG&>().reduce_scatter_single(
                                    std::declval<at::Tensor&>(), std::declval<at::Tensor&>()))>>
    : std::true_type {};
} // namespace detail

template <class PG = c10d::ProcessGroup>
auto reduceScatterFlat(PG& group, at::Tensor& output, at::Tensor& input) {
  if constexpr (detail::HasSingleCollectives<PG>::value) return group.reduce_scatter_single(output, input);
  else return group._reduce_scatter_base(output, input);
}

template <class PG = c10d::ProcessGroup>
auto allGatherFlat(PG& group, at::Tensor& output, at::Tensor& input) {
  if constexpr (detail::HasSingleCollectives<PG>::value) return group.all_gather_single(output, input);
  else return group._allgather_base(output, input);
}

// ---- zero_grad ---------------------------------------------------------------------------------------
// 1.13's Optimizer::zero_grad() zeroes, 2.x's zero_grad(set_to_none = true) resets by default, and both
// call detach_() on every gradient, which throws "Can't detach views in-place" when gradients are
// DDP bucket views (gradient_as_bucket_view). This does what Python's Optimizer.zero_grad does,
// identically on both versions.
inline void zeroGrad(std::vector<at::Tensor>& params, bool setToNone) {
  for (auto& p : params) {
    auto& grad = p.mutable_grad();
    if (!grad.defined()) continue;
    if (setToNone) {
      grad.reset();
      continue;
    }
    if (grad.grad_fn()) grad.detach_();
    else grad.requires_grad_(false);
    grad.zero_();
  }
}

inline void zeroGrad(torch::optim::Optimizer& optimizer, bool setToNone) {
  for (auto& group : optimizer.param_groups()) zeroGrad(group.params(), setToNone);
}

// ---- Optimizer state keys ---------------------------------------------------------------------------
// torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl: 1.13 (and 2.0) use its
// address printed as a string (c10::guts::to_string), later 2.x releases the void* itself. The key
// type is taken from the map, so both compile without a version number.
using OptimizerStateMap =
    std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using OptimizerStateKey = typename OptimizerStateMap::key_type;

namespace detail {
template <typename Key>
Key optimizerStateKey(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;  // what c10::guts::to_string does
    os << impl;
    return os.str();
  } else {
    return static_cast<Key>(impl);
  }
}
} // namespace detail

inline OptimizerStateKey optimizerStateKey(const at::Tensor& parameter) {
  return detail::optimizerStateKey<OptimizerStateKey>(parameter.unsafeGetTensorImpl());
}

// ---- autocast (automatic mixed precision) -------------------------------------------------------------
// 1.13 to 2.3: at::autocast::is_enabled()/set_enabled(bool) switch CUDA autocast for this thread.
// 2.4 made the switch per device type (is_autocast_enabled(DeviceType), set_autocast_enabled(
// DeviceType, bool)) and deprecated the CUDA-only calls.
#define CTORCH_TORCH_AUTOCAST_PER_DEVICE \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))

// Autocast's per-thread switch and dtype for one device type (CPU or CUDA), as Python's
// torch.autocast sets them.
inline bool autocastEnabled(at::DeviceType device) {
#if CTORCH_TORCH_AUTOCAST_PER_DEVICE
  return at::autocast::is_autocast_enabled(device);
#else
  return device == at::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}
inline void setAutocastEnabled(at::DeviceType device, bool enabled) {
#if CTORCH_TORCH_AUTOCAST_PER_DEVICE
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == at::kCPU) at::autocast::set_cpu_enabled(enabled);
  else at::autocast::set_enabled(enabled);
#endif
}
inline at::ScalarType autocastDtype(at::DeviceType device) {
#if CTORCH_TORCH_AUTOCAST_PER_DEVICE
  return at::autocast::get_autocast_dtype(device);
#else
  return device == at::kCPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}
inline void setAutocastDtype(at::DeviceType device, at::ScalarType dtype) {
#if CTORCH_TORCH_AUTOCAST_PER_DEVICE
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == at::kCPU) at::autocast::set_autocast_cpu_dtype(dtype);
  else at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}
// CPU autocast to float16 came with the per-device API (2.4); 1.13 casts the CPU to bfloat16 only.
inline constexpr bool kCpuAutocastHalf = CTORCH_TORCH_AUTOCAST_PER_DEVICE;

} // namespace ctorch::compat
