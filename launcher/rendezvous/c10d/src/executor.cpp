#include "ctorch/rdzv/c10d/executor.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"

#include <algorithm>
#include <map>
#include <cstdlib>
#include <stdexcept>
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

std::int64_t CasStore::add(const std::string&, std::int64_t) {
  throw std::logic_error("this rendezvous store has no add");
}
void CasStore::set(const std::string&, const std::string&) {
  throw std::logic_error("this rendezvous store has no set");
}
bool CasStore::check(const std::string&) { throw std::logic_error("this rendezvous store has no check"); }
void CasStore::deleteKey(const std::string&) { throw std::logic_error("this rendezvous store has no deleteKey"); }
bool CasStore::checkAll(const std::vector<std::string>& keys) {
  for (const auto& key : keys)
    if (!check(key)) return false;
  return true;
}
std::vector<std::string> CasStore::getMany(const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& key : keys) out.push_back(get(key));
  return out;
}

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
      key_(stateKey(settings_.runId)),
      announcing_(store.supportsAnnouncements()),
      countKey_(announceCountKey(settings_.runId)),
      phaseKey_(phaseKey(settings_.runId)) {
  settings_.validate();
  heartbeatKeys_ = announcing_ && settings_.keepAliveMaxAttempt >= 2;
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
  // The compare-and-set that creates the key answers with the value stored: that is the read.
  if (keyReady_) {
    raw_ = store_.get(key_);
    state_ = decodeStoreValue(raw_);
  } else {
    ensureKey();
  }
  lastFullRead_ = clock_.steadyNow();
}

void Executor::waitForChange() {
  clock_.sleepFor(options_.pollInterval);
  if (!announcing_) return read();
  // The counter first, then the state: a write that lands in between is read now and its
  // increment makes the next poll read once more (harmless).
  const std::int64_t phase = store_.add(phaseKey_, 0);
  if (phase != phaseSeen_ || clock_.steadyNow() - lastFullRead_ >= options_.fullReadEvery) {
    phaseSeen_ = phase;
    read();
  }
}

bool Executor::seedStore(const std::vector<std::string>& lost, const std::string& why) {
  if (!state_) return false;
  State s = *state_;
  const Timestamp now = clock_.now();
  for (auto& [id, t] : s.heartbeats) t = now;
  if (!lost.empty()) {
    NodeView view{self_, settings_, now, settings_.heartbeatTimeout};
    Decision d = decideRemove(s, view, lost, why);
    if (d.writes()) {
      s = *d.next;
      log(d.reason);
    }
  }
  if (announcing_ && s.announced > 0) store_.add(countKey_, s.announced);
  // Whatever a client may have put there before (the standby is as open as any TCPStore) is
  // overwritten: this node's copy is the authority now. A store without set takes a compare-and-set.
  try {
    store_.set(key_, encodeState(s));
  } catch (const std::logic_error&) {
    store_.compareSet(key_, "", encodeState(s));
  }
  adoptStore();
  bumpPhase();
  return true;
}

void Executor::adoptStore() {
  keyReady_ = false;
  phaseSeen_ = -1;
  myRound_ = -1;
  myNumber_ = 0;
  pendingSince_.reset();
  pendingAt_ = -1;
  missingSince_.reset();
  missingNumber_ = -1;
  deferredSince_.reset();
  lastBeatSent_.reset();
  lastMerge_ = {};
  lastMonitorCheck_ = {};
  read();
  pruneFrom_ = state_ ? state_->announced + 1 : 1;
}

void Executor::bumpPhase() {
  if (announcing_) phaseSeen_ = store_.add(phaseKey_, 1);
}

namespace {

// Writes after which a waiting node must look at the state: everything but a heartbeat and the
// growth of an open round.
bool endsAWait(Action a) {
  return a != Action::KeepAlive && a != Action::Join && a != Action::OpenLastCall;
}

} // namespace

void Executor::announce() {
  const State s = state_ ? *state_ : freshState(settings_.runId);
  if (myRound_ == s.round && myNumber_ > s.announced) return;  // still pending
  myNumber_ = store_.add(countKey_, 1);
  myRound_ = s.round;
  store_.set(announceKey(settings_.runId, myNumber_), encodeAnnouncement(Announcement{s.round, self_}));
  // The number taken is the counter's value: admitIfDue's next look at the counter, for a node
  // that is not the designated writer, is due a check interval from now.
  const auto now = clock_.steadyNow();
  nextCountCheck_ = now + options_.takeOverAfter / 4;
  if (!pendingSince_ || pendingAt_ != s.announced) {
    pendingSince_ = now;
    pendingAt_ = s.announced;
  }
}

int Executor::writerSlot(const State& s) const {
  // Participants by join order, then the pending announcements by number; the rest never.
  if (const Participant* me = s.participant(self_.id)) {
    int before = 0;
    for (const auto& p : s.participants) before += p.joinSeq < me->joinSeq ? 1 : 0;
    return before;
  }
  if (myRound_ == s.round && myNumber_ > s.announced)
    return static_cast<int>(std::min<std::int64_t>(s.participantCount() + (myNumber_ - s.announced - 1), kNeverWrites - 1));
  return kNeverWrites;
}

std::chrono::milliseconds Executor::takeOverDelay(const State& s) const {
  // Slot k steps in after (k + 1) x takeOverAfter: when the designated writer hangs, one node
  // takes its place, not all of them at once (a dead writer's heartbeat expires first for most).
  const int slot = std::min(writerSlot(s), 1000);
  return options_.takeOverAfter * (slot + 1);
}

bool Executor::admitIfDue(const NodeView& view) {
  const State s = state_ ? *state_ : freshState(settings_.runId);
  if (s.complete || s.closed) return false;
  const auto now = clock_.steadyNow();
  const int slot = writerSlot(s);
  if (slot == kNeverWrites) return false;  // neither a participant nor announced: never this node's turn
  const bool designated = slot == 0;
  if (!designated) {
    if (now < nextCountCheck_) return false;
    nextCountCheck_ = now + options_.takeOverAfter / 4;
  }
  const std::int64_t count = store_.add(countKey_, 0);
  if (count <= s.announced) {
    pendingSince_.reset();
    return false;
  }
  if (!designated) {
    if (!pendingSince_ || pendingAt_ != s.announced) {
      pendingSince_ = now;
      pendingAt_ = s.announced;
      return false;
    }
    if (now - *pendingSince_ < takeOverDelay(s)) return false;
  }
  // Read the pending announcements in number order, a few requests for the whole batch (under
  // load, one round trip per key made the admitting node the bottleneck of a 1,000-node join). A
  // number taken but not written yet ends the batch (its node is between its two requests); after
  // takeOverAfter it is skipped (its node died).
  constexpr std::int64_t kMaxBatch = 4096;
  const std::int64_t first = s.announced + 1;
  const std::int64_t end = std::min(count, s.announced + kMaxBatch);
  auto keys = [&](std::int64_t from, std::int64_t to) {
    std::vector<std::string> out;
    for (std::int64_t n = from; n <= to; ++n) out.push_back(announceKey(settings_.runId, n));
    return out;
  };
  std::int64_t present = end;  // the longest run of written numbers from `first`
  if (!store_.checkAll(keys(first, end))) {
    std::int64_t lo = first - 1, hi = end - 1;
    while (lo < hi) {
      const std::int64_t mid = lo + (hi - lo + 1) / 2;
      if (store_.checkAll(keys(first, mid)))
        lo = mid;
      else
        hi = mid - 1;
    }
    present = lo;
  }
  std::vector<Announcement> batch;
  std::int64_t last = s.announced;
  if (present >= first) {
    for (const auto& value : store_.getMany(keys(first, present)))
      if (auto a = decodeAnnouncement(value)) batch.push_back(std::move(*a));
    last = present;
  }
  if (present < end) {
    const std::int64_t missing = present + 1;
    if (missingNumber_ != missing || !missingSince_) {
      missingNumber_ = missing;
      missingSince_ = now;
    }
    if (last == s.announced && now - *missingSince_ >= options_.takeOverAfter)
      last = missing;  // skipped: its node, if alive after all, sees it consumed and announces again
  }
  if (last == s.announced) return false;
  Decision d = admitAnnounced(state_, view, batch, last);
  if (!d.next) return false;
  const std::string desired = encodeState(*d.next);
  const std::string now2 = store_.compareSet(key_, raw_, desired);
  if (now2 == raw_) {
    read();  // c10d answers a missing key with `expected`: the key is gone (read() says so)
    return true;
  }
  raw_ = now2;
  state_ = decodeStoreValue(raw_);
  if (now2 == desired) {
    if (heartbeatKeys_)  // every admitted node has a heartbeat key from now on (the monitor reads them at once)
      for (const auto& [id, t] : state_->heartbeats)
        if (!s.heartbeats.count(id)) store_.set(heartbeatKey(settings_.runId, id), std::to_string(t.time_since_epoch().count()));
    if (!designated)
      log("announcements waited for round " + std::to_string(s.round) + "'s designated writer for more than " +
          std::to_string(takeOverDelay(s).count()) + " ms: admitted from this node");
    log(d.reason);
    pendingSince_.reset();
    if (endsAWait(d.action)) bumpPhase();
  }
  return true;
}

Decision Executor::run(const DecideFn& decide, std::chrono::milliseconds timeout, RunMode mode) {
  auto deadline = clock_.steadyNow() + timeout;
  const bool joining = mode.joining, oneShot = mode.oneShot;
  const bool scalable = joining && announcing_;
  if (!mode.stateIsFresh || !keyReady_) read();
  for (;;) {
    NodeView view{self_, settings_, clock_.now(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_.steadyNow())};
    if (scalable && admitIfDue(view)) continue;
    if (heartbeatKeys_ && joining) {
      beatIfDue(/*force=*/false);
      if (monitorIfDue(/*force=*/false)) continue;
    }
    Decision d = decide(state_, view);
    if (scalable) {
      if (d.action == Action::Join) {
        // Announce instead of rewriting the whole state; the designated writer admits this node
        // (this node itself when its announcement is the first pending one: no wait then).
        const std::int64_t before = myNumber_;
        announce();
        if (myNumber_ != before) continue;
        waitForChange();
        continue;
      }
      if (d.action == Action::CloseRound || d.action == Action::OpenLastCall) {
        const auto writer = designatedWriter(state_);
        if (writer && *writer != self_.id) {
          const auto now = clock_.steadyNow();
          if (!deferredSince_) deferredSince_ = now;
          const auto delay = takeOverDelay(*state_);
          if (now - *deferredSince_ < delay) {
            waitForChange();
            continue;
          }
          log("round " + std::to_string(state_->round) + "'s designated writer '" + *writer + "' did not " +
              toString(d.action) + " for " + std::to_string(delay.count()) + " ms: doing it from this node");
        }
      }
      deferredSince_.reset();
    }
    if (heartbeatKeys_ && d.action == Action::KeepAlive) {
      // Heartbeats are small SETs under the node's own key; the round's monitor carries them
      // into the state (monitorIfDue).
      beatIfDue(/*force=*/true);
      if (!joining) return Decision{Action::Finish, std::nullopt, "heartbeat sent"};
      waitForChange();
      continue;
    }
    if (heartbeatKeys_ && d.action == Action::RemoveDead && !oneShot) {
      // Expired entries are the monitor's to judge (it reads every node's key); another node
      // only removes the monitor itself when its key, too, is older than the expiry.
      if (isMonitor()) {
        if (monitorIfDue(/*force=*/true)) continue;
      } else if (auto removal = removeDeadMonitor(view)) {
        d = std::move(*removal);
      } else {
        if (!joining) return Decision{Action::Finish, std::nullopt, "expired entries left to the monitor"};
        waitForChange();
        continue;
      }
    }
    switch (d.action) {
      case Action::Finish:
        return d;
      case Action::Wait:
        waitForChange();
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
    if (now == raw_ && now != desired) {
      // c10d answers a compare-and-set on a missing key with `expected`: the state key is gone
      // (deleted, or the store restarted empty). Read it: the store says what happened (throws).
      read();
      continue;
    }
    raw_ = now;
    state_ = decodeStoreValue(raw_);
    if (now == desired) {
      if (d.action != Action::KeepAlive) log(d.reason);
      if (endsAWait(d.action)) bumpPhase();
      // One-shot operations are done once their write landed.
      if (d.action == Action::ReportFailure || d.action == Action::Leave ||
          (d.action == Action::RemoveDead && oneShot))
        return d;
      // A spare that finds room starts the join timeout afresh (torch's update_deadline).
      if (d.action == Action::LeaveRedundancyList && mode.resetDeadlineOnSpareExit)
        deadline = clock_.steadyNow() + timeout;
    } else if (d.action == Action::KeepAlive && announcing_) {
      // A heartbeat lost its race: the nodes of a round send theirs at about the same moment, and
      // retrying at once makes every round of retries one winner and N losers (each resending the
      // whole state). A heartbeat has keep_alive_max_attempt intervals of slack: wait a moment.
      clock_.sleepFor(heartbeatBackoff());
    }
    // else: someone changed the state first; decide again on what they wrote.
  }
}

std::chrono::milliseconds Executor::heartbeatBackoff() {
  const auto cap = std::min<std::int64_t>(settings_.keepAliveInterval.count() / 8, 250);
  if (cap <= 0) return std::chrono::milliseconds(0);
  if (backoffState_ == 0) {
    backoffState_ = 1469598103934665603ull ^ static_cast<std::uint64_t>(clock_.now().time_since_epoch().count());
    for (unsigned char c : self_.id) backoffState_ = (backoffState_ ^ c) * 1099511628211ull;
  }
  backoffState_ ^= backoffState_ << 13;  // xorshift64
  backoffState_ ^= backoffState_ >> 7;
  backoffState_ ^= backoffState_ << 17;
  return std::chrono::milliseconds(static_cast<std::int64_t>(backoffState_ % static_cast<std::uint64_t>(cap)) + 1);
}

RoundResult Executor::nextRound() {
  // The phase counter before the state, in waitForChange's order: otherwise the first poll finds
  // the counter "moved" from nothing and reads the whole state again though nothing changed.
  if (announcing_ && phaseSeen_ < 0) phaseSeen_ = store_.add(phaseKey_, 0);
  run(&decideExit, settings_.joinTimeout);
  // The join decides first on the state the exit ended with, read or written a moment ago.
  RunMode join;
  join.resetDeadlineOnSpareExit = true;
  join.joining = true;
  join.stateIsFresh = true;
  run(&decideJoin, settings_.joinTimeout, join);
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
