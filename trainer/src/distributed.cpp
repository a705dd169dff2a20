#include "ctorch/distributed.hpp"

#include "ctorch/compat.hpp"
#include "error_text.hpp"

#include <ctorch/contract/control_auth.hpp>
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
  c10::intrusive_ptr<c10d::Store> raw;    // the TCPStore without the agent prefix (in-place keys)
  DistributedEnv env;
  std::string backendName;
  // What re-forming the group in place needs (ctorchrun --recovery in-place).
  ProcessGroupOptions options;
  EnvLookup lookup;
  GroupRecipe recipe;
  bool inPlace = false;
  bool joining = false;          // a replacement that has not received the training state yet
  std::int64_t generation = 0;
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
  // The TCPStore itself, without the agent-store prefix (which depends on the PyTorch release): the
  // in-place recovery keys live here, where the launcher finds them whatever the release.
  c10::intrusive_ptr<c10d::Store> raw;
};

RootStore makeStore(const DistributedEnv& env, std::chrono::milliseconds timeout) {
  if (!env.needsStore()) {
    auto hash = c10::make_intrusive<c10d::HashStore>();
    return {hash, false, hash};
  }
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.masterPort);
  opts.numWorkers = static_cast<std::size_t>(env.worldSize);
  opts.timeout = timeout;
  compat::setUseLibUV(opts, env.useLibUV);
  if (env.useAgentStore) {
    opts.isServer = false;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(env.masterAddr, opts);
    return {compat::agentStore(tcp, contract::agentStorePrefix(env.restartCount)), false, tcp};
  }
  opts.isServer = env.rank == 0;
  opts.waitWorkers = true;
  opts.multiTenant = true;
  const auto start = std::chrono::steady_clock::now();
  auto tcp = c10::make_intrusive<c10d::TCPStore>(env.masterAddr, opts);
  const bool waitedFull = opts.isServer && std::chrono::steady_clock::now() - start >= timeout;
  return {tcp, waitedFull, tcp};
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

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }

// This process holds `rank` in generation g: its pid, for an eviction request naming it.
void arrive(c10d::Store& root, std::int64_t generation, int rank) {
  root.set(contract::inplace::memberKey(generation, rank), bytesOf(std::to_string(::getpid())));
}

// Asks the agents to kill the ranks of generation `failed` that did not say they are alive (they
// stopped answering: a hung process, or one the survivors cannot reach). A rank that died already
// is named with its old pid, which its agent ignores.
// The job's control key (CTORCH_CONTROL_KEY, hex) that signs in-place recovery's commands; empty
// when ctorchrun gave none.
std::string controlKeyFrom(const EnvLookup& lookup) {
  const auto hex = lookup(contract::env::kControlKey);
  if (!hex) return "";
  return contract::auth::fromHex(*hex).value_or("");
}

void requestEvictions(c10d::Store& root, std::int64_t failed, int worldSize, const std::string& key) {
  if (key.empty()) {
    std::cerr << "ctorch: cannot ask for silent ranks to be evicted: no " << contract::env::kControlKey
              << " to sign the request (not started by ctorchrun --recovery in-place?)" << std::endl;
    return;
  }
  for (int r = 0; r < worldSize; ++r) {
    if (root.check({contract::inplace::aliveKey(failed, r)})) continue;
    const std::string member = contract::inplace::memberKey(failed, r);
    if (!root.check({member})) continue;
    const auto bytes = root.get(member);
    long pid = 0;
    try {
      pid = std::stol(std::string(bytes.begin(), bytes.end()));
    } catch (const std::exception&) {
      continue;  // not a pid: nothing of ours to evict
    }
    const std::string evict = contract::inplace::evictKey(r);
    root.set(evict, bytesOf(contract::auth::signCommand(key, evict, contract::inplace::evictionPayload(pid, failed))));
  }
}

// Whether every rank of generation `failed` said it is alive and waits to re-form.
bool allAlive(c10d::Store& root, std::int64_t failed, int worldSize) {
  std::vector<std::string> keys;
  for (int r = 0; r < worldSize; ++r) keys.push_back(contract::inplace::aliveKey(failed, r));
  return root.check(keys);
}

struct Joined {
  std::int64_t generation = 0;
  std::int64_t survivors = 0;  // ranks that kept their training state
};

// Waits until every rank has arrived at the newest generation, and returns it. A replacement
// (failed < 0) first adds a generation of its own; a survivor of generation `failed` waits for a
// newer one (a replacement's), asking for the silent ranks to be evicted after `timeout` / 2 — and
// from then on gives the replacements a whole `timeout` to arrive (their agents start them only
// then, and a LibTorch process on a loaded machine takes more than the half left: a chaos run under
// a parallel CTest had a survivor give up 1.3 s after the replacement was started).
Joined joinGeneration(c10d::Store& root, const DistributedEnv& env, std::int64_t failed,
                            std::chrono::milliseconds timeout, const std::string& controlKey) {
  namespace ip = contract::inplace;
  const auto start = std::chrono::steady_clock::now();
  auto deadline = start + timeout;
  const auto evictAt = start + timeout / 2;
  bool evicted = false;
  if (failed < 0) root.add(ip::kGenerationKey, 1);
  else root.set(ip::aliveKey(failed, env.rank), bytesOf(std::to_string(::getpid())));
  std::int64_t arrivedAt = -1;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    const std::int64_t newest = root.add(ip::kGenerationKey, 0);
    if (newest > failed && newest != arrivedAt) {
      arrive(root, newest, env.rank);
      if (failed >= 0) root.add(ip::survivorsKey(newest), 1);
      root.add(ip::arrivedKey(newest), 1);
      arrivedAt = newest;
    }
    if (arrivedAt >= 0 && arrivedAt == newest && root.add(ip::arrivedKey(newest), 0) >= env.worldSize)
      return Joined{newest, root.add(ip::survivorsKey(newest), 0)};
    if (now >= deadline) {
      const std::string where = arrivedAt < 0 ? "no replacement for the failed rank(s) came"
                                              : "only " + std::to_string(root.add(ip::arrivedKey(arrivedAt), 0)) + " of " +
                                                    std::to_string(env.worldSize) + " ranks arrived at group generation " +
                                                    std::to_string(arrivedAt);
      throw DistributedTimeout("in-place recovery timed out after " +
                               seconds(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) + ": " +
                               where);
    }
    if (failed >= 0 && arrivedAt < 0 && newest == failed && env.rank == 0 && allAlive(root, failed, env.worldSize)) {
      // Every rank of the failed generation is alive and here (the collective failed without a
      // death: a broken connection, a desynchronised step): they re-form among themselves. The
      // lowest rank opens the next generation once; a replacement that opened it meanwhile is
      // welcome too.
      root.add(ip::kGenerationKey, 1);
      continue;
    }
    if (failed >= 0 && !evicted && now >= evictAt) {
      requestEvictions(root, failed, env.worldSize, controlKey);
      evicted = true;
      deadline = std::max(deadline, now + timeout);
    }
    // Short: the survivors wait on this while the job stands still (larger worlds poll less).
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + 100 * env.worldSize));
  }
}

// A spare worker (ctorchrun --spare-workers): waits, connected to the workers' store, until its agent
// hands it a failed worker's rank, then makes the assignment this process's environment (the rest of
// the program, and initProcessGroup, read it from there). Waits as long as the job runs: the agent
// kills unused spares when the group ends. Anyone who reaches the store could write the assignment's
// key, so only a value signed with the job's key counts, and it carries numbers only, each checked:
// the error file follows from CTORCH_SPARE_LOG_DIR and LOCAL_RANK, never from the store. A stop
// signal while it waits ends it (ctorch::Stopped): it holds nothing to save.
void awaitSpareAssignment(const std::string& id, const EnvLookup& lookup) {
  namespace cenv = contract::env;
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
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(portNumber);
  opts.isServer = false;
  opts.timeout = std::chrono::seconds(60);
  compat::setUseLibUV(opts, lookup("USE_LIBUV").value_or("") == "1");
  auto store = c10::make_intrusive<c10d::TCPStore>(addr, opts);
  const std::string key = contract::inplace::spareKey(id);
  std::set<std::string> refused;
  std::string payload;
  // Polled (a few ms: what a takeover waits on): a timed-out store wait would leave 1.13's client
  // out of step with the server.
  for (;;) {
    if (const int signo = stopSignal())
      throw Stopped("spare worker '" + id + "' stopped by signal " + std::to_string(signo) +
                    " before it took a rank over");
    if (store->check({key})) {
      const auto bytes = store->get(key);
      const std::string value(bytes.begin(), bytes.end());
      if (const auto signedPayload = contract::auth::verifyCommand(controlKey, key, value)) {
        payload = *signedPayload;
        break;
      }
      if (refused.insert(value).second)
        std::cerr << "ctorch: spare worker '" << id << "': ignoring " << key
                  << " in the workers' store: it is not signed with this job's key (forged, or another job's)"
                  << std::endl;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  std::map<std::string, int> assigned;
  std::stringstream lines(payload);
  std::string line;
  while (std::getline(lines, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string name = line.substr(0, eq), text = line.substr(eq + 1);
    bool known = false;
    for (const char* allowed : contract::inplace::kSpareAssigned) known = known || name == allowed;
    if (!known) throw DistributedError("spare worker '" + id + "': its assignment sets '" + name + "', which is not a rank variable");
    int value = -1;
    try {
      std::size_t used = 0;
      value = std::stoi(text, &used);
      if (used != text.size()) value = -1;
    } catch (const std::exception&) {
    }
    const int limit = name == cenv::kLocalRank ? localWorldSize : name == cenv::kReplacement ? INT_MAX : worldSize;
    if (value < 0 || value >= limit)
      throw DistributedError("spare worker '" + id + "': its assignment's " + name + " '" + text.substr(0, 20) +
                             "' is not a number in [0, " + std::to_string(limit) + ")");
    assigned[name] = value;
  }
  if (!assigned.count(cenv::kRank) || !assigned.count(cenv::kLocalRank))
    throw DistributedError("spare worker '" + id + "': its assignment names no RANK and LOCAL_RANK");
  for (const auto& [name, value] : assigned) ::setenv(name.c_str(), std::to_string(value).c_str(), 1);
  if (const auto dir = lookup(cenv::kSpareLogDir); dir && !dir->empty()) {
    const auto file = std::filesystem::path(*dir) / std::to_string(assigned[cenv::kLocalRank]) / "error.json";
    ::setenv(cenv::kErrorFile, file.c_str(), 1);
  } else {
    ::unsetenv(cenv::kErrorFile);
  }
  ::unsetenv(cenv::kSpare);
  ::unsetenv(cenv::kSpareLogDir);
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
    awaitSpareAssignment(id, processEnvironment());
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
  if (const auto spare = lookup(contract::env::kSpare)) awaitSpareAssignment(*spare, lookup);
  const DistributedEnv env = detectDistributedEnv(lookup);

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
    auto [root, hostWaitedFullTimeout, raw] = makeStore(env, storeTimeout);
    root->setTimeout(options.timeout());
    const bool inPlace = lookup(contract::env::kRecovery).value_or("") == contract::kRecoveryInPlace && env.useAgentStore;
    const bool replacement = inPlace && !lookup(contract::env::kReplacement).value_or("").empty();
    std::int64_t generation = 0;
    bool joining = false;
    if (replacement) {
      phase = "joining the running group in place of a failed rank (timeout " + seconds(options.timeout()) + ")";
      const Joined joined = joinGeneration(*raw, env, -1, options.timeout(), controlKeyFrom(lookup));
      generation = joined.generation;
      // Without survivors every rank starts afresh, as after a full restart.
      joining = joined.survivors > 0;
    } else if (inPlace) {
      arrive(*raw, 0, env.rank);
    }
    phase = "connecting to the other ranks (timeout " + seconds(options.timeout()) + ")";
    if (hostWaitedFullTimeout)
      phase = "hosting the store at " + env.masterAddr + ":" + std::to_string(env.masterPort) + ": not all " +
              std::to_string(env.worldSize) + " ranks connected within the store timeout (" + seconds(storeTimeout) +
              "); then " + phase;
    const GroupRecipe recipe{useNccl, useGloo, defaultKind};
    auto pg = buildGroup(root, contract::inplace::groupPrefix(generation), env, options, lookup, recipe, phase);

    s.group = pg;
    s.store = root;
    s.raw = raw;
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
    s.raw.reset();
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
  c10::intrusive_ptr<c10d::Store> root, raw;
  DistributedEnv env;
  ProcessGroupOptions options;
  EnvLookup lookup;
  GroupRecipe recipe;
  std::int64_t failed = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    initializedState();
    if (!s.inPlace)
      throw ConfigError("reformProcessGroup() needs a job launched with ctorchrun --recovery in-place");
    old = std::move(s.group);
    root = s.store;
    raw = s.raw;
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
    const std::int64_t generation =
        joinGeneration(*raw, env, failed, options.timeout(), controlKeyFrom(lookup)).generation;
    phase = "connecting to the other ranks of group generation " + std::to_string(generation) + " (timeout " +
            seconds(options.timeout()) + ")";
    auto pg = buildGroup(root, contract::inplace::groupPrefix(generation), env, options, lookup, recipe, phase);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.group = pg;
    s.generation = generation;
    return pg;
  } catch (...) {
    rethrowDuring(where, phase);
  }
}

} // namespace ctorch
