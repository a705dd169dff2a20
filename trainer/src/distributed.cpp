#include "ctorch/distributed.hpp"

#include "ctorch/compat.hpp"
#include "error_text.hpp"

#include <ctorch/contract/control_auth.hpp>
#include <ctorch/contract/control_client.hpp>
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

// Which backends a group has (decided once, from the options and the machine).
struct GroupRecipe {
  bool useNccl = false;
  bool useGloo = true;
  compat::BackendKind defaultKind = compat::BackendKind::kGloo;
};

struct State {
  std::mutex mutex;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;  // keeps a TCPStore server hosted here alive
  DistributedEnv env;
  std::string backendName;
  // What re-forming the group in place needs (ctorchrun --recovery in-place).
  ProcessGroupOptions options;
  EnvLookup lookup;
  GroupRecipe recipe;
  bool inPlace = false;
  bool joining = false;          // a replacement that has not received the training state yet
  std::int64_t generation = 0;
  // In-place recovery's authenticated channel to the job's coordinator (contract/control_client.hpp).
  std::unique_ptr<contract::control::BlockingClient> control;
};

// Never destroyed: tearing down Gloo threads and a TCPStore server during static destruction, after
// LibTorch's own statics may be gone, crashes at exit. destroyProcessGroup() is the orderly way.
State& state() {
  static State* s = new State;
  return *s;
}

std::string seconds(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << static_cast<double>(d.count()) / 1000.0 << " s";
  return os.str();
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, sep))
    if (!item.empty()) out.push_back(item);
  return out;
}

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
      throw DistributedTimeout("timed out after " + seconds(timeout) + " in the init barrier: " +
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

// The job's control key (CTORCH_CONTROL_KEY, hex) that proves this process on the control channel;
// empty when ctorchrun gave none.
std::string controlKeyFrom(const EnvLookup& lookup) {
  const auto hex = lookup(contract::env::kControlKey);
  if (!hex) return "";
  return contract::auth::fromHex(*hex).value_or("");
}

bool stopRequested() { return stopSignal() != 0; }

std::uint64_t incarnationFrom(const EnvLookup& lookup) {
  const auto text = lookup(contract::env::kIncarnation).value_or("");
  const auto incarnation = contract::control::parseIncarnation(text);
  if (!incarnation)
    throw ConfigError(std::string(contract::env::kIncarnation) + " '" + text.substr(0, 32) +
                      "' is not 16 hex digits: this process was not started by ctorchrun --recovery in-place");
  return *incarnation;
}

// This worker on the job's control channel, behind the workers' store (node rank 0's ctorchrun).
std::unique_ptr<contract::control::BlockingClient> connectControl(const DistributedEnv& env, const EnvLookup& lookup,
                                                                  std::chrono::milliseconds timeout) {
  const std::string key = controlKeyFrom(lookup);
  if (key.empty())
    throw ConfigError(std::string("no ") + contract::env::kControlKey + " to prove this process on the control channel");
  return std::make_unique<contract::control::BlockingClient>(
      env.masterAddr, env.masterPort, key,
      contract::control::workerHello(env.rank, incarnationFrom(lookup), static_cast<long>(::getpid())), timeout,
      stopRequested);
}

struct Joined {
  std::int64_t generation = 0;
  std::string nonce;           // the group's key nonce (hex)
  std::int64_t survivors = 0;  // ranks that kept their training state
};

// Waits on the control channel until the coordinator re-forms the group. A replacement said it joins;
// a survivor that it waits in the re-form of the failed generation, and every `timeout` / 2 it asks
// the coordinator to have the processes that stopped answering killed (their agents replace them).
// While a replacement is on its way (a LibTorch process on a loaded machine takes longer to start
// than the collectives' timeout), the wait goes on a `timeout` past the coordinator's last word:
// each replacement costs one of ctorchrun's restarts, which bounds it, and so does kMaxWaits.
Joined awaitFormed(contract::control::BlockingClient& control, const DistributedEnv& env, std::int64_t failed,
                   std::chrono::milliseconds timeout) {
  namespace cc = contract::control;
  using Clock = std::chrono::steady_clock;
  constexpr int kMaxWaits = 10;
  const auto start = Clock::now();
  const auto last = start + kMaxWaits * timeout;
  auto deadline = start + timeout;
  auto nextEviction = start + timeout / 2;
  std::string missing = "no rank said why";
  for (;;) {
    auto m = control.receive(failed < 0 ? deadline : std::min(deadline, nextEviction));
    if (const int signo = stopSignal())
      throw Stopped("rank " + std::to_string(env.rank) + " stopped by signal " + std::to_string(signo) +
                    " while the group re-formed in place");
    const auto now = Clock::now();
    if (m && m->type == cc::Type::kFormed) return Joined{m->generation, m->text, m->value};
    if (m && m->type == cc::Type::kEvicting) {
      if (!m->text.empty()) missing = m->text;
      if (m->value > 0 || m->value2 > 0) deadline = std::min(last, std::max(deadline, now + timeout));
      continue;
    }
    if (m) continue;  // nothing else is for a waiting worker
    if (now >= deadline)
      throw DistributedTimeout("in-place recovery timed out after " +
                               seconds(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) +
                               ": the group did not re-form (" + missing + ")");
    if (failed >= 0 && now >= nextEviction) {
      cc::Message ask = cc::message(cc::Type::kEvictSilent);
      ask.generation = failed;
      ask.value = (timeout / 2).count();
      control.send(ask, deadline);
      nextEviction = now + timeout / 2;
    }
  }
}

// A spare worker (ctorchrun --spare-workers): waits on the control channel until the coordinator
// hands it a failed worker's rank (its agent chose it), then makes the assignment this process's
// environment (the rest of the program, and initProcessGroup, read it from there) and returns the
// channel, which from then on speaks for that rank. Waits as long as the job runs: the agent kills
// unused spares when the group ends. The assignment arrives authenticated on this connection only
// and carries numbers only, each checked: the error file follows from CTORCH_SPARE_LOG_DIR and
// LOCAL_RANK. A stop signal while it waits ends it (ctorch::Stopped): it holds nothing to save.
std::unique_ptr<contract::control::BlockingClient> awaitSpareAssignment(const std::string& id, const EnvLookup& lookup) {
  namespace cenv = contract::env;
  namespace cc = contract::control;
  const std::string controlKey = controlKeyFrom(lookup);
  if (controlKey.empty() || !contract::isTruthy(lookup(cenv::kUseAgentStore).value_or("")))
    throw ConfigError(std::string(cenv::kSpare) + "='" + id + "' is set, but this process was not started as a spare "
                      "by ctorchrun --spare-workers (it has no " + cenv::kControlKey + " or agent store): unset " +
                      cenv::kSpare);
  const std::string addr = lookup(cenv::kMasterAddr).value_or("");
  const std::string port = lookup(cenv::kMasterPort).value_or("");
  int portNumber = 0;
  try {
    portNumber = std::stoi(port);
  } catch (const std::exception&) {
  }
  if (addr.empty() || portNumber <= 0 || portNumber > 65535)
    throw ConfigError("spare worker '" + id + "': MASTER_ADDR/MASTER_PORT ('" + addr + "', '" + port +
                      "') do not name the workers' store");
  auto number = [&](const char* name) {
    try {
      return std::stoi(lookup(name).value_or(""));
    } catch (const std::exception&) {
      throw ConfigError("spare worker '" + id + "': " + name + " is not a number");
    }
  };
  const int worldSize = number(cenv::kWorldSize), localWorldSize = number(cenv::kLocalWorldSize);
  const int nodeRank = number(cenv::kGroupRank);
  auto control = std::make_unique<cc::BlockingClient>(
      addr, portNumber, controlKey, cc::spareHello(nodeRank, id, incarnationFrom(lookup), static_cast<long>(::getpid())),
      std::chrono::seconds(60), stopRequested);
  std::optional<cc::Message> assignment;
  while (!assignment) {
    if (const int signo = stopSignal())
      throw Stopped("spare worker '" + id + "' stopped by signal " + std::to_string(signo) +
                    " before it took a rank over");
    auto m = control->receive(std::chrono::steady_clock::now() + std::chrono::seconds(1));
    if (m && m->type == cc::Type::kAssign) assignment = m;
  }
  auto check = [&](const char* name, std::int64_t value, std::int64_t limit) {
    if (value < 0 || value >= limit)
      throw DistributedError("spare worker '" + id + "': its assignment's " + name + " " + std::to_string(value) +
                             " is not in [0, " + std::to_string(limit) + ")");
    return std::to_string(value);
  };
  const std::string rank = check(cenv::kRank, assignment->rank, worldSize);
  ::setenv(cenv::kRank, rank.c_str(), 1);
  ::setenv(cenv::kRoleRank, rank.c_str(), 1);
  const std::string localRank = check(cenv::kLocalRank, assignment->value, localWorldSize);
  ::setenv(cenv::kLocalRank, localRank.c_str(), 1);
  ::setenv(cenv::kReplacement, check(cenv::kReplacement, assignment->value2, INT_MAX).c_str(), 1);
  if (const auto dir = lookup(cenv::kSpareLogDir); dir && !dir->empty()) {
    const auto file = std::filesystem::path(*dir) / localRank / "error.json";
    ::setenv(cenv::kErrorFile, file.c_str(), 1);
  } else {
    ::unsetenv(cenv::kErrorFile);
  }
  ::unsetenv(cenv::kSpare);
  ::unsetenv(cenv::kSpareLogDir);
  return control;
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

// A peer that dies mid-collective closes its sockets; Gloo's writes to them (writev, without
// MSG_NOSIGNAL) then raise SIGPIPE, whose default action ends this process too: a survivor must get
// an error instead (and recover in place). Python ignores SIGPIPE at start-up, so its ranks do get
// one; so do ours. A handler or disposition the program chose is kept.
void ignoreSigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

State& initializedState() {
  State& s = state();
  if (!s.group)
    throw ConfigError("the default process group is not initialized: call ctorch::initProcessGroup() first");
  return s;
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

// A preloaded worker (ctorchrun --preloaded-workers) waits for its assignment here, while the program
// starts: LibTorch's libraries are loaded and initialised (the slow part of a new process: ~0.4 s of
// a new worker's ~0.5 s), the program's main() has not run. With its rank variables set it goes on
// and runs the program from the start, as the replacement a new process would have been. An error
// ends it in one line (the agent then starts a new process for the next failure).
bool awaitPreloadedAssignment() {
  const char* id = std::getenv(contract::env::kSpare);
  const char* preloaded = std::getenv(contract::env::kPreloaded);
  if (!id || !preloaded || std::string(preloaded) != "1") return false;
  ::unsetenv(contract::env::kPreloaded);
  try {
    state().control = awaitSpareAssignment(id, processEnvironment());
  } catch (const std::exception& e) {
    std::cerr << std::string("ctorch: preloaded worker: ") + e.what() + "\n" << std::flush;
    std::_Exit(1);
  }
  return true;
}
[[maybe_unused]] const bool gPreloadedAssigned = awaitPreloadedAssignment();

} // namespace

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
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.group)
    throw ConfigError("initProcessGroup() called twice: the default process group already exists "
                      "(call destroyProcessGroup() first)");

  const EnvLookup lookup = options.environment() ? options.environment() : processEnvironment();
  ignoreSigpipe();
  if (const auto spare = lookup(contract::env::kSpare)) s.control = awaitSpareAssignment(*spare, lookup);
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
    if (env.needsStore()) phase += " (store timeout " + seconds(storeTimeout) + ")";
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
        s.control = connectControl(env, lookup, std::min<std::chrono::milliseconds>(storeTimeout, std::chrono::minutes(1)));
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
      phase = "joining the running group in place of a failed rank (timeout " + seconds(options.timeout()) + ")";
      s.control->send(contract::control::message(contract::control::Type::kJoin));
      const Joined joined = awaitFormed(*s.control, env, -1, options.timeout());
      generation = joined.generation;
      nonce = joined.nonce;
      // Without survivors every rank starts afresh, as after a full restart.
      joining = joined.survivors > 0;
    }
    phase = "connecting to the other ranks (timeout " + seconds(options.timeout()) + ")";
    if (hostWaitedFullTimeout)
      phase = "hosting the store at " + env.masterAddr + ":" + std::to_string(env.masterPort) + ": not all " +
              std::to_string(env.worldSize) + " ranks connected within the store timeout (" + seconds(storeTimeout) +
              "); then " + phase;
    const GroupRecipe recipe{useNccl, useGloo, defaultKind};
    auto pg = buildGroup(root, contract::control::groupPrefix(generation, nonce), env, options, lookup, recipe, phase);

    s.group = pg;
    s.store = root;
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
    rethrowDuring(where, phase);
  }
}

bool isInitialized() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return static_cast<bool>(s.group);
}

c10::intrusive_ptr<c10d::ProcessGroup> getDefaultGroup() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return initializedState().group;
}

const DistributedEnv& getDistributedEnv() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return initializedState().env;
}

std::string getBackendName() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return initializedState().backendName;
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
  State& s = state();
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    group = std::move(s.group);
    store = std::move(s.store);
    s.control.reset();
    s.env = DistributedEnv{};
    s.backendName.clear();
  }
  // Released here, outside the lock: the group's destructor joins its worker threads.
}

bool inPlaceRecoveryEnabled() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.group && s.inPlace;
}

std::int64_t groupGeneration() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return initializedState().generation;
}

void declareInPlaceRecovery(bool capable, const std::string& why) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.group || !s.inPlace || !s.control) return;
  namespace cc = contract::control;
  cc::Message m = cc::message(cc::Type::kDeclare);
  m.value = capable ? 1 : 0;
  m.text = why.substr(0, 200);
  try {
    s.control->send(m);
  } catch (const std::exception& e) {
    // The coordinator is gone (its host was lost): ctorchrun restarts the group after a failure.
    std::cerr << "ctorch: rank " + std::to_string(s.env.rank) + ": could not tell the coordinator: " + e.what() + "\n"
              << std::flush;
  }
}

namespace detail {
bool joiningInPlace() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.group && s.joining;
}

void joinedInPlace() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.joining = false;
}
} // namespace detail

c10::intrusive_ptr<c10d::ProcessGroup> reformProcessGroup() {
  State& s = state();
  c10::intrusive_ptr<c10d::ProcessGroup> old;
  c10::intrusive_ptr<c10d::Store> root;
  DistributedEnv env;
  ProcessGroupOptions options;
  EnvLookup lookup;
  GroupRecipe recipe;
  std::int64_t failed = 0;
  bool holdsState = true;
  contract::control::BlockingClient* control = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    initializedState();
    if (!s.inPlace || !s.control)
      throw ConfigError("reformProcessGroup() needs a job launched with ctorchrun --recovery in-place");
    control = s.control.get();
    holdsState = !s.joining;
    old = std::move(s.group);
    root = s.store;
    env = s.env;
    options = s.options;
    lookup = s.lookup;
    recipe = s.recipe;
    failed = s.generation;
  }
  // Closes this rank's connections of the failed group (when nothing else holds it): a peer still
  // waiting on one of them fails now instead of at its timeout, and comes to re-form too.
  old.reset();
  const std::string where = "rank " + std::to_string(env.rank) + "/" + std::to_string(env.worldSize);
  std::string phase = "waiting for the group to re-form after generation " + std::to_string(failed) + " failed";
  try {
    namespace cc = contract::control;
    cc::Message reform = cc::message(cc::Type::kReform);
    reform.generation = failed;
    reform.value = holdsState ? 1 : 0;
    control->send(reform);
    const Joined joined = awaitFormed(*control, env, failed, options.timeout());
    const std::int64_t generation = joined.generation;
    phase = "connecting to the other ranks of group generation " + std::to_string(generation) + " (timeout " +
            seconds(options.timeout()) + ")";
    auto pg = buildGroup(root, cc::groupPrefix(generation, joined.nonce), env, options, lookup, recipe, phase);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.group = pg;
    s.generation = generation;
    return pg;
  } catch (...) {
    rethrowDuring(where, phase);
  }
}

} // namespace ctorch
