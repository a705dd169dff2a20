#include "ctorch/rdzv/c10d/executor.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"

#include <algorithm>
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
}

int Executor::writerSlot(const State& s) const {
  // Participants by join order, then the pending announcements by number; the rest never.
  constexpr int kNever = 1 << 20;
  if (const Participant* me = s.participant(self_.id)) {
    int before = 0;
    for (const auto& p : s.participants) before += p.joinSeq < me->joinSeq ? 1 : 0;
    return before;
  }
  if (myRound_ == s.round && myNumber_ > s.announced)
    return static_cast<int>(std::min<std::int64_t>(s.participantCount() + (myNumber_ - s.announced - 1), kNever));
  return kNever;
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
  const bool designated = writerSlot(s) == 0;
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
  // Read the pending announcements in number order. A number taken but not written yet is waited
  // for (its node is between its two requests) up to takeOverAfter, then skipped (its node died).
  constexpr std::int64_t kMaxBatch = 4096;
  std::vector<Announcement> batch;
  std::int64_t last = s.announced;
  for (std::int64_t n = s.announced + 1; n <= count && n <= s.announced + kMaxBatch; ++n) {
    const std::string key = announceKey(settings_.runId, n);
    if (!store_.check(key)) {
      if (missingNumber_ != n || !missingSince_) {
        missingNumber_ = n;
        missingSince_ = now;
      }
      if (now - *missingSince_ < options_.takeOverAfter) break;
      last = n;  // skipped: its node, if alive after all, sees it consumed and announces again
      continue;
    }
    if (auto a = decodeAnnouncement(store_.get(key))) batch.push_back(std::move(*a));
    last = n;
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
    if (!designated)
      log("announcements waited for round " + std::to_string(s.round) + "'s designated writer for more than " +
          std::to_string(takeOverDelay(s).count()) + " ms: admitted from this node");
    log(d.reason);
    pendingSince_.reset();
    if (endsAWait(d.action)) bumpPhase();
    for (std::int64_t n = s.announced + 1; n <= last; ++n) store_.deleteKey(announceKey(settings_.runId, n));
  }
  return true;
}

Decision Executor::run(const DecideFn& decide, std::chrono::milliseconds timeout,
                       bool resetDeadlineOnSpareExit, bool oneShot, bool joining) {
  auto deadline = clock_.steadyNow() + timeout;
  const bool scalable = joining && announcing_;
  read();
  for (;;) {
    NodeView view{self_, settings_, clock_.now(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_.steadyNow())};
    if (scalable && admitIfDue(view)) continue;
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
    if (d.action == Action::KeepAlive && !heartbeatWriteDue()) {
      if (!joining) return Decision{Action::Finish, std::nullopt, "heartbeat not due yet (offset)"};
      waitForChange();
      continue;
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
      if (d.action == Action::LeaveRedundancyList && resetDeadlineOnSpareExit)
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
  run(&decideExit, settings_.joinTimeout);
  run(&decideJoin, settings_.joinTimeout, /*resetDeadlineOnSpareExit=*/true, /*oneShot=*/false,
      /*joining=*/true);
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
  // With the phase counter, a check that has nothing to write and sees no phase change decides on
  // the state read before: every change a running node must react to (a node lost, waiting or
  // failed, the close) moves the counter. Without it, 1,000 nodes reading a ~200 KB state four
  // times per heartbeat interval kept the store busy with nothing but that.
  bool fresh = true;
  if (announcing_ && state_ && lastRound_) {
    const std::int64_t phase = store_.add(phaseKey_, 0);
    if (phase != phaseSeen_) {
      phaseSeen_ = phase;  // the counter first, then the state (run() reads it)
    } else {
      NodeView view{self_, settings_, clock_.now(), settings_.heartbeatTimeout};
      Decision d = decideKeepAlive(state_, view);
      if (d.action == Action::Finish || (d.action == Action::KeepAlive && !heartbeatWriteDue())) fresh = false;
    }
  }
  if (fresh) run(&decideKeepAlive, settings_.heartbeatTimeout);
  if (!lastRound_) return RoundAssessment{};
  return assessRound(state_, *lastRound_, self_.id, settings_);
}

std::chrono::milliseconds Executor::heartbeatOffset() const {
  // FNV-1a of the node id: a fixed offset per node in [0, keepAliveInterval / 4).
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : self_.id) h = (h ^ c) * 1099511628211ull;
  // None when a single missed interval already means dead (keep_alive_max_attempt 1).
  const auto quarter = settings_.keepAliveMaxAttempt >= 2 ? settings_.keepAliveInterval.count() / 4 : 0;
  return std::chrono::milliseconds(quarter > 0 ? static_cast<std::int64_t>(h % static_cast<std::uint64_t>(quarter)) : 0);
}

bool Executor::heartbeatWriteDue() const {
  if (!announcing_ || !state_) return true;
  auto it = state_->heartbeats.find(self_.id);
  if (it == state_->heartbeats.end()) return true;
  // Nodes admitted together got the same heartbeat time: without an offset they would all write
  // their next one in the same instant, each compare-and-set of the whole state losing to the
  // others'. Each node waits a little longer, by its own fixed amount (well inside the expiry of
  // keep_alive_max_attempt intervals).
  return it->second <= clock_.now() - settings_.keepAliveInterval - heartbeatOffset();
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
