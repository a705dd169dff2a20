// The default process group (Python's init_process_group / destroy_process_group and the getters):
// the rendezvous store as torch.distributed makes it, the backends (Gloo, NCCL), the init barrier,
// and what a set-up that waits for peers does on a stop signal. In-place recovery's parts are
// comm/control_channel.cpp (the worker's end of the control channel) and comm/group_reform.cpp.
#include "ctorch/distributed.hpp"

#include "comm/control_channel.hpp"
#include "comm/group_state.hpp"
#include "core/exception_text.hpp"


#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/stop_signal.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/debug.h>
#include <torch/cuda.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <unistd.h>

#include <climits>
#include <csignal>
#include <filesystem>
#include <map>
#include <cstdlib>
#include <iostream>
#include <set>
#include <mutex>
#include <sstream>
#include <condition_variable>
#include <optional>
#include <thread>

namespace ctorch {

namespace {

#ifdef USE_C10D_NCCL
constexpr bool kHasNccl = true;
#else
constexpr bool kHasNccl = false;
#endif

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

// The rendezvous store, exactly as torch.distributed.rendezvous._create_c10d_store makes it.
struct RootStore {
  c10::intrusive_ptr<c10d::Store> store;
  // This rank hosts the store and its constructor ran for the whole store timeout: LibTorch 1.13's
  // TCPStore then stops waiting for the other ranks without an error (2.x throws). Not proof that a
  // rank is missing (the last one may arrive at the deadline), so it only enriches a later failure.
  bool hostWaitedFullTimeout = false;
};

RootStore makeStore(const DistributedEnv& env, std::chrono::milliseconds timeout) {
  if (!env.needsStore()) {
    return {c10::make_intrusive<c10d::HashStore>(), false};
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.masterPort);
  opts.numWorkers = static_cast<std::size_t>(env.worldSize);
  opts.timeout = timeout;
  compat::setUseLibUV(opts, env.useLibUV);
  if (env.useAgentStore) {
    opts.isServer = false;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.masterAddr, opts);
    return {compat::agentStore(tcp, contract::agentStorePrefix(env.restartCount)), false};
  }
  opts.isServer = env.rank == 0;
  opts.waitWorkers = true;
  opts.multiTenant = true;
  const auto start = std::chrono::steady_clock::now();
  auto tcp = c10::make_intrusive<c10d::TCPStore>(env.masterAddr, opts);
  const bool waitedFull = opts.isServer && std::chrono::steady_clock::now() - start >= timeout;
  return {tcp, waitedFull};
}

// Executes compat::initBarrierRule: every rank adds 1 and waits for the count to reach the world.
void storeBarrier(c10d::Store& store, const compat::InitBarrierRule& rule, int worldSize,
                  std::chrono::milliseconds timeout) {
  store.add(rule.key, 1);
  auto count = store.add(rule.key, 0);
  if (rule.lastWorkerKey) {
    const std::string last = rule.key + ":last_worker";
    if (count >= worldSize) store.set(last, std::vector<uint8_t>{'1'});
    store.wait({last}, timeout);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (count < worldSize) {
    if (std::chrono::steady_clock::now() > deadline)
      throw DistributedTimeout("timed out after " + detail::seconds(timeout) + " in the init barrier: " +
                               std::to_string(count) + "/" + std::to_string(worldSize) + " ranks arrived");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    count = store.add(rule.key, 0);
  }
}

bool cudaUsable() { return kHasNccl && torch::cuda::is_available(); }

// cuda:LOCAL_RANK becomes the current device, through the device-generic guard interface (no CUDA
// headers needed, so this compiles in CPU-only builds too).
void bindCudaDevice(const DistributedEnv& env) {
  const auto count = static_cast<int>(torch::cuda::device_count());
  if (count == 0) return;
  const int index = count == 1 ? 0 : env.localRank;
  if (index >= count)
    throw ConfigError("LOCAL_RANK " + std::to_string(env.localRank) + " (" + env.localRankFrom + ") has no GPU: only " +
                      std::to_string(count) + " CUDA devices are visible");
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(c10::Device(c10::DeviceType::CUDA, index));
}



// A peer that dies mid-collective closes its sockets; Gloo's writes to them (writev, without
// MSG_NOSIGNAL) then raise SIGPIPE, whose default action ends this process too: a survivor must get
// an error instead (and recover in place). Python ignores SIGPIPE at start-up, so its ranks do get
// one; so do ours. A handler or disposition the program chose is kept.
void ignoreSigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

// While a process group is set up, c10d's store and Gloo wait for the other ranks inside calls that a
// stop signal does not end (a handler installed by installStopHandlers() only sets a flag): a rank
// whose peers failed would then sit out its launcher's whole grace period before SIGKILL, and a
// group restart would cost that much. A set-up that goes on kStopGrace after a stop signal is one
// waiting for peers that are gone: this watch ends the process then, with exit 75 (kExitPreempted:
// nothing was trained yet, nothing to save; run it again). A set-up that finishes within it goes on
// to agree on the stop with its peers (ResilientTraining::resume()), as a stop during start-up does.
class StopWatch {
 public:
  explicit StopWatch(std::string who) : who_(std::move(who)), thread_([this] { watch(); }) {}
  ~StopWatch() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

 private:
  static constexpr std::chrono::milliseconds kStopGrace{2000};
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    std::optional<std::chrono::steady_clock::time_point> stopSeen;
    while (!done_) {
      const int signo = stopSignal();
      if (signo && !stopSeen) stopSeen = std::chrono::steady_clock::now();
      if (signo && std::chrono::steady_clock::now() - *stopSeen >= kStopGrace) {
        std::cerr << "ctorch: " + who_ + ": stopped by signal " + std::to_string(signo) +
                         " while the process group was set up: nothing to save yet\n"
                  << std::flush;
        std::_Exit(contract::kExitPreempted);
      }
      wake_.wait_for(lock, std::chrono::milliseconds(50));
    }
  }
  std::string who_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool done_ = false;
  std::thread thread_;
};

} // namespace

namespace detail {

// Never destroyed: tearing down Gloo threads and a TCPStore server during static destruction, after
// LibTorch's own statics may be gone, crashes at exit. destroyProcessGroup() is the orderly way.
// Python's ProcessGroupGloo binding: GLOO_SOCKET_IFNAME's interfaces, else the address this host's
// name resolves to. A world of 1 without a store stays on loopback: no network needed at all.
std::vector<std::shared_ptr<::gloo::transport::Device>> glooDevices(const ProcessGroupOptions& options,
                                                                   const EnvLookup& lookup,
                                                                   const DistributedEnv& env) {
  std::string interfaces = options.glooInterface();
  if (interfaces.empty()) interfaces = lookup("GLOO_SOCKET_IFNAME").value_or("");
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  for (const auto& name : split(interfaces, ','))
    devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
  if (devices.empty()) {
    devices.push_back(env.needsStore() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                       : c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  }
  return devices;
}

GroupState& groupState() {
  static GroupState* s = new GroupState;
  return *s;
}

GroupState& initializedGroupState(GroupState& s) {
  if (!s.group)
    throw ConfigError("the default process group is not initialized: call ctorch::initProcessGroup() first");
  return s;
}

std::string seconds(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << static_cast<double>(d.count()) / 1000.0 << " s";
  return os.str();
}

// The process group over `root`, its keys under `prefix` (Python's "default_pg" for the group a run
// starts with), as Python's init_process_group builds it. `phase` is updated for error messages.
c10::intrusive_ptr<c10d::ProcessGroup> buildGroup(const c10::intrusive_ptr<c10d::Store>& root,
                                                  const std::string& prefix, const DistributedEnv& env,
                                                  const ProcessGroupOptions& options, const EnvLookup& lookup,
                                                  const GroupRecipe& recipe, std::string& phase) {
  // Python: "Use a PrefixStore to avoid accidental overrides of keys used by different systems".
  auto defaultPg = c10::make_intrusive<c10d::PrefixStore>(prefix, root);
  auto group = compat::groupStore(defaultPg);
  const bool debugDetail = c10d::debug_level() == c10d::DebugLevel::Detail;
  std::vector<compat::BoundBackend> backends;
  std::vector<compat::BackendPtr> sequenced;  // backends whose sequence number Python sets
  auto setSequenceNumbers = [&] {
    if constexpr (compat::kSequenceNumberFromStore)
      for (auto& b : sequenced) b->setSequenceNumberForGroup();
  };
  if (recipe.useGloo) {
    auto store = compat::backendStore(group, "cpu");
    auto gloo = compat::makeGloo(store, env.rank, env.worldSize, glooDevices(options, lookup, env), options.timeout());
    sequenced.push_back(gloo);
    compat::BackendPtr backend = gloo;
    if (debugDetail) {
      auto helper = compat::makeGloo(compat::wrapperHelperStore(defaultPg, store), env.rank, env.worldSize,
                                     glooDevices(options, lookup, env), options.timeout());
      backend = compat::wrapForDebug(backend, helper);
    }
    std::vector<c10::DeviceType> devices{c10::DeviceType::CPU};
    if (options.backend() == Backend::kGloo) devices.push_back(c10::DeviceType::CUDA);  // as Python
    backends.push_back({compat::BackendKind::kGloo, devices, backend});
  }
#ifdef USE_C10D_NCCL
  if (recipe.useNccl) {
    auto store = compat::backendStore(group, "cuda");
    auto nccl = compat::makeNccl(store, env.rank, env.worldSize, options.timeout());
    sequenced.push_back(nccl);
    if (debugDetail) {
      auto helper = compat::makeGloo(compat::wrapperHelperStore(defaultPg, store), env.rank, env.worldSize,
                                     glooDevices(options, lookup, env), options.timeout());
      nccl = compat::wrapForDebug(nccl, helper);
    }
    backends.push_back({compat::BackendKind::kNccl, {c10::DeviceType::CUDA}, nccl});
  }
#endif
  if (!compat::kSequenceNumberAfterInitBarrier) setSequenceNumbers();
  auto pg = compat::makeProcessGroup(group, env.rank, env.worldSize, options.timeout(), backends, recipe.defaultKind);

  phase = "waiting for every rank in the init barrier (timeout " + seconds(options.timeout()) + ")";
  const auto rule = compat::initBarrierRule(lookup("TORCH_DIST_INIT_BARRIER").value_or("") == "1");
  if (rule.enabled) storeBarrier(*defaultPg, rule, env.worldSize, options.timeout());
  if (compat::kSequenceNumberAfterInitBarrier) setSequenceNumbers();
  return pg;
}

// From a handler: the error of a failed set-up in one line naming the rank and the phase. A
// DistributedTimeout stays one, the library's other errors pass as they are, anything else (Gloo's,
// the store's) becomes a DistributedError.
[[noreturn]] void rethrowDuring(const std::string& where, const std::string& phase) {
  try {
    throw;
  } catch (const DistributedTimeout& e) {
    throw DistributedTimeout(where + ": " + phase + ": " + e.what());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string message = detail::messageOf(e);
    detail::throwDistributed(where + ": " + phase + " failed: " + message, message);
  }
}

} // namespace detail

const char* toString(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
  }
  return "?";
}

void ProcessGroupOptions::validate() const {
  if (timeout_.count() <= 0)
    throw ConfigError("ProcessGroupOptions::timeout must be positive, got " + std::to_string(timeout_.count()) + " ms");
  if (storeTimeout_ && storeTimeout_->count() <= 0)
    throw ConfigError("ProcessGroupOptions::storeTimeout must be positive, got " +
                      std::to_string(storeTimeout_->count()) + " ms");
  if (backend_ == Backend::kNccl && !kHasNccl)
    throw ConfigError("backend 'nccl' requested, but this LibTorch was built without NCCL (use gloo or auto)");
}

c10::intrusive_ptr<c10d::ProcessGroup> initProcessGroup(const ProcessGroupOptions& options) {
  c10d::setDebugLevelFromEnvironment();
  options.validate();
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.group)
    throw ConfigError("initProcessGroup() called twice: the default process group already exists "
                      "(call destroyProcessGroup() first)");

  const EnvLookup lookup = options.environment() ? options.environment() : processEnvironment();
  ignoreSigpipe();
  if (const auto spare = lookup(contract::env::kSpare)) s.control = detail::awaitSpareAssignment(*spare, lookup);
  const DistributedEnv env = detectDistributedEnv(lookup);
  const StopWatch stopWatch("rank " + std::to_string(env.rank) + "/" + std::to_string(env.worldSize));

  // Backends. 1.13 has one per group; 2.x registers Gloo for CPU next to NCCL for CUDA (Python's
  // default when no backend is named).
  bool useNccl = false, useGloo = true;
  switch (options.backend()) {
    case Backend::kAuto: useNccl = cudaUsable(); useGloo = CTORCH_TORCH_HAS_BACKENDS || !useNccl; break;
    case Backend::kGloo: break;
    case Backend::kNccl:
      if (!torch::cuda::is_available())
        throw ConfigError("backend 'nccl' requested, but no CUDA device is available");
      useNccl = true;
      useGloo = false;
      break;
  }
  const auto defaultKind = useNccl ? compat::BackendKind::kNccl : compat::BackendKind::kGloo;
  if (useNccl && options.bindCudaDevice()) bindCudaDevice(env);

  const std::string where = "rank " + std::to_string(env.rank) + "/" + std::to_string(env.worldSize);
  std::string phase;
  try {
    const auto storeTimeout = options.effectiveStoreTimeout();
    if (env.useAgentStore)
      phase = "connecting to the agent store at " + env.masterAddr + ":" + std::to_string(env.masterPort);
    else if (env.needsStore() && env.rank == 0)
      phase = "hosting the store at " + env.masterAddr + ":" + std::to_string(env.masterPort) +
              " and waiting for all " + std::to_string(env.worldSize) + " ranks to connect";
    else if (env.needsStore())
      phase = "connecting to the store at " + env.masterAddr + ":" + std::to_string(env.masterPort) +
              " (hosted by rank 0)";
    if (env.needsStore()) phase += " (store timeout " + detail::seconds(storeTimeout) + ")";
    auto [root, hostWaitedFullTimeout] = makeStore(env, storeTimeout);
    root->setTimeout(options.timeout());
    bool inPlace = lookup(contract::env::kRecovery).value_or("") == contract::kRecoveryInPlace && env.useAgentStore;
    const bool replacement = inPlace && !lookup(contract::env::kReplacement).value_or("").empty();
    std::int64_t generation = 0;
    std::string nonce;
    bool joining = false;
    if (inPlace && !s.control) {
      phase = "connecting to the job's coordinator (the control channel) at " + env.masterAddr + ":" +
              std::to_string(env.masterPort);
      try {
        // The coordinator welcomes this process once its agent said which process holds the rank
        // (at once, normally): a minute is far more than that takes, and far less than a store
        // timeout may be.
        s.control = detail::connectControl(env, lookup, std::min<std::chrono::milliseconds>(storeTimeout, std::chrono::minutes(1)));
      } catch (const std::exception& e) {
        if (replacement) throw;
        // Without the channel this rank cannot take part in a re-form: ctorchrun restarts the
        // group after a failure instead (it never hears this rank say it can recover in place).
        inPlace = false;
        std::cerr << "ctorch: rank " + std::to_string(env.rank) + ": in-place recovery is off for this run: " +
                         detail::messageOf(e) + "\n"
                  << std::flush;
      }
    }
    if (replacement) {
      phase = "joining the running group in place of a failed rank (timeout " + detail::seconds(options.timeout()) + ")";
      s.control->send(contract::control::message(contract::control::Type::kJoin));
      const detail::Joined joined = detail::awaitFormed(*s.control, env, -1, options.timeout());
      generation = joined.generation;
      nonce = joined.nonce;
      // Without survivors every rank starts afresh, as after a full restart.
      joining = joined.survivors > 0;
    }
    phase = "connecting to the other ranks (timeout " + detail::seconds(options.timeout()) + ")";
    if (hostWaitedFullTimeout)
      phase = "hosting the store at " + env.masterAddr + ":" + std::to_string(env.masterPort) + ": not all " +
              std::to_string(env.worldSize) + " ranks connected within the store timeout (" + detail::seconds(storeTimeout) +
              "); then " + phase;
    const detail::GroupRecipe recipe{useNccl, useGloo, defaultKind};
    auto pg = detail::buildGroup(root, contract::control::groupPrefix(generation, nonce), env, options, lookup, recipe, phase);
    if (replacement) detail::tellGroupBuilt(*s.control, env, generation);

    s.group = pg;
    s.store = root;
    s.prefix = contract::control::groupPrefix(generation, nonce);
    s.groupCount = 1;
    s.env = env;
    s.backendName = compat::backendName(defaultKind);
    s.options = options;
    s.lookup = lookup;
    s.inPlace = inPlace;
    s.joining = joining;
    s.generation = generation;
    s.recipe = recipe;
    return pg;
  } catch (...) {
    // A stop signal that interrupted a wait (EINTR) is a stop, not a failure.
    if (const int signo = stopSignal())
      throw Stopped(where + ": stopped by signal " + std::to_string(signo) +
                    " while the process group was set up: nothing to save yet");
    detail::rethrowDuring(where, phase);
  }
}

bool isInitialized() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return static_cast<bool>(s.group);
}

c10::intrusive_ptr<c10d::ProcessGroup> getDefaultGroup() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return detail::initializedGroupState(s).group;
}

const DistributedEnv& getDistributedEnv() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return detail::initializedGroupState(s).env;
}

std::string getBackendName() {
  detail::GroupState& s = detail::groupState();
  std::lock_guard<std::mutex> lock(s.mutex);
  return detail::initializedGroupState(s).backendName;
}

int getRank() { return getDistributedEnv().rank; }
int getWorldSize() { return getDistributedEnv().worldSize; }
int getLocalRank() { return getDistributedEnv().localRank; }
int getLocalWorldSize() { return getDistributedEnv().localWorldSize; }

void barrier() {
  auto group = getDefaultGroup();
  c10d::BarrierOptions opts;
  // NCCL's barrier allreduces on the device it is told (else it guesses rank % GPUs): the one
  // initProcessGroup made current (cuda:LOCAL_RANK, or cuda:0 when this process sees one GPU).
  if (getBackendName() == "nccl")
    opts.device_ids = {c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index()};
  try {
    group->barrier(opts)->wait();
  } catch (const std::exception& e) {
    const std::string message = detail::messageOf(e);
    detail::throwDistributed("rank " + std::to_string(getRank()) + ": barrier failed: " + message, message);
  }
}

void destroyProcessGroup() {
  detail::GroupState& s = detail::groupState();
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    group = std::move(s.group);
    store = std::move(s.store);
    s.control.reset();
    s.env = DistributedEnv{};
    s.backendName.clear();
    s.prefix.clear();
    s.groupCount = 1;
  }
  // Released here, outside the lock: the group's destructor joins its worker threads.
}

} // namespace ctorch
