// The executor's part while a round runs (executor.hpp): heartbeats and their freshness, the monitor
// that removes nodes whose heartbeats expired, the assessment of the round the agent acts on, and a
// node's failures and removals reported into the state. Forming the round is executor.cpp.
#include "ctorch/rdzv/c10d/executor.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <stdexcept>

namespace ctorch::rdzv::c10d {

void Executor::pruneAnnouncements() {
  // Consumed announcements are deleted here, a few per call by the round's monitor while the
  // workers run, not by the node admitting them: one request per key made that node, which
  // admits the rest of a large round, the bottleneck of the join.
  if (!announcing_ || !state_ || monitorOf(*state_) != self_.id) return;
  for (int budget = 64; budget > 0 && pruneFrom_ <= state_->announced; --budget)
    store_.deleteKey(announceKey(settings_.runId, pruneFrom_++));
}

RoundAssessment Executor::keepAlive() {
  if (!heartbeatKeys_ || !state_ || !lastRound_) {
    run(&decideKeepAlive, settings_.heartbeatTimeout);
    pruneAnnouncements();
    if (!lastRound_) return RoundAssessment{};
    return assessRound(state_, *lastRound_, self_.id, settings_);
  }
  // With per-node heartbeat keys: send this node's heartbeat (a small SET); read the state only
  // when the phase counter moved (every change a running node reacts to moves it) or when the
  // round's monitor seems dead; the monitor itself merges every node's key into the state once
  // per interval and removes the expired. Nothing here rewrites the whole state per node.
  beatIfDue(/*force=*/false);
  const std::int64_t phase = store_.add(phaseKey_, 0);
  bool reread = phase != phaseSeen_;
  phaseSeen_ = phase;
  const auto steady = clock_.steadyNow();
  if (!reread && !isMonitor() && steady - lastMonitorCheck_ >= settings_.keepAliveInterval) {
    lastMonitorCheck_ = steady;
    const std::string monitor = monitorOf(*state_);
    if (!monitor.empty() && !beatIsFresh(monitor)) reread = true;
  }
  if (reread) read();
  if (isMonitor()) {
    monitorIfDue(/*force=*/false);
    pruneAnnouncements();
  } else if (reread) {
    RunMode fresh;
    fresh.stateIsFresh = true;  // read just above
    run(&decideKeepAlive, settings_.heartbeatTimeout, fresh);
  }
  return assessRound(state_, *lastRound_, self_.id, settings_);
}

std::string Executor::monitorOf(const State& s) {
  const Participant* first = nullptr;
  for (const auto& p : s.participants)
    if (!first || p.joinSeq < first->joinSeq) first = &p;
  if (first) return first->node.id;
  return s.heartbeats.empty() ? std::string() : s.heartbeats.begin()->first;
}

bool Executor::isMonitor() const { return state_ && monitorOf(*state_) == self_.id; }

void Executor::beatIfDue(bool force) {
  if (!state_) return;
  const auto mine = state_->heartbeats.find(self_.id);
  if (mine == state_->heartbeats.end()) return;  // not in the rendezvous (yet)
  // Admitted from this node's announcement: the admitting node wrote this node's key with the
  // admission time along with the state (admitIfDue), which makes that its first heartbeat. (If
  // that node died before the key, the monitor keeps the state's entry, the same time.) Never a
  // time ahead of this node's clock: anyone can write the state, and a time in the future would
  // hold this node's heartbeats back until its clock got there.
  const Timestamp now = clock_.now();
  if (!lastBeatSent_ && myRound_ == state_->round && myNumber_ > 0 && myNumber_ <= state_->announced)
    lastBeatSent_ = std::min(mine->second, now);
  const auto minGap = force ? settings_.keepAliveInterval / 4 : settings_.keepAliveInterval;
  if (lastBeatSent_ && now - *lastBeatSent_ < minGap) return;
  store_.set(heartbeatKey(settings_.runId, self_.id), std::to_string(now.time_since_epoch().count()));
  lastBeatSent_ = now;
}

std::optional<Timestamp> Executor::readBeat(const std::string& id) {
  const std::string key = heartbeatKey(settings_.runId, id);
  if (!store_.check(key)) return std::nullopt;
  const std::string text = store_.get(key);
  char* end = nullptr;
  const long long ms = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || !end || *end != 0) return std::nullopt;  // not a heartbeat: ignored
  return Timestamp(std::chrono::milliseconds(ms));
}

bool Executor::beatIsFresh(const std::string& id) {
  std::optional<Timestamp> latest = readBeat(id);
  if (auto it = state_->heartbeats.find(id); it != state_->heartbeats.end())
    latest = latest ? std::max(*latest, it->second) : it->second;
  return latest && *latest >= clock_.now() - settings_.heartbeatExpiry();
}

std::optional<Decision> Executor::removeDeadMonitor(const NodeView& view) {
  const std::string monitor = monitorOf(*state_);
  const auto expired = expiredNodes(*state_, view.now, settings_.heartbeatExpiry());
  if (monitor.empty() || std::find(expired.begin(), expired.end(), monitor) == expired.end()) return std::nullopt;
  if (beatIsFresh(monitor)) return std::nullopt;
  // decideKeepAlive words the removal of every expired node; only the monitor is removed here.
  State onlyMonitor = *state_;
  for (auto& [id, t] : onlyMonitor.heartbeats)
    if (id != monitor) t = view.now;
  Decision d = decideKeepAlive(onlyMonitor, view);
  if (d.action != Action::RemoveDead) return std::nullopt;
  return Decision{Action::RemoveDead, c10d::removeNodes(*state_, {monitor}, settings_.minNodes), d.reason};
}

bool Executor::monitorIfDue(bool force) {
  if (!isMonitor()) return false;
  const auto steady = clock_.steadyNow();
  if (!force && steady - lastMerge_ < settings_.keepAliveInterval) return false;
  const Timestamp now = clock_.now();
  // Nothing to merge while every entry is younger than an interval (a round that just formed).
  bool stale = false;
  for (const auto& [id, t] : state_->heartbeats) stale = stale || t < now - settings_.keepAliveInterval;
  if (!stale) {
    lastMerge_ = steady;
    return false;
  }
  State next = *state_;
  // Every node's key in a couple of requests (one per key made the monitor, which is also the
  // round's designated writer, the bottleneck of a large round).
  std::vector<std::string> ids, keys;
  for (const auto& [id, t] : next.heartbeats)
    if (id != self_.id) {
      ids.push_back(id);
      keys.push_back(heartbeatKey(settings_.runId, id));
    }
  std::map<std::string, Timestamp> beats;
  if (!keys.empty() && store_.checkAll(keys)) {
    const auto values = store_.getMany(keys);
    for (std::size_t i = 0; i < ids.size() && i < values.size(); ++i) {
      char* end = nullptr;
      const long long ms = std::strtoll(values[i].c_str(), &end, 10);
      if (!values[i].empty() && end && *end == 0) beats[ids[i]] = Timestamp(std::chrono::milliseconds(ms));
    }
  } else {
    for (const auto& id : ids)
      if (auto beat = readBeat(id)) beats[id] = *beat;
  }
  beats[self_.id] = now;
  bool changed = false;
  for (auto& [id, t] : next.heartbeats) {
    auto it = beats.find(id);
    if (it != beats.end() && it->second > t) {
      t = it->second;
      changed = true;
    }
  }
  std::string reason;
  if (!expiredNodes(next, now, settings_.heartbeatExpiry()).empty()) {
    NodeView view{self_, settings_, now, settings_.heartbeatTimeout};
    Decision d = decideKeepAlive(next, view);  // removes every expired node, in the usual words
    next = *d.next;
    reason = d.reason;
  }
  if (!changed && reason.empty()) {
    lastMerge_ = steady;
    return false;
  }
  const std::string desired = encodeState(next);
  const std::string got = store_.compareSet(key_, raw_, desired);
  if (got == raw_) {
    read();  // the key is gone: read() says so
    return true;
  }
  raw_ = got;
  state_ = decodeStoreValue(raw_);
  if (got == desired) {
    lastMerge_ = steady;
    if (!reason.empty()) {
      log(reason);
      bumpPhase();
    }
  }
  return true;
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
  RunMode oneShot;
  oneShot.oneShot = true;
  Decision d = run([&](const std::optional<State>& s,
                       const NodeView& v) { return decideRemove(s, v, ids, why); },
                   settings_.heartbeatTimeout, oneShot);
  return d.action == Action::RemoveDead;
}

} // namespace ctorch::rdzv::c10d
