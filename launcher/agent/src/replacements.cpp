// --recovery in-place, the agent's hands: replacements, spares, kills and the re-form's progress,
// through the authenticated link to the coordinator (replacements.hpp).
#include "replacements.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/failure_summary.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "log.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>

namespace ctorch::launcher {

namespace cc = contract::control;

namespace {

// How long the agent waits on the workers' store for the answer to its probe (storeTurnsAway). A store
// at its connection cap closes a new connection the moment it accepts it; one that merely answers
// late (busy, or holding requests back while replies are taken) is not turning anyone away.
constexpr std::chrono::milliseconds kStoreProbeTimeout{500};

// Why the workers' store at host:port turns a new connection away (accepts and closes it, or
// refuses it) now, or nothing when it takes one, or only answers late: what a replacement's first
// step, connecting to that store, would meet.
std::optional<std::string> storeTurnsAway(const std::string& host, int port) {
  store::TcpStoreClientOptions o;
  o.timeout = kStoreProbeTimeout;
  o.operationTimeout = kStoreProbeTimeout;
  o.retryConnect = false;
  try {
    store::TcpStoreClient probe(host, static_cast<std::uint16_t>(port), o);
    probe.check({"ctorch.probe"});
    return std::nullopt;
  } catch (const store::StoreTimeout&) {
    return std::nullopt;
  } catch (const store::StoreError& e) {
    return std::string(e.what());
  }
}

void setVariable(std::vector<std::string>& env, const std::string& name, const std::string& value) {
  const std::string mark = name + "=";
  env.erase(std::remove_if(env.begin(), env.end(), [&](const std::string& e) { return e.rfind(mark, 0) == 0; }), env.end());
  env.push_back(mark + value);
}

} // namespace

Replacements::Replacements(const LaunchConfig& config, ProcessContext& processes, WorkerLogs& logs)
    : config_(config), processes_(processes), logs_(logs) {
  if (!config_.inPlaceRecovery) return;
  ControlLink::Callbacks callbacks;
  callbacks.welcomed = [this] { welcomed(); };
  callbacks.message = [this](const cc::Message& m) { onMessage(m); };
  callbacks.lost = [](const std::string& why) { log("agent").debug("control channel: {}", why); };
  link_ = std::make_unique<ControlLink>(std::move(callbacks));
}

Replacements::~Replacements() = default;

void Replacements::prepare(std::vector<WorkerLaunch>& launches, bool inPlace) {
  incarnations_.clear();
  replacedRanks_.clear();
  if (!link_) return;
  if (!inPlace) {
    auto owned = [](const std::string& entry) {
      for (const char* name : contract::kLauncherOwnedVariables)
        if (entry.rfind(std::string(name) + "=", 0) == 0) return true;
      return false;
    };
    for (auto& w : launches) w.env.erase(std::remove_if(w.env.begin(), w.env.end(), owned), w.env.end());
    return;
  }
  for (auto& w : launches) {
    const std::uint64_t incarnation = cc::randomIncarnation();
    incarnations_[w.localRank] = incarnation;
    setVariable(w.env, contract::env::kIncarnation, cc::incarnationText(incarnation));
  }
}

void Replacements::beginGroup(const RendezvousInfo& info, int restartCount, const std::vector<WorkerLaunch>& launches,
                              const std::vector<WorkerLogs::WorkerFiles>& files, bool inPlace) {
  info_ = info;
  restartCount_ = restartCount;
  launches_ = launches;
  files_ = files;
  spares_.clear();
  {
    std::lock_guard<std::mutex> lock(heardMutex_);
    inReform_.clear();
    capability_ = -1;
  }
  incapable_.clear();
  if (!link_ || !inPlace) return;
  link_->open(info.storeHost, info.storePort, config_.controlKey,
              cc::agentHello(info.nodeRank, info.globalRank(0), info.localNproc(), info.worldSize));
  for (int i = 0; i < config_.spareWorkers; ++i) startSpare(false);
  for (int i = 0; i < config_.preloadedWorkers; ++i) startSpare(true);
}

void Replacements::endGroup() {
  if (link_) link_->close();
}

// Welcomed (again): the coordinator learns which process holds each local rank.
void Replacements::welcomed() {
  log("agent").debug("control channel: connected to the coordinator at {}:{}", info_.storeHost, info_.storePort);
  for (const auto& [localRank, incarnation] : incarnations_) registerRank(localRank, replacedRanks_.count(localRank) > 0);
}

void Replacements::registerRank(int localRank, bool replacement) {
  const auto it = incarnations_.find(localRank);
  if (it == incarnations_.end()) return;
  cc::Message m = cc::message(cc::Type::kRegister);
  m.rank = info_.globalRank(localRank);
  m.incarnation = it->second;
  m.value = replacement ? 1 : 0;
  link_->send(m);
}

void Replacements::onReady(GroupMonitor& monitor) {
  monitor_ = &monitor;
  link_->onReady();
  monitor_ = nullptr;
}

void Replacements::onMessage(const cc::Message& m) {
  auto& l = log("agent");
  const int localRank = m.rank - info_.globalRank(0);
  switch (m.type) {
    case cc::Type::kKill: {
      const auto current = incarnations_.find(localRank);
      const auto pids = processes_.pids();
      const auto pid = pids.find(localRank);
      if (current == incarnations_.end() || current->second != m.incarnation || pid == pids.end() || pid->second <= 0 ||
          evicted_.count(pid->second)) {
        l.debug("control channel: a kill of a former process of rank {}: nothing to do", m.rank);
        return;
      }
      evicted_.insert(pid->second);
      l.warn("worker rank {} (local {}, pid {}) stopped answering its peers: killing it to replace it in place", m.rank,
             localRank, pid->second);
      processes_.kill(pid->second);
      return;
    }
    case cc::Type::kRankState: {
      std::lock_guard<std::mutex> lock(heardMutex_);
      inReform_[m.rank] = m.incarnation;
      return;
    }
    case cc::Type::kReformed:
      {
        std::lock_guard<std::mutex> lock(heardMutex_);
        inReform_.clear();  // what is said from now on is about the next re-form
      }
      if (monitor_ && monitor_->reformPending()) {
        monitor_->noteReformed();
        l.debug("the group re-formed at generation {}", m.generation);
      }
      return;
    case cc::Type::kCapability:
      if (capability_ == 0) return;
      {
        std::lock_guard<std::mutex> lock(heardMutex_);
        capability_ = m.value == 1 ? 1 : 0;
      }
      if (capability_ == 1) {
        l.debug("every rank can recover in place");
      } else {
        incapable_ = "rank " + std::to_string(m.rank) + " cannot recover in place (" + m.text + ")";
      }
      return;
    case cc::Type::kSpareReady:
      for (auto& s : spares_)
        if (s.id == m.text && s.incarnation == m.incarnation) s.ready = true;
      return;
    default:
      l.debug("control channel: ignoring message type {}", static_cast<int>(m.type));
  }
}

int Replacements::heardCapability() const {
  std::lock_guard<std::mutex> lock(heardMutex_);
  return capability_;
}

bool Replacements::heardInReform(int rank) const {
  std::lock_guard<std::mutex> lock(heardMutex_);
  return inReform_.count(rank) > 0;
}

std::optional<std::string> Replacements::takeInPlaceImpossible() {
  if (capability_ != 0 || incapableTaken_) return std::nullopt;
  incapableTaken_ = true;
  return incapable_;
}

bool Replacements::canReplace(int rank) {
  auto explain = [&](const std::string& kind, const std::string& line) {
    if (explained_.insert(kind).second) log("agent").warn("{}", line);
    return false;
  };
  if (!link_ || !link_->ready())
    return explain("link", "worker rank " + std::to_string(rank) + " failed while the job's coordinator (node rank 0's "
                           "workers' store) does not answer: restarting the group instead of replacing the worker in place");
  if (capability_ != 1)
    return explain("capability", "worker rank " + std::to_string(rank) + " failed before every rank had said it can "
                                 "recover in place (ctorch::ResilientTraining::resume() says so; a program without it "
                                 "cannot): restarting the group, as --recovery restart does");
  // A replacement's first step is a new connection to the workers' store. A store that turns new
  // connections away (its connection cap held by others: issue 58.2) would fail every replacement
  // within seconds, each one a restart spent; the group's next round brings a fresh store.
  if (auto why = storeTurnsAway(info_.storeHost, info_.storePort)) {
    log("agent").warn("worker rank {} failed while the workers' store at {}:{} turns new connections away ({}): a "
                      "replacement could not reach it; restarting the group with a fresh store instead of replacing "
                      "the worker in place",
                      rank, info_.storeHost, info_.storePort, *why);
    return false;
  }
  return true;
}

bool Replacements::joinedReform(int rank) const {
  const auto said = inReform_.find(rank);
  const auto current = incarnations_.find(rank - info_.globalRank(0));
  return said != inReform_.end() && current != incarnations_.end() && said->second == current->second;
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

void Replacements::replace(int localRank, RestartPolicy& policy) {
  auto it = std::find_if(launches_.begin(), launches_.end(), [&](const WorkerLaunch& w) { return w.localRank == localRank; });
  if (it == launches_.end()) return;
  policy.noteReplacement();
  WorkerLaunch w = *it;
  setVariable(w.env, contract::env::kReplacement, std::to_string(policy.replacementsUsed()));
  // The failed worker's recorded error is logged now; the file is the replacement's from here on.
  if (static_cast<std::size_t>(localRank) < files_.size()) {
    const auto& errorFile = files_[static_cast<std::size_t>(localRank)].errorFile;
    if (auto error = readErrorFile(errorFile)) log("agent").warn("worker rank {} had recorded: {}", w.globalRank, error->message.substr(0, error->message.find('\n')));
    std::error_code ec;
    std::filesystem::remove(errorFile, ec);
  }
  log("agent").warn("replacing worker rank {} (local {}) in place; the other workers keep running "
                    "(replacement {}, {} of {} restarts used)",
                    w.globalRank, localRank, policy.replacementsUsed(), policy.restartsUsed(), config_.maxRestarts);
  replacedRanks_.insert(localRank);
  if (handToSpare(w, policy.replacementsUsed())) return;
  const std::uint64_t incarnation = cc::randomIncarnation();
  incarnations_[localRank] = incarnation;
  setVariable(w.env, contract::env::kIncarnation, cc::incarnationText(incarnation));
  registerRank(localRank, true);  // before the process can say hello
  processes_.add(w);
}

// A spare is a worker of this node without a rank yet: the contract's variables of local rank 0
// less the rank ones (contract::inplace::kSpareAssigned), and CTORCH_SPARE naming it. A preloaded worker is
// a spare that waits before its program's main() (CTORCH_PRELOADED): ctorch's library waits there.
void Replacements::startSpare(bool preloaded) {
  if (launches_.empty()) return;
  Spare spare;
  spare.preloaded = preloaded;
  ++sparesStarted_;
  spare.id = std::to_string(info_.nodeRank) + "-" + std::to_string(restartCount_) + "-" + std::to_string(sparesStarted_);
  spare.tag = -sparesStarted_;
  spare.incarnation = cc::randomIncarnation();
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
  setVariable(w.env, contract::env::kIncarnation, cc::incarnationText(spare.incarnation));
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

// Hands the rank to a spare (the coordinator forwards the assignment on the spare's own
// authenticated connection; nothing of it passes through the store).
bool Replacements::handToSpare(const WorkerLaunch& replacement, int replacementNumber) {
  if (!link_ || !link_->ready() || spares_.empty()) return false;
  // One that waits already, a spare before a preloaded worker; else the oldest, still starting:
  // the coordinator keeps its assignment until it connects (sooner than a new process would).
  auto chosen = std::find_if(spares_.begin(), spares_.end(), [](const Spare& s) { return s.ready && !s.preloaded; });
  if (chosen == spares_.end())
    chosen = std::find_if(spares_.begin(), spares_.end(), [](const Spare& s) { return s.ready; });
  if (chosen == spares_.end()) chosen = spares_.begin();
  const Spare spare = *chosen;
  const char* kind = spare.preloaded ? "preloaded" : "spare";
  cc::Message m = cc::message(cc::Type::kAssignSpare);
  m.text = spare.id;
  m.incarnation = spare.incarnation;
  m.rank = replacement.globalRank;
  m.value = replacement.localRank;
  m.value2 = replacementNumber;
  if (!link_->send(m)) return false;
  incarnations_[replacement.localRank] = spare.incarnation;
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

} // namespace ctorch::launcher
