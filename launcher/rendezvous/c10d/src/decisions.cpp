#include "ctorch/rdzv/c10d/decisions.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/text/text.hpp"

#include <algorithm>
#include <numeric>

namespace ctorch::rdzv::c10d {

const char* toString(Action a) {
  switch (a) {
    case Action::Finish: return "finish";
    case Action::Wait: return "wait";
    case Action::RemoveDead: return "remove-dead";
    case Action::Join: return "join";
    case Action::OpenLastCall: return "open-last-call";
    case Action::CloseRound: return "close-round";
    case Action::AddToWaitList: return "add-to-wait-list";
    case Action::AddToRedundancyList: return "add-to-redundancy-list";
    case Action::LeaveRound: return "leave-round";
    case Action::Leave: return "leave";
    case Action::LeaveWaitList: return "leave-wait-list";
    case Action::LeaveRedundancyList: return "leave-redundancy-list";
    case Action::KeepAlive: return "keep-alive";
    case Action::ReportFailure: return "report-failure";
    case Action::MarkClosed: return "mark-closed";
    case Action::FailTimeout: return "fail-timeout";
    case Action::FailClosed: return "fail-closed";
    case Action::ExitRedundant: return "exit-redundant";
  }
  return "?";
}

const char* toString(RoundStatus s) {
  switch (s) {
    case RoundStatus::Healthy: return "healthy";
    case RoundStatus::NodesWaiting: return "nodes-waiting";
    case RoundStatus::PeerFailed: return "peer-failed";
    case RoundStatus::PeerLost: return "peer-lost";
    case RoundStatus::Removed: return "removed";
    case RoundStatus::Superseded: return "superseded";
    case RoundStatus::Closed: return "closed";
  }
  return "?";
}

namespace {

std::string list(const std::vector<std::string>& ids) {
  std::string out;
  for (const auto& id : ids) out += (out.empty() ? "'" : ", '") + id + "'";
  return out;
}

std::string nnodes(const Settings& s) {
  return s.minNodes == s.maxNodes ? std::to_string(s.minNodes)
                                  : std::to_string(s.minNodes) + ":" + std::to_string(s.maxNodes);
}

std::string roundText(const State& s) { return "round " + std::to_string(s.round); }

void checkRunId(const State& s, const Settings& settings) {
  if (s.runId != settings.runId)
    throw RendezvousStateError("the rendezvous state belongs to run '" + s.runId + "', not '" +
                               settings.runId + "'");
}

void erase(std::vector<std::string>& v, const std::string& id) {
  v.erase(std::remove(v.begin(), v.end(), id), v.end());
}

// torch's _remove_participant_epilogue, plus: the next round expects the waiting nodes (the
// previous round's nodes that left to re-join are among them).
void afterParticipantRemoved(State& s, int minNodes) {
  if (s.complete) {
    if (s.participants.empty()) {
      s.complete = false;
      s.round += 1;
      s.lastCallDeadline.reset();
      s.failure.reset();
      s.roundSize = 0;
      s.expected = s.waitList;
    }
  } else if (s.participantCount() < minNodes) {
    s.lastCallDeadline.reset();
  }
}

// Ranks assigned, complete; waiting nodes left out become spares rather than asking for yet
// another round.
State closeRound(const State& s) {
  State next = s;
  next.complete = true;
  next.lastCallDeadline.reset();
  next.expected.clear();
  next.roundSize = next.participantCount();
  auto ranks = assignRanks(next.participants);
  for (std::size_t i = 0; i < ranks.size(); ++i) next.participants[i].rank = ranks[i];
  for (const auto& id : next.waitList)
    if (!next.isParticipant(id) && !next.inRedundancyList(id)) next.redundancyList.push_back(id);
  next.waitList.clear();
  return next;
}

// This node leaves its round to join the next one: back on the wait list (still in the
// rendezvous, only not in the round), and expected by the round that follows if it was the last
// node to leave.
State leaveToRejoin(const State& s, const NodeView& v) {
  State left = removeNodes(s, {v.self.id}, v.settings.minNodes);
  if (s.complete) {
    if (!left.inWaitList(v.self.id)) left.waitList.push_back(v.self.id);
    if (left.round != s.round && !left.isExpected(v.self.id)) left.expected.push_back(v.self.id);
    left.heartbeats[v.self.id] = v.now;
  }
  return left;
}

bool everyExpectedJoined(const State& s) {
  if (s.expected.empty()) return false;
  for (const auto& id : s.expected)
    if (!s.isParticipant(id)) return false;
  return true;
}

Decision write(Action a, State next, std::string reason) {
  return Decision{a, std::move(next), std::move(reason)};
}

Decision noWrite(Action a, std::string reason) { return Decision{a, std::nullopt, std::move(reason)}; }

bool heartbeatDue(const State& s, const NodeView& v) {
  auto it = s.heartbeats.find(v.self.id);
  if (it == s.heartbeats.end()) return false;  // not in the rendezvous (any more)
  return it->second <= v.now - v.settings.keepAliveInterval;
}

Decision keepAliveOrWait(const State& s, const NodeView& v, std::string why) {
  if (heartbeatDue(s, v)) {
    State next = s;
    next.heartbeats[v.self.id] = v.now;
    return write(Action::KeepAlive, std::move(next), "heartbeat (" + why + ")");
  }
  return noWrite(Action::Wait, std::move(why));
}

std::string timeoutReason(const State& s, const NodeView& v) {
  const auto& set = v.settings;
  std::string head = "rendezvous '" + set.runId + "' timed out after " + text::secondsText(set.joinTimeout) + ": ";
  if (!s.complete) {
    int n = s.participantCount() - (s.isParticipant(v.self.id) ? 1 : 0) + 1;
    return head + std::to_string(n) + " node(s) joined " + roundText(s) + ", at least " +
           std::to_string(set.minNodes) + " needed (--nnodes " + nnodes(set) +
           "); start the missing nodes or lower the minimum";
  }
  return head + roundText(s) + " is running with " + std::to_string(s.participantCount()) +
         " node(s) and did not admit this node (its nodes did not re-rendezvous in time)";
}

} // namespace

std::vector<std::string> expiredNodes(const State& s, Timestamp now, std::chrono::milliseconds expiry) {
  std::vector<std::string> dead;
  for (const auto& [id, t] : s.heartbeats)
    if (t < now - expiry) dead.push_back(id);
  return dead;
}

State removeNodes(const State& state, const std::vector<std::string>& ids, int minNodes) {
  State s = state;
  bool participantRemoved = false;
  for (const auto& id : ids) {
    s.heartbeats.erase(id);
    auto before = s.participants.size();
    s.participants.erase(std::remove_if(s.participants.begin(), s.participants.end(),
                                        [&](const Participant& p) { return p.node.id == id; }),
                         s.participants.end());
    participantRemoved = participantRemoved || s.participants.size() != before;
    erase(s.waitList, id);
    erase(s.redundancyList, id);
    erase(s.expected, id);
  }
  if (participantRemoved) afterParticipantRemoved(s, minNodes);
  return s;
}

std::vector<int> assignRanks(const std::vector<Participant>& participants) {
  const int n = static_cast<int>(participants.size());
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return participants[a].joinSeq < participants[b].joinSeq;
  });
  std::vector<int> rank(n, -1);
  std::vector<bool> taken(n, false);
  auto claim = [&](int i, const std::optional<int>& want) {
    if (rank[i] < 0 && want && *want >= 0 && *want < n && !taken[*want]) {
      rank[i] = *want;
      taken[*want] = true;
    }
  };
  for (int i : order) claim(i, participants[i].node.requestedRank);
  for (int i : order) claim(i, participants[i].node.previousRank);
  int next = 0;
  for (int i : order) {
    if (rank[i] >= 0) continue;
    while (taken[next]) ++next;
    rank[i] = next;
    taken[next] = true;
  }
  return rank;
}

// ---- operations --------------------------------------------------------------------------------------
Decision decideJoin(const std::optional<State>& current, const NodeView& v) {
  const Settings& set = v.settings;
  const std::string& me = v.self.id;
  State s = current ? *current : freshState(set.runId);
  checkRunId(s, set);

  if (auto dead = expiredNodes(s, v.now, set.heartbeatExpiry()); !dead.empty())
    return write(Action::RemoveDead, removeNodes(s, dead, set.minNodes),
                 "removing " + list(dead) + ": no heartbeat for more than " + text::secondsText(set.heartbeatExpiry()));

  if (s.closed) {
    if (s.inRedundancyList(me))
      return noWrite(Action::ExitRedundant, "rendezvous '" + set.runId +
                                                "' was closed while this node waited as a spare");
    return noWrite(Action::FailClosed, "rendezvous '" + set.runId +
                                           "' is closed (its job finished or was shut down); "
                                           "a new job needs a new --rdzv-id");
  }

  const int n = s.participantCount();
  if (s.inRedundancyList(me)) {
    // A spare waits, without a deadline, until the running round has room (torch 2.3+).
    if (n >= set.maxNodes)
      return keepAliveOrWait(s, v, "spare while " + roundText(s) + " is full");
    State next = s;
    erase(next.redundancyList, me);
    next.heartbeats[me] = v.now;
    return write(Action::LeaveRedundancyList, std::move(next),
                 roundText(s) + " has room (" + std::to_string(n) + " of " + std::to_string(set.maxNodes) +
                     " nodes): no longer a spare");
  }

  const bool isParticipant = s.isParticipant(me);
  if (s.complete && isParticipant) {
    // A node can notice the close late, after another node already left the round (its
    // workers failed, or it died): starting workers for the smaller group would be wrong.
    if (s.participantCount() < s.roundSize || (s.failure && s.failure->round == s.round))
      return write(Action::LeaveRound, leaveToRejoin(s, v),
                   roundText(s) + " lost a node before this node started: leaving it to join the next one");
    return noWrite(Action::Finish, "joined " + roundText(s));
  }

  if (v.remaining.count() < 0) {
    if (v.remaining >= -kRollbackPeriod) {
      // Take ourselves out so that the others need not wait for our heartbeat to expire.
      if (isParticipant) {
        State next = removeNodes(s, {me}, set.minNodes);
        return write(Action::LeaveRound, std::move(next), "join timeout: leaving " + roundText(s));
      }
      if (s.inWaitList(me)) {
        State next = removeNodes(s, {me}, set.minNodes);
        return write(Action::LeaveWaitList, std::move(next), "join timeout: leaving the wait list");
      }
    }
    return noWrite(Action::FailTimeout, timeoutReason(s, v));
  }

  if (s.complete) {
    if (n < set.maxNodes) {
      if (!s.inWaitList(me)) {
        State next = s;
        next.waitList.push_back(me);
        next.heartbeats[me] = v.now;
        return write(Action::AddToWaitList, std::move(next),
                     roundText(s) + " is running with " + std::to_string(n) + " of up to " +
                         std::to_string(set.maxNodes) + " nodes: waiting for the next round");
      }
    } else if (!s.inWaitList(me)) {
      State next = s;
      next.redundancyList.push_back(me);
      next.heartbeats[me] = v.now;
      return write(Action::AddToRedundancyList, std::move(next),
                   roundText(s) + " is full (" + std::to_string(n) + " nodes): waiting as a spare");
    }
    return keepAliveOrWait(s, v, "waiting for " + roundText(s) + " to end");
  }

  if (isParticipant) {
    if (n >= set.maxNodes)
      return write(Action::CloseRound, closeRound(s),
                   "closing " + roundText(s) + ": " + std::to_string(n) + " of max " +
                       std::to_string(set.maxNodes) + " nodes joined");
    if (n >= set.minNodes && everyExpectedJoined(s))
      return write(Action::CloseRound, closeRound(s),
                   "closing " + roundText(s) + " with " + std::to_string(n) +
                       " nodes: every node of the previous round and every waiting node is back");
    if (n >= set.minNodes) {
      if (!s.lastCallDeadline) {
        State next = s;
        next.lastCallDeadline = v.now + set.lastCallTimeout;
        return write(Action::OpenLastCall, std::move(next),
                     std::to_string(n) + " of min " + std::to_string(set.minNodes) +
                         " nodes joined " + roundText(s) + ": last call for " + text::secondsText(set.lastCallTimeout));
      }
      if (*s.lastCallDeadline < v.now)
        return write(Action::CloseRound, closeRound(s),
                     "closing " + roundText(s) + " at the end of its last call with " + std::to_string(n) +
                         " nodes (max " + std::to_string(set.maxNodes) + ")");
    }
    return keepAliveOrWait(s, v, "waiting in " + roundText(s) + " (" + std::to_string(n) + " of min " +
                                     std::to_string(set.minNodes) + ", max " +
                                     std::to_string(set.maxNodes) + " nodes)");
  }

  if (n < set.maxNodes) {
    State next = s;
    erase(next.waitList, me);
    erase(next.redundancyList, me);
    next.participants.push_back(Participant{v.self, next.nextJoinSeq++, -1});
    next.heartbeats[me] = v.now;
    return write(Action::Join, std::move(next),
                 "joining " + roundText(s) + " as node " + std::to_string(n + 1) + " of " + nnodes(set));
  }
  // Full but not closed yet: whoever decides next closes it; then this node becomes a spare.
  return keepAliveOrWait(s, v, roundText(s) + " is full and about to close");
}

std::optional<std::string> designatedWriter(const std::optional<State>& current) {
  if (!current || current->complete || current->closed || current->participants.empty()) return std::nullopt;
  const Participant* first = &current->participants.front();
  for (const auto& p : current->participants)
    if (p.joinSeq < first->joinSeq) first = &p;
  return first->node.id;
}

Decision admitAnnounced(const std::optional<State>& current, const NodeView& v,
                        const std::vector<Announcement>& batch, std::int64_t lastNumber) {
  const Settings& set = v.settings;
  State s = current ? *current : freshState(set.runId);
  checkRunId(s, set);
  if (s.complete || s.closed || lastNumber <= s.announced)
    return noWrite(Action::Finish, "no announcement to admit");
  State next = s;
  next.announced = lastNumber;
  int admitted = 0;
  for (const auto& a : batch) {
    if (a.round != next.round || next.isParticipant(a.node.id) || next.participantCount() >= set.maxNodes)
      continue;
    erase(next.waitList, a.node.id);
    erase(next.redundancyList, a.node.id);
    next.participants.push_back(Participant{a.node, next.nextJoinSeq++, -1});
    next.heartbeats[a.node.id] = v.now;
    ++admitted;
  }
  const int n = next.participantCount();
  std::string head = "admitted " + std::to_string(admitted) + " announced node(s) to " + roundText(s) + " (" +
                     std::to_string(n) + " of " + nnodes(set) + ")";
  if (n >= set.maxNodes)
    return write(Action::CloseRound, closeRound(next), head + "; closing it: max nodes joined");
  if (n >= set.minNodes && everyExpectedJoined(next))
    return write(Action::CloseRound, closeRound(next),
                 head + "; closing it: every node of the previous round and every waiting node is back");
  if (n >= set.minNodes && !next.lastCallDeadline) {
    next.lastCallDeadline = v.now + set.lastCallTimeout;
    return write(Action::OpenLastCall, std::move(next), head + "; last call for " + text::secondsText(set.lastCallTimeout));
  }
  return write(Action::Join, std::move(next), head);
}

Decision decideExit(const std::optional<State>& current, const NodeView& v) {
  if (!current) return noWrite(Action::Finish, "no rendezvous state: nothing to leave");
  const State& s = *current;
  checkRunId(s, v.settings);
  if (!s.isParticipant(v.self.id)) return noWrite(Action::Finish, "not in any round");
  if (v.remaining.count() < 0)
    return noWrite(Action::FailTimeout, "rendezvous '" + v.settings.runId + "' timed out leaving " +
                                            roundText(s));
  return write(Action::LeaveRound, leaveToRejoin(s, v), "leaving " + roundText(s) + " to join the next one");
}

Decision decideLeave(const std::optional<State>& current, const NodeView& v) {
  if (!current) return noWrite(Action::Finish, "no rendezvous state: nothing to leave");
  const State& s = *current;
  checkRunId(s, v.settings);
  const std::string& me = v.self.id;
  if (!s.isParticipant(me) && !s.inWaitList(me) && !s.inRedundancyList(me) && !s.heartbeats.count(me))
    return noWrite(Action::Finish, "not in the rendezvous");
  if (v.remaining.count() < 0)
    return noWrite(Action::FailTimeout, "rendezvous '" + v.settings.runId + "' timed out leaving " +
                                            roundText(s));
  return write(Action::Leave, removeNodes(s, {me}, v.settings.minNodes),
               "leaving rendezvous '" + v.settings.runId + "' for good (" + roundText(s) + ")");
}

Decision decideReportFailure(const std::optional<State>& current, const NodeView& v, std::int64_t round,
                             const std::string& reason) {
  if (!current) return noWrite(Action::Finish, "no rendezvous state");
  const State& s = *current;
  checkRunId(s, v.settings);
  if (s.round != round || !s.complete || !s.isParticipant(v.self.id))
    return noWrite(Action::Finish, "round " + std::to_string(round) + " is over: nothing to report");
  if (s.failure && s.failure->round == round)
    return noWrite(Action::Finish, "a failure of " + roundText(s) + " was already reported by '" +
                                       s.failure->node + "'");
  if (v.remaining.count() < 0)
    return noWrite(Action::FailTimeout, "rendezvous '" + v.settings.runId +
                                            "': the failure report did not reach the store in time");
  State next = s;
  next.failure = Failure{round, v.self.id, reason};
  next.restarts += 1;
  return write(Action::ReportFailure, std::move(next),
               "reporting the failure of this node's workers in " + roundText(s) + " (" + reason +
                   "): every node restarts, restart " + std::to_string(next.restarts) + " of the job");
}

Decision decideRemove(const std::optional<State>& current, const NodeView& v,
                      const std::vector<std::string>& ids, const std::string& why) {
  if (!current) return noWrite(Action::Finish, "no rendezvous state");
  const State& s = *current;
  checkRunId(s, v.settings);
  std::vector<std::string> present;
  for (const auto& id : ids)
    if (id != v.self.id && (s.isParticipant(id) || s.inWaitList(id) || s.inRedundancyList(id) ||
                            s.heartbeats.count(id)))
      present.push_back(id);
  if (present.empty() || s.closed) return noWrite(Action::Finish, "nothing to remove");
  if (v.remaining.count() < 0)
    return noWrite(Action::FailTimeout, "rendezvous '" + v.settings.runId + "': could not remove " +
                                            list(present) + " in time");
  return write(Action::RemoveDead, removeNodes(s, present, v.settings.minNodes),
               "removing " + list(present) + ": " + why);
}

Decision decideKeepAlive(const std::optional<State>& current, const NodeView& v) {
  if (!current) return noWrite(Action::Finish, "no rendezvous state");
  const State& s = *current;
  checkRunId(s, v.settings);
  if (auto dead = expiredNodes(s, v.now, v.settings.heartbeatExpiry()); !dead.empty())
    return write(Action::RemoveDead, removeNodes(s, dead, v.settings.minNodes),
                 "removing " + list(dead) + ": no heartbeat for more than " +
                     text::secondsText(v.settings.heartbeatExpiry()));
  if (!heartbeatDue(s, v)) return noWrite(Action::Finish, "heartbeat is fresh");
  if (v.remaining.count() < 0)
    return noWrite(Action::FailTimeout, "rendezvous '" + v.settings.runId + "': the heartbeat did not reach "
                                        "the store within " + text::secondsText(v.settings.heartbeatTimeout));
  State next = s;
  next.heartbeats[v.self.id] = v.now;
  return write(Action::KeepAlive, std::move(next), "heartbeat");
}

Decision decideClose(const std::optional<State>& current, const NodeView& v) {
  State s = current ? *current : freshState(v.settings.runId);
  checkRunId(s, v.settings);
  if (s.closed) return noWrite(Action::Finish, "rendezvous is closed");
  if (v.remaining.count() < 0)
    return noWrite(Action::FailTimeout, "rendezvous '" + v.settings.runId + "' could not be closed within " +
                                            text::secondsText(v.settings.closeTimeout));
  s.closed = true;
  return write(Action::MarkClosed, std::move(s), "closing rendezvous '" + v.settings.runId + "'");
}

// ---- results -------------------------------------------------------------------------------------------
RoundResult roundResult(const State& s, std::string_view selfId) {
  if (!s.complete)
    throw RendezvousError("round " + std::to_string(s.round) + " of rendezvous '" + s.runId +
                          "' is not complete");
  const Participant* me = s.participant(selfId);
  if (!me)
    throw RendezvousError("node '" + std::string(selfId) + "' is not in round " + std::to_string(s.round) +
                          " of rendezvous '" + s.runId + "'");
  std::vector<const Participant*> byRank(s.participants.size(), nullptr);
  for (const auto& p : s.participants) {
    if (p.rank < 0 || p.rank >= static_cast<int>(byRank.size()) || byRank[p.rank])
      throw RendezvousStateError("round " + std::to_string(s.round) + " of rendezvous '" + s.runId +
                                 "' has invalid node ranks");
    byRank[p.rank] = &p;
  }
  RoundResult r;
  r.round = s.round;
  r.nodeCount = static_cast<int>(byRank.size());
  int base = 0;
  for (const Participant* p : byRank) {
    r.nodes.push_back(NodeSlot{p->node.id, p->node.host, p->node.addr, p->rank, p->node.nproc, base,
                               p->node.storePort, p->node.standbyPort, p->node.storeHost});
    r.participantIds.push_back(p->node.id);
    if (p == me) {
      r.nodeRank = p->rank;
      r.localWorldSize = p->node.nproc;
      r.rankBase = base;
    }
    base += p->node.nproc;
  }
  r.worldSize = base;
  r.requestedRank = me->node.requestedRank;
  // A failure reported in this round already counted the restart that follows it.
  r.restartCount = s.restarts - (s.failure && s.failure->round == s.round ? 1 : 0);
  return r;
}

RoundAssessment assessRound(const std::optional<State>& current, const RoundResult& joined,
                            std::string_view selfId, const Settings& settings) {
  RoundAssessment a;
  if (!current) {
    a.status = RoundStatus::Superseded;
    a.reason = "the rendezvous state is gone from the store";
    return a;
  }
  const State& s = *current;
  if (s.failure && s.round == joined.round && s.failure->round == joined.round && s.failure->node != selfId) {
    a.status = RoundStatus::PeerFailed;
    a.nodes.push_back(s.failure->node);
    a.reason = "workers failed on node '" + s.failure->node + "' (" + s.failure->reason + ")";
    return a;
  }
  if (s.closed) {
    a.status = RoundStatus::Closed;
    a.reason = "the rendezvous was closed";
    return a;
  }
  if (s.round != joined.round) {
    a.status = RoundStatus::Superseded;
    a.reason = "the rendezvous moved on to round " + std::to_string(s.round) + " (this node ran round " +
               std::to_string(joined.round) + ")";
    return a;
  }
  if (!s.isParticipant(selfId)) {
    a.status = RoundStatus::Removed;
    a.reason = "this node was removed from round " + std::to_string(s.round) +
               " (its heartbeat expired or it left)";
    return a;
  }
  for (const auto& id : joined.participantIds)
    if (!s.isParticipant(id)) a.nodes.push_back(id);
  if (!a.nodes.empty()) {
    a.status = RoundStatus::PeerLost;
    a.reason = "node(s) " + list(a.nodes) + " left round " + std::to_string(s.round);
    return a;
  }
  if (s.participantCount() < settings.maxNodes) {
    for (const auto& id : s.waitList)
      if (!s.isParticipant(id)) a.nodes.push_back(id);
    if (!a.nodes.empty()) {
      a.status = RoundStatus::NodesWaiting;
      a.reason = std::to_string(a.nodes.size()) + " node(s) wait to join: " + list(a.nodes);
      return a;
    }
  }
  a.status = RoundStatus::Healthy;
  return a;
}

} // namespace ctorch::rdzv::c10d
