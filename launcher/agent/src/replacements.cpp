// --recovery in-place, the agent's hands: replacements, spares, eviction requests and the
// re-form's progress, through the workers' store (replacements.hpp).
#include "replacements.hpp"

#include "ctorch/contract/control_auth.hpp"
#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/failure_summary.hpp"
#include "log.hpp"

#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace ctorch::launcher {

namespace {
// How often the agent looks for eviction requests: a hung worker is found by its peers'
// collective timeout first, so this only adds a fraction of a second.
constexpr std::chrono::milliseconds kEvictPoll{200};
} // namespace

Replacements::Replacements(const LaunchConfig& config, ProcessContext& processes, WorkerLogs& logs)
    : config_(config), processes_(processes), logs_(logs) {
  if (config_.inPlaceRecovery) {
    timerFd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (timerFd_ < 0) throwErrno("timerfd_create");
  }
}

Replacements::~Replacements() {
  if (timerFd_ >= 0) ::close(timerFd_);
}

void Replacements::beginGroup(const RendezvousInfo& info, int restartCount, const std::vector<WorkerLaunch>& launches,
                              const std::vector<WorkerLogs::WorkerFiles>& files) {
  info_ = info;
  restartCount_ = restartCount;
  launches_ = launches;
  files_ = files;
  reformBase_ = -1;
  spares_.clear();
  workerStore_.reset();
  workerStoreBackoff_ = std::chrono::milliseconds(0);
  workerStoreRetryAt_ = {};
  for (int i = 0; i < config_.spareWorkers; ++i) startSpare(false);
  for (int i = 0; i < config_.preloadedWorkers; ++i) startSpare(true);
  if (timerFd_ >= 0) {
    itimerspec every{};
    every.it_interval.tv_nsec = every.it_value.tv_nsec = kEvictPoll.count() * 1000000;
    if (::timerfd_settime(timerFd_, 0, &every, nullptr) != 0) throwErrno("timerfd_settime");
  }
}

void Replacements::endGroup() {
  if (timerFd_ >= 0) {
    itimerspec off{};
    ::timerfd_settime(timerFd_, 0, &off, nullptr);
  }
  workerStore_.reset();
}

void Replacements::spareEnded(const WorkerExit& e) {
  auto it = std::find_if(spares_.begin(), spares_.end(), [&](const Spare& s) { return s.tag == e.localRank; });
  if (it == spares_.end()) return;
  log("agent").warn("{} worker {} (pid {}) ended before it was needed: {}{}", it->preloaded ? "preloaded" : "spare", it->id,
                    e.pid, e.status.describe(),
                    it->preloaded ? " (a preloaded worker waits only in a program linked with ctorch's library: "
                                  "--preloaded-workers 0 for any other)"
                                : "");
  spares_.erase(it);
}

void Replacements::replace(int localRank, const GroupMonitor& monitor, RestartPolicy& policy) {
  auto it = std::find_if(launches_.begin(), launches_.end(), [&](const WorkerLaunch& w) { return w.localRank == localRank; });
  if (it == launches_.end()) return;
  policy.noteReplacement();
  WorkerLaunch w = *it;
  const std::string mark = std::string(contract::env::kReplacement) + "=";
  w.env.erase(std::remove_if(w.env.begin(), w.env.end(), [&](const std::string& e) { return e.rfind(mark, 0) == 0; }),
              w.env.end());
  w.env.push_back(mark + std::to_string(policy.replacementsUsed()));
  // The failed worker's recorded error is logged now; the file is the replacement's from here on.
  if (static_cast<std::size_t>(localRank) < files_.size()) {
    const auto& errorFile = files_[static_cast<std::size_t>(localRank)].errorFile;
    if (auto error = readErrorFile(errorFile)) log("agent").warn("worker rank {} had recorded: {}", w.globalRank, error->message.substr(0, error->message.find('\n')));
    std::error_code ec;
    std::filesystem::remove(errorFile, ec);
  }
  if (!monitor.reformPending() || reformBase_ < 0) {
    try {
      reformBase_ = workerStore().add(contract::inplace::kGenerationKey, 0);
    } catch (const std::exception&) {
      workerStore_.reset();
      reformBase_ = -1;
    }
  }
  log("agent").warn("replacing worker rank {} (local {}) in place; the other workers keep running "
                    "(replacement {}, {} of {} restarts used)",
                    w.globalRank, localRank, policy.replacementsUsed(), policy.restartsUsed(), config_.maxRestarts);
  if (!handToSpare(w)) processes_.add(w);
}

bool Replacements::storeAnswers() {
  try {
    workerStore().check({contract::inplace::kGenerationKey});
    return true;
  } catch (const std::exception& e) {
    workerStore_.reset();
    log("agent").warn("the workers' store does not answer ({}): restarting the group instead of replacing the "
                      "worker in place", e.what());
    return false;
  }
}

bool Replacements::joinedReform(int rank) {
  if (reformBase_ < 0) return true;
  try {
    store::TcpStoreClient& store = workerStore();
    if (store.check({contract::inplace::aliveKey(reformBase_, rank)})) return true;
    const std::int64_t newest = store.add(contract::inplace::kGenerationKey, 0);
    for (std::int64_t g = reformBase_ + 1; g <= newest; ++g)
      if (store.check({contract::inplace::memberKey(g, rank)})) return true;
    return false;
  } catch (const std::exception&) {
    workerStore_.reset();
    return true;  // cannot tell: the store's loss is handled as such (replaceable)
  }
}

void Replacements::checkReformed(store::TcpStoreClient& store, GroupMonitor& monitor) {
  if (!monitor.reformPending() || reformBase_ < 0) return;
  const std::int64_t newest = store.add(contract::inplace::kGenerationKey, 0);
  if (newest > reformBase_ &&
      store.add(contract::inplace::arrivedKey(newest), 0) >= info_.worldSize) {
    monitor.noteReformed();
    reformBase_ = -1;
    log("agent").debug("the group re-formed at generation {}", newest);
  }
}

store::TcpStoreClient& Replacements::workerStore() {
  if (!workerStore_) {
    store::TcpStoreClientOptions o;
    o.timeout = std::chrono::milliseconds(500);
    o.operationTimeout = std::chrono::seconds(1);
    o.retryConnect = false;
    workerStore_ = std::make_unique<store::TcpStoreClient>(info_.storeHost, static_cast<std::uint16_t>(info_.storePort), o);
  }
  return *workerStore_;
}

// A spare is a worker of this node without a rank yet: the contract's variables of local rank 0
// less the rank ones (contract::inplace::kSpareAssigned), and CTORCH_SPARE naming it. A preloaded worker is
// a spare that waits before its program's main() (CTORCH_PRELOADED): ctorch's library waits there.
void Replacements::startSpare(bool preloaded) {
  if (launches_.empty()) return;
  Spare spare;
  spare.preloaded = preloaded;
  ++sparesStarted_;
  spare.id = std::to_string(info_.nodeRank) + "-" + std::to_string(restartCount_) +
             "-" + std::to_string(sparesStarted_);
  spare.tag = -sparesStarted_;
  WorkerLaunch w = launches_.front();
  w.localRank = spare.tag;
  w.globalRank = -1;
  auto assigned = [](const std::string& entry) {
    if (entry.rfind(std::string(contract::env::kErrorFile) + "=", 0) == 0) return true;  // local rank 0's
    for (const char* name : contract::inplace::kSpareAssigned)
      if (entry.rfind(std::string(name) + "=", 0) == 0) return true;
    return false;
  };
  w.env.erase(std::remove_if(w.env.begin(), w.env.end(), assigned), w.env.end());
  w.env.push_back(std::string(contract::env::kSpare) + "=" + spare.id);
  if (preloaded) w.env.push_back(std::string(contract::env::kPreloaded) + "=1");
  // Its error file once it holds local rank L: <attempt dir>/L/error.json, as every worker's.
  if (!files_.empty())
    w.env.push_back(std::string(contract::env::kSpareLogDir) + "=" + files_.front().rankDir.parent_path().string());
  // Through the agent: once it holds a rank its lines go where that rank's go (adoptSpare).
  w.out = OutputSpec{};
  w.err = OutputSpec{};
  processes_.add(w);
  spares_.push_back(spare);
  log("agent").debug("started {} worker {}", preloaded ? "preloaded" : "spare", spare.id);
}

bool Replacements::handToSpare(const WorkerLaunch& replacement) {
  if (spares_.empty()) return false;
  // A spare (its program set up) before a preloaded worker (its program not started yet).
  auto chosen = std::find_if(spares_.begin(), spares_.end(), [](const Spare& s) { return !s.preloaded; });
  if (chosen == spares_.end()) chosen = spares_.begin();
  const Spare spare = *chosen;
  const char* kind = spare.preloaded ? "preloaded" : "spare";
  std::string lines;
  for (const auto& entry : replacement.env)
    for (const char* name : contract::inplace::kSpareAssigned)
      if (entry.rfind(std::string(name) + "=", 0) == 0) lines += entry + "\n";
  const std::string key = contract::inplace::spareKey(spare.id);
  try {
    workerStore().set(key, store::toBytes(contract::auth::signCommand(config_.controlKey, key, lines)));
  } catch (const std::exception& e) {
    log("agent").warn("could not hand rank {} to {} worker {} ({}): starting a new process instead",
                      replacement.globalRank, kind, spare.id, e.what());
    workerStore_.reset();
    return false;
  }
  spares_.erase(chosen);
  processes_.relabel(spare.tag, replacement.localRank);
  if (static_cast<std::size_t>(replacement.localRank) < files_.size())
    logs_.adoptSpare(replacement.localRank, files_[static_cast<std::size_t>(replacement.localRank)]);
  log("agent").warn("{} worker {} takes over rank {} (local {})", kind, spare.id, replacement.globalRank,
                    replacement.localRank);
  startSpare(spare.preloaded);  // ready for the next failure
  return true;
}

void Replacements::killSpares() {
  for (const auto& spare : spares_) processes_.killRank(spare.tag);
  spares_.clear();
}

void Replacements::serveEvictions(GroupMonitor& monitor) {
  std::uint64_t expirations = 0;
  [[maybe_unused]] auto n = ::read(timerFd_, &expirations, sizeof expirations);
  if (monitor.stopping()) return;
  if (std::chrono::steady_clock::now() < workerStoreRetryAt_) return;
  try {
    store::TcpStoreClient& store = workerStore();
    const auto pids = processes_.pids();
    for (const auto& [localRank, pid] : pids) {
      if (pid <= 0 || evicted_.count(pid)) continue;
      const int rank = info_.globalRank(localRank);
      const std::string key = contract::inplace::evictKey(rank);
      if (localRank < 0 || !store.check({key})) continue;  // spares hold no rank yet
      const std::string value = store::toString(store.get(key));
      if (!acceptEviction(store, key, value, rank, pid)) continue;
      evicted_.insert(pid);
      log("agent").warn("worker rank {} (local {}, pid {}) stopped answering its peers: killing it to replace it "
                        "in place",
                        rank, localRank, pid);
      processes_.kill(pid);
    }
    checkReformed(store, monitor);
    workerStoreBackoff_ = std::chrono::milliseconds(0);
  } catch (const std::exception& e) {
    // The store is node 0's and may be unreachable for a moment (or lost with its host): try again
    // after a pause that doubles, so that the event loop is not held up at every tick.
    log("agent").debug("eviction requests: {}", e.what());
    workerStore_.reset();
    workerStoreBackoff_ = std::clamp(workerStoreBackoff_ * 2, std::chrono::milliseconds(250), std::chrono::milliseconds(4000));
    workerStoreRetryAt_ = std::chrono::steady_clock::now() + workerStoreBackoff_;
  }
}

// A signed request (control_auth.hpp) naming this rank's current worker, in a generation this
// rank has not said it is alive in, that is the newest or the one being formed. Anything else is
// ignored; a forged, malformed or stale value is logged once, naming the key.
bool Replacements::acceptEviction(store::TcpStoreClient& store, const std::string& key, const std::string& value,
                                  int rank, int pid) {
  auto refuse = [&](const std::string& why) {
    if (refusedEvictions_.insert(key + '\0' + value).second)
      log("agent").warn("ignoring {} in the workers' store: {}", key, why);
    return false;
  };
  const auto payload = contract::auth::verifyCommand(config_.controlKey, key, value);
  if (!payload) return refuse("it is not signed with this job's key (forged, or written by another job)");
  const auto request = contract::inplace::parseEvictionPayload(*payload);
  if (!request) return refuse("its signed content is not an eviction request");
  const long named = request->pid;
  const std::int64_t generation = request->generation;
  if (named != pid) return false;  // an earlier process of this rank, already gone: nothing to say
  const std::int64_t newest = store.add(contract::inplace::kGenerationKey, 0);
  if (generation + 1 < newest)
    return refuse("it names generation " + std::to_string(generation) + ", and the group is at " +
                  std::to_string(newest) + " (a stale request)");
  if (store.check({contract::inplace::aliveKey(generation, rank)}))
    return refuse("rank " + std::to_string(rank) + " said it is alive in generation " + std::to_string(generation));
  return true;
}

} // namespace ctorch::launcher
