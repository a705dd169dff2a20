// The rendezvous executor (executor.hpp) forming a round: reading and writing the state with
// compare-and-set, announcements, admission, the decision loop. The running round's liveness is
// executor_liveness.cpp.
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

} // namespace ctorch::rdzv::c10d
