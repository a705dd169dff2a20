#include "ctorch/rdzv/c10d/executor.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"

#include <thread>

namespace ctorch::rdzv::c10d {

namespace {

class SystemClock final : public Clock {
 public:
  Timestamp now() override {
    return std::chrono::time_point_cast<std::chrono::milliseconds>(std::chrono::system_clock::now());
  }
  std::chrono::steady_clock::time_point steadyNow() override { return std::chrono::steady_clock::now(); }
  void sleepFor(std::chrono::milliseconds d) override { std::this_thread::sleep_for(d); }
};

} // namespace

Clock& systemClock() {
  static SystemClock clock;
  return clock;
}

Executor::Executor(CasStore& store, Settings settings, NodeInfo self, Clock& clock, ExecutorOptions options)
    : store_(store),
      settings_(std::move(settings)),
      self_(std::move(self)),
      clock_(clock),
      options_(std::move(options)),
      key_(stateKey(settings_.runId)) {
  settings_.validate();
  if (self_.id.empty()) throw RendezvousConfigError("the node id must not be empty");
  if (self_.nproc < 1)
    throw RendezvousConfigError("the number of workers on a node must be at least 1, not " +
                                std::to_string(self_.nproc));
  if (self_.requestedRank && *self_.requestedRank < 0)
    throw RendezvousConfigError("the requested node rank must not be negative, not " +
                                std::to_string(*self_.requestedRank));
}

void Executor::log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

void Executor::ensureKey() {
  if (keyReady_) return;
  // get() blocks until a key exists, so create it with the "no state" sentinel first; this
  // changes nothing if any state is there already.
  raw_ = store_.compareSet(key_, "", kNoStateSentinel);
  state_ = decodeStoreValue(raw_);
  keyReady_ = true;
}

void Executor::read() {
  ensureKey();
  raw_ = store_.get(key_);
  state_ = decodeStoreValue(raw_);
}

Decision Executor::run(const DecideFn& decide, std::chrono::milliseconds timeout,
                       bool resetDeadlineOnSpareExit, bool oneShot) {
  auto deadline = clock_.steadyNow() + timeout;
  read();
  for (;;) {
    NodeView view{self_, settings_, clock_.now(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_.steadyNow())};
    Decision d = decide(state_, view);
    switch (d.action) {
      case Action::Finish:
        return d;
      case Action::Wait:
        clock_.sleepFor(options_.pollInterval);
        read();
        continue;
      case Action::FailTimeout:
        throw RendezvousTimeout(d.reason);
      case Action::FailClosed:
        throw RendezvousClosed(d.reason);
      case Action::ExitRedundant:
        throw RendezvousGracefulExit(d.reason);
      default:
        break;
    }
    const std::string desired = encodeState(*d.next);
    std::string now = store_.compareSet(key_, raw_, desired);
    raw_ = now;
    state_ = decodeStoreValue(raw_);
    if (now == desired) {
      if (d.action != Action::KeepAlive) log(d.reason);
      // One-shot operations are done once their write landed.
      if (d.action == Action::ReportFailure || d.action == Action::Leave ||
          (d.action == Action::RemoveDead && oneShot))
        return d;
      // A spare that finds room starts the join timeout afresh (torch's update_deadline).
      if (d.action == Action::LeaveRedundancyList && resetDeadlineOnSpareExit)
        deadline = clock_.steadyNow() + timeout;
    }
    // else: someone changed the state first; decide again on what they wrote.
  }
}

RoundResult Executor::nextRound() {
  run(&decideExit, settings_.joinTimeout);
  run(&decideJoin, settings_.joinTimeout, /*resetDeadlineOnSpareExit=*/true);
  RoundResult r = roundResult(*state_, self_.id);
  self_.previousRank = r.nodeRank;
  lastRound_ = r;
  std::string line = "joined round " + std::to_string(r.round) + " of rendezvous '" + settings_.runId +
                     "' as node rank " + std::to_string(r.nodeRank) + " of " + std::to_string(r.nodeCount) +
                     " (global ranks " + std::to_string(r.rankBase) + ".." +
                     std::to_string(r.rankBase + r.localWorldSize - 1) + " of " + std::to_string(r.worldSize) + ")";
  if (r.requestedRank && *r.requestedRank != r.nodeRank)
    line += "; requested node rank " + std::to_string(*r.requestedRank) + " was not available";
  log(line);
  return r;
}

RoundAssessment Executor::keepAlive() {
  run(&decideKeepAlive, settings_.heartbeatTimeout);
  if (!lastRound_) return RoundAssessment{};
  return assessRound(state_, *lastRound_, self_.id, settings_);
}

RoundAssessment Executor::assess() {
  read();
  if (!lastRound_) return RoundAssessment{};
  return assessRound(state_, *lastRound_, self_.id, settings_);
}

int Executor::numNodesWaiting() {
  read();
  if (!state_ || state_->participantCount() >= settings_.maxNodes) return 0;
  int n = 0;
  for (const auto& id : state_->waitList)
    if (!state_->isParticipant(id)) ++n;
  return n;
}

void Executor::close() { run(&decideClose, settings_.closeTimeout); }

void Executor::leave() { run(&decideLeave, settings_.closeTimeout); }

bool Executor::reportFailure(const std::string& reason) {
  if (!lastRound_) return false;
  const std::int64_t round = lastRound_->round;
  Decision d = run(
      [&](const std::optional<State>& s, const NodeView& v) { return decideReportFailure(s, v, round, reason); },
      settings_.heartbeatTimeout);
  return d.action == Action::ReportFailure;
}

bool Executor::removeNodes(const std::vector<std::string>& ids, const std::string& why) {
  Decision d = run([&](const std::optional<State>& s,
                       const NodeView& v) { return decideRemove(s, v, ids, why); },
                   settings_.heartbeatTimeout, false, /*oneShot=*/true);
  return d.action == Action::RemoveDead;
}

} // namespace ctorch::rdzv::c10d
