// Unit tests of the c10d rendezvous decisions: no store, no clock, no threads. Each test builds a
// state, asks a decision function what one node does, and checks the action and the new state.
#include "ctorch_catch.hpp"

#include "ctorch/rdzv/c10d/decisions.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"

#include <functional>

using namespace ctorch::rdzv::c10d;
using namespace std::chrono_literals;

namespace {

const Timestamp kT0{std::chrono::milliseconds(1'700'000'000'000)};

Settings settings(int minNodes, int maxNodes) {
  Settings s;
  s.runId = "job42";
  s.minNodes = minNodes;
  s.maxNodes = maxNodes;
  return s;
}

NodeInfo node(const std::string& name, int nproc = 1, std::optional<int> requested = std::nullopt) {
  NodeInfo n;
  n.id = name + "_100_0";
  n.host = name;
  n.addr = "10.0.0." + std::to_string(name.back() - 'a' + 1);
  n.nproc = nproc;
  n.requestedRank = requested;
  return n;
}

NodeView view(const NodeInfo& self, const Settings& s, Timestamp now, std::chrono::milliseconds remaining = 600s) {
  return NodeView{self, s, now, remaining};
}

using Decide = std::function<Decision(const std::optional<State>&, const NodeView&)>;

// Applies decisions for one node until it stops writing; returns the last (non-writing) decision.
Decision drive(std::optional<State>& state, const Decide& decide, const NodeView& v,
               std::vector<Action>* actions = nullptr) {
  for (int i = 0; i < 20; ++i) {
    Decision d = decide(state, v);
    if (actions) actions->push_back(d.action);
    if (!d.writes()) return d;
    state = *d.next;
  }
  FAIL("decision loop did not settle");
  return {};
}

// Several nodes join at `now` one after the other (each drives its decisions to rest).
void joinAll(std::optional<State>& state, const std::vector<NodeInfo>& nodes, const Settings& s, Timestamp now) {
  for (const auto& n : nodes) drive(state, decideJoin, view(n, s, now));
}

// The nodes' heartbeat threads ran at `t` (keeps them alive while a test lets time pass).
void beat(std::optional<State>& state, const std::vector<NodeInfo>& nodes, Timestamp t) {
  for (const auto& n : nodes)
    if (state->heartbeats.count(n.id)) state->heartbeats[n.id] = t;
}

std::vector<std::string> ids(const State& s) {
  std::vector<std::string> out;
  for (const auto& p : s.participants) out.push_back(p.node.id);
  return out;
}

int rankOf(const State& s, const NodeInfo& n) { return s.participant(n.id)->rank; }

} // namespace

TEST_CASE("rendezvous: defaults are torchrun's", "[rendezvous]") {
  Settings s;
  CHECK(s.joinTimeout == 600s);
  CHECK(s.lastCallTimeout == 30s);
  CHECK(s.closeTimeout == 30s);
  CHECK(s.heartbeatTimeout == 5s);
  CHECK(s.readTimeout == 60s);
  CHECK(s.keepAliveInterval == 5s);
  CHECK(s.keepAliveMaxAttempt == 3);
  CHECK(s.heartbeatExpiry() == 15s);
}

TEST_CASE("rendezvous: the first node creates the state and joins round 0", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a");
  Decision d = decideJoin(std::nullopt, view(a, s, kT0));
  REQUIRE(d.action == Action::Join);
  REQUIRE(d.writes());
  const State& st = *d.next;
  CHECK(st.runId == "job42");
  CHECK(st.round == 0);
  CHECK_FALSE(st.complete);
  REQUIRE(st.participantCount() == 1);
  CHECK(st.participants[0].node == a);
  CHECK(st.participants[0].joinSeq == 0);
  CHECK(st.heartbeats.at(a.id) == kT0);
  CHECK_FALSE(st.lastCallDeadline);
  // Alone and below min: nothing more to do but wait.
  CHECK(decideJoin(st, view(a, s, kT0 + 1s)).action == Action::Wait);
}

TEST_CASE("rendezvous: the min-th node opens the last call and others wait in it", "[rendezvous]") {
  auto s = settings(2, 4);
  auto a = node("a"), b = node("b");
  std::optional<State> st;
  joinAll(st, {a}, s, kT0);
  std::vector<Action> actions;
  drive(st, decideJoin, view(b, s, kT0 + 1s), &actions);
  CHECK(actions == std::vector<Action>{Action::Join, Action::OpenLastCall, Action::Wait});
  REQUIRE(st->lastCallDeadline);
  CHECK(*st->lastCallDeadline == kT0 + 1s + 30s);
  CHECK_FALSE(st->complete);
  // Before the deadline everybody keeps waiting.
  CHECK(decideJoin(st, view(a, s, kT0 + 3s)).action == Action::Wait);
  CHECK(decideJoin(st, view(b, s, kT0 + 4s)).action == Action::Wait);
}

TEST_CASE("rendezvous: the round closes as soon as max nodes joined", "[rendezvous]") {
  auto s = settings(2, 3);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  std::vector<Action> actions;
  Decision last = drive(st, decideJoin, view(c, s, kT0 + 2s), &actions);
  CHECK(actions == std::vector<Action>{Action::Join, Action::CloseRound, Action::Finish});
  CHECK(st->complete);
  CHECK_FALSE(st->lastCallDeadline);
  CHECK(last.action == Action::Finish);
  // The others find the round complete and finish too.
  CHECK(decideJoin(st, view(a, s, kT0 + 2s)).action == Action::Finish);
  CHECK(decideJoin(st, view(b, s, kT0 + 2s)).action == Action::Finish);
}

TEST_CASE("rendezvous: the round closes when the last call ends with fewer than max nodes", "[rendezvous]") {
  auto s = settings(2, 4);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  joinAll(st, {c}, s, kT0 + 10s);  // joins during the last call; does not extend it
  CHECK(*st->lastCallDeadline == kT0 + 30s);
  beat(st, {a, b, c}, kT0 + 30s);
  CHECK(decideJoin(st, view(a, s, kT0 + 30s)).action == Action::Wait);  // the deadline itself
  Decision d = decideJoin(st, view(b, s, kT0 + 30s + 1ms));
  REQUIRE(d.action == Action::CloseRound);
  CHECK(d.next->complete);
  CHECK(d.next->participantCount() == 3);
  CHECK_THAT(d.reason, Catch::Contains("last call"));
}

TEST_CASE("rendezvous: a node arriving at a running round with room goes to the wait list", "[rendezvous]") {
  auto s = settings(2, 3);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  beat(st, {a, b}, kT0 + 31s);
  drive(st, decideJoin, view(a, s, kT0 + 31s));  // last call over: closed with two
  REQUIRE(st->complete);
  RoundResult ra = roundResult(*st, a.id);

  CHECK(assessRound(st, ra, a.id, s).status == RoundStatus::Healthy);
  std::vector<Action> actions;
  Decision d = drive(st, decideJoin, view(c, s, kT0 + 40s), &actions);
  CHECK(actions.front() == Action::AddToWaitList);
  CHECK(d.action == Action::Wait);
  CHECK(st->inWaitList(c.id));
  CHECK(st->heartbeats.count(c.id));
  // The running nodes see it at their next step boundary: re-rendezvous, not a failure.
  auto assessment = assessRound(st, ra, a.id, s);
  CHECK(assessment.status == RoundStatus::NodesWaiting);
  CHECK(assessment.nodes == std::vector<std::string>{c.id});
}

TEST_CASE("rendezvous: a late joiner triggers a new round in which old nodes keep their ranks", "[rendezvous]") {
  auto s = settings(2, 3);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  beat(st, {a, b}, kT0 + 31s);
  drive(st, decideJoin, view(a, s, kT0 + 31s));
  auto ra = roundResult(*st, a.id), rb = roundResult(*st, b.id);
  a.previousRank = ra.nodeRank;
  b.previousRank = rb.nodeRank;
  drive(st, decideJoin, view(c, s, kT0 + 40s));  // waits

  // a and b re-rendezvous: leave the round, then join the next one.
  drive(st, decideExit, view(a, s, kT0 + 41s));
  CHECK(st->complete);  // b is still in round 0
  drive(st, decideJoin, view(a, s, kT0 + 41s));
  CHECK(st->inWaitList(a.id));
  drive(st, decideExit, view(b, s, kT0 + 41s));
  CHECK(st->round == 1);  // the last leaver opens the next round
  CHECK_FALSE(st->complete);
  joinAll(st, {c, a, b}, s, kT0 + 42s);  // c joins first this time
  REQUIRE(st->complete);
  CHECK(st->participantCount() == 3);
  CHECK(st->waitList.empty());
  CHECK(rankOf(*st, a) == ra.nodeRank);
  CHECK(rankOf(*st, b) == rb.nodeRank);
  CHECK(rankOf(*st, c) == 2);
}

TEST_CASE("rendezvous: a node arriving at a full round becomes a spare without forcing a new round", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  REQUIRE(st->complete);
  auto ra = roundResult(*st, a.id);
  Decision d = drive(st, decideJoin, view(c, s, kT0 + 5s));
  CHECK(d.action == Action::Wait);
  CHECK(st->inRedundancyList(c.id));
  CHECK_FALSE(st->inWaitList(c.id));
  CHECK(assessRound(st, ra, a.id, s).status == RoundStatus::Healthy);
  // A spare does not time out while the round is full (torch 2.3+).
  CHECK(decideJoin(st, view(c, s, kT0 + 6s, -1h)).action != Action::FailTimeout);
}

TEST_CASE("rendezvous: a spare asks for a new round when a participant is lost", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  drive(st, decideJoin, view(c, s, kT0));
  REQUIRE(st->inRedundancyList(c.id));
  // b dies: a and c keep heartbeating, b's heartbeat expires.
  st->heartbeats[a.id] = kT0 + 14s;
  st->heartbeats[c.id] = kT0 + 14s;
  std::vector<Action> actions;
  drive(st, decideJoin, view(c, s, kT0 + 16s), &actions);
  CHECK(actions == std::vector<Action>{Action::RemoveDead, Action::LeaveRedundancyList,
                                       Action::AddToWaitList, Action::Wait});
  CHECK_FALSE(st->isParticipant(b.id));
  CHECK(st->inWaitList(c.id));
}

TEST_CASE("rendezvous: an expired heartbeat removes the node from every list", "[rendezvous]") {
  auto s = settings(1, 3);
  s.keepAliveInterval = 2s;
  s.keepAliveMaxAttempt = 3;  // dead after 6 s without a heartbeat
  State st = freshState("job42");
  auto a = node("a"), b = node("b"), c = node("c");
  st.participants.push_back({a, 0, 0});
  st.participants.push_back({b, 1, 1});
  st.complete = true;
  st.waitList = {c.id};
  st.heartbeats = {{a.id, kT0}, {b.id, kT0 - 10s}, {c.id, kT0 - 6s}};

  CHECK(expiredNodes(st, kT0, 6s) == std::vector<std::string>{b.id});  // exactly 6 s: still alive
  auto dead = expiredNodes(st, kT0 + 1ms, 6s);
  std::sort(dead.begin(), dead.end());
  CHECK(dead == std::vector<std::string>{b.id, c.id});

  Decision d = decideKeepAlive(st, view(a, s, kT0 + 1ms));
  REQUIRE(d.action == Action::RemoveDead);
  CHECK(ids(*d.next) == std::vector<std::string>{a.id});
  CHECK(d.next->waitList.empty());
  CHECK(d.next->heartbeats.size() == 1);
  CHECK(d.next->complete);  // a is still there: the round stays until a re-rendezvous
  CHECK_THAT(d.reason, Catch::Contains(b.id));
}

TEST_CASE("rendezvous: survivors of a lost node re-form a round without it", "[rendezvous]") {
  auto s = settings(2, 3);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b, c}, s, kT0);
  REQUIRE(st->complete);
  auto ra = roundResult(*st, a.id), rc = roundResult(*st, c.id);
  a.previousRank = ra.nodeRank;
  c.previousRank = rc.nodeRank;

  // b stops (killed); a and c heartbeat every 5 s.
  Timestamp t = kT0;
  for (int i = 0; i < 4; ++i) {
    t += 5s;
    drive(st, decideKeepAlive, view(a, s, t));
    drive(st, decideKeepAlive, view(c, s, t));
  }
  CHECK_FALSE(st->isParticipant(b.id));  // removed after 15 s without heartbeat
  auto seen = assessRound(st, ra, a.id, s);
  CHECK(seen.status == RoundStatus::PeerLost);
  CHECK(seen.nodes == std::vector<std::string>{b.id});

  drive(st, decideExit, view(a, s, t));
  drive(st, decideExit, view(c, s, t));
  CHECK(st->round == 1);
  CHECK(st->expected == std::vector<std::string>{a.id, c.id});
  joinAll(st, {a, c}, s, t);
  // Every survivor is back: the round closes at once, no last call (2 = min < max).
  REQUIRE(st->complete);
  CHECK_FALSE(st->lastCallDeadline);
  CHECK(st->participantCount() == 2);
  CHECK(rankOf(*st, a) == 0);
  CHECK(rankOf(*st, c) == 1);  // was 2; ranks stay dense
  CHECK(roundResult(*st, c.id).worldSize == 2);
}

TEST_CASE("rendezvous: below min nodes the survivor waits then fails with a clear timeout", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a");
  std::optional<State> st;
  joinAll(st, {a}, s, kT0);
  beat(st, {a}, kT0 + 599s);
  CHECK(decideJoin(st, view(a, s, kT0 + 599s, 1s)).action == Action::Wait);
  // Past the deadline: first take itself out (rollback) ...
  Decision leave = decideJoin(st, view(a, s, kT0 + 600s, -1ms));
  REQUIRE(leave.action == Action::LeaveRound);
  CHECK_FALSE(leave.next->isParticipant(a.id));
  st = *leave.next;
  // ... then fail, naming the counts and what to do.
  Decision fail = decideJoin(st, view(a, s, kT0 + 600s, -2ms));
  REQUIRE(fail.action == Action::FailTimeout);
  CHECK_THAT(fail.reason, Catch::Contains("job42") && Catch::Contains("600 s") &&
                              Catch::Contains("1 node(s) joined round 0") && Catch::Contains("at least 2"));
  // After the rollback period it fails without touching the state.
  std::optional<State> st2;
  joinAll(st2, {a}, s, kT0);
  CHECK(decideJoin(st2, view(a, s, kT0, -kRollbackPeriod - 1ms)).action == Action::FailTimeout);
}

TEST_CASE("rendezvous: requested node ranks are honoured regardless of join order", "[rendezvous]") {
  auto s = settings(3, 3);
  auto a = node("a", 1, 2), b = node("b", 1, 0), c = node("c", 1, 1);
  std::optional<State> st;
  joinAll(st, {a, b, c}, s, kT0);
  REQUIRE(st->complete);
  CHECK(rankOf(*st, a) == 2);
  CHECK(rankOf(*st, b) == 0);
  CHECK(rankOf(*st, c) == 1);
}

TEST_CASE("rendezvous: conflicting requested ranks go to the earlier joiner", "[rendezvous]") {
  std::vector<Participant> ps = {{node("a", 1, 1), 0, -1}, {node("b", 1, 1), 1, -1}, {node("c"), 2, -1},
                                 {node("d", 1, 7), 3, -1}};
  // a asked first for 1; b (also 1) and d (out of range) fill the free ranks in join order.
  CHECK(assignRanks(ps) == std::vector<int>{1, 0, 2, 3});
  // The node that did not get its rank learns it from its result.
  State st = freshState("job42");
  st.participants = ps;
  st.complete = true;
  auto ranks = assignRanks(ps);
  for (size_t i = 0; i < ranks.size(); ++i) st.participants[i].rank = ranks[i];
  auto rb = roundResult(st, ps[1].node.id);
  CHECK(rb.nodeRank == 0);
  CHECK(rb.requestedRank == 1);
}

TEST_CASE("rendezvous: without requests node ranks follow join order not host names", "[rendezvous]") {
  auto s = settings(3, 3);
  auto z = node("z"), m = node("m"), a = node("a");
  std::optional<State> st;
  joinAll(st, {z, m, a}, s, kT0);  // torch would sort a < m < z
  CHECK(rankOf(*st, z) == 0);
  CHECK(rankOf(*st, m) == 1);
  CHECK(rankOf(*st, a) == 2);
}

TEST_CASE("rendezvous: previous ranks are kept and requests beat them", "[rendezvous]") {
  auto n0 = node("a"), n1 = node("b"), n2 = node("c");
  n0.previousRank = 2;
  n1.previousRank = 0;
  n2.requestedRank = 0;  // explicit request wins over b's previous 0
  std::vector<Participant> ps = {{n0, 5, -1}, {n1, 6, -1}, {n2, 7, -1}};
  CHECK(assignRanks(ps) == std::vector<int>{2, 1, 0});
}

TEST_CASE("rendezvous: global ranks are prefix sums of heterogeneous nproc", "[rendezvous]") {
  auto s = settings(3, 3);
  auto a = node("a", 4, 1), b = node("b", 2, 0), c = node("c", 3, 2);
  std::optional<State> st;
  joinAll(st, {a, b, c}, s, kT0);
  auto rb = roundResult(*st, b.id), ra = roundResult(*st, a.id), rc = roundResult(*st, c.id);
  CHECK(rb.nodeRank == 0);
  CHECK(rb.rankBase == 0);
  CHECK(rb.localWorldSize == 2);
  CHECK(ra.nodeRank == 1);
  CHECK(ra.rankBase == 2);
  CHECK(ra.localWorldSize == 4);
  CHECK(rc.nodeRank == 2);
  CHECK(rc.rankBase == 6);
  CHECK(rc.worldSize == 9);
  CHECK(ra.worldSize == 9);
  REQUIRE(rc.nodes.size() == 3);
  CHECK(rc.nodes[0].addr == b.addr);  // node rank 0: where MASTER_ADDR points
  CHECK(rc.nodes[1].rankBase == 2);
  CHECK(rc.nodeCount == 3);
}

TEST_CASE("rendezvous: keep-alive writes only when a heartbeat is due", "[rendezvous]") {
  auto s = settings(1, 1);
  auto a = node("a");
  std::optional<State> st;
  joinAll(st, {a}, s, kT0);
  CHECK(decideKeepAlive(st, view(a, s, kT0 + 4999ms)).action == Action::Finish);
  Decision d = decideKeepAlive(st, view(a, s, kT0 + 5s));
  REQUIRE(d.action == Action::KeepAlive);
  CHECK(d.next->heartbeats.at(a.id) == kT0 + 5s);
  CHECK(decideKeepAlive(st, view(a, s, kT0 + 5s, -1ms)).action == Action::FailTimeout);
  // A node that is not in the rendezvous (removed as dead) sends nothing.
  auto stranger = node("x");
  CHECK(decideKeepAlive(st, view(stranger, s, kT0 + 10s)).action == Action::Finish);
  CHECK(decideKeepAlive(std::nullopt, view(a, s, kT0)).action == Action::Finish);
}

TEST_CASE("rendezvous: a node removed as dead learns it from the assessment", "[rendezvous]") {
  auto s = settings(1, 2);
  auto a = node("a"), b = node("b");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  REQUIRE(st->complete);
  auto rb = roundResult(*st, b.id);
  st->heartbeats[a.id] = kT0 + 20s;
  drive(st, decideKeepAlive, view(a, s, kT0 + 20s));  // b was paused for 20 s: removed
  CHECK(assessRound(st, rb, b.id, s).status == RoundStatus::Removed);
  CHECK(decideKeepAlive(st, view(b, s, kT0 + 21s)).action == Action::Finish);  // no heartbeat entry
}

TEST_CASE("rendezvous: leaving the round and the last leaver opens the next round", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a"), b = node("b");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  auto ra = roundResult(*st, a.id), rb = roundResult(*st, b.id);
  CHECK(assessRound(st, rb, b.id, s).status == RoundStatus::Healthy);
  CHECK(decideExit(std::nullopt, view(a, s, kT0)).action == Action::Finish);
  Decision d = decideExit(st, view(a, s, kT0));
  REQUIRE(d.action == Action::LeaveRound);
  st = *d.next;
  CHECK(st->complete);
  CHECK(st->round == 0);
  CHECK(assessRound(st, ra, a.id, s).status == RoundStatus::Removed);
  CHECK(assessRound(st, rb, b.id, s).status == RoundStatus::PeerLost);  // a worker restart elsewhere
  CHECK(decideExit(st, view(a, s, kT0)).action == Action::Finish);
  drive(st, decideExit, view(b, s, kT0));
  CHECK(st->round == 1);
  CHECK_FALSE(st->complete);
  CHECK(st->participants.empty());
  CHECK(decideExit(st, view(b, s, kT0, -1ms)).action == Action::Finish);
}

TEST_CASE("rendezvous: a closed rendezvous refuses new nodes and lets spares go", "[rendezvous]") {
  auto s = settings(1, 1);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a}, s, kT0);
  drive(st, decideJoin, view(b, s, kT0));
  REQUIRE(st->inRedundancyList(b.id));
  auto closing = decideClose(st, view(a, s, kT0));
  REQUIRE(closing.action == Action::MarkClosed);
  st = *closing.next;
  CHECK(decideClose(st, view(a, s, kT0)).action == Action::Finish);
  Decision late = decideJoin(st, view(c, s, kT0));
  CHECK(late.action == Action::FailClosed);
  CHECK_THAT(late.reason, Catch::Contains("job42") && Catch::Contains("closed") && Catch::Contains("--rdzv-id"));
  CHECK(decideJoin(st, view(b, s, kT0)).action == Action::ExitRedundant);
  auto ra = roundResult(*st, a.id);
  CHECK(assessRound(st, ra, a.id, s).status == RoundStatus::Closed);
  CHECK(decideClose(std::nullopt, view(a, s, kT0)).action == Action::MarkClosed);
  CHECK(decideClose(std::nullopt, view(a, s, kT0, -1ms)).action == Action::FailTimeout);
}

TEST_CASE("rendezvous: a state of another run id is refused and keys differ per run id", "[rendezvous]") {
  auto s = settings(1, 1);
  State other = freshState("other-job");
  CHECK_THROWS_AS(decideJoin(other, view(node("a"), s, kT0)), RendezvousStateError);
  CHECK_THROWS_WITH(decideKeepAlive(other, view(node("a"), s, kT0)),
                    Catch::Contains("other-job") && Catch::Contains("job42"));
  CHECK(stateKey("job42") != stateKey("job43"));
  CHECK(stateKey("job42").find("job42") != std::string::npos);
}

TEST_CASE("rendezvous: nobody joins a full round before it closes", "[rendezvous]") {
  auto s = settings(2, 2);
  State st = freshState("job42");
  st.participants = {{node("a"), 0, -1}, {node("b"), 1, -1}};
  st.heartbeats = {{node("a").id, kT0}, {node("b").id, kT0}};
  // c reads the state between b's join and the close: it must not make it three.
  auto c = node("c");
  Decision d = decideJoin(st, view(c, s, kT0));
  CHECK(d.action == Action::Wait);
  CHECK(decideJoin(st, view(node("a"), s, kT0)).action == Action::CloseRound);
}

TEST_CASE("rendezvous: roundResult refuses incomplete rounds and strangers", "[rendezvous]") {
  State st = freshState("job42");
  st.participants = {{node("a"), 0, -1}};
  CHECK_THROWS_AS(roundResult(st, node("a").id), RendezvousError);
  st.complete = true;
  st.participants[0].rank = 0;
  CHECK_THROWS_WITH(roundResult(st, node("x").id), Catch::Contains("not in round 0"));
  st.participants.push_back({node("b"), 1, 0});  // two nodes with rank 0
  CHECK_THROWS_AS(roundResult(st, node("a").id), RendezvousStateError);
}

// ---- failures, removals, leaving and the fast re-form (state version 2) ---------------------------------
TEST_CASE("rendezvous: a worker failure is reported once and every node restarts with the same count", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a"), b = node("b");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  REQUIRE(st->complete);
  auto ra = roundResult(*st, a.id), rb = roundResult(*st, b.id);
  CHECK(ra.restartCount == 0);

  // b's workers fail: b reports it, a sees it as a peer failure (counted), not a lost peer.
  Decision d = decideReportFailure(st, view(b, s, kT0 + 1s), ra.round, "rank 1 exited with code 3");
  REQUIRE(d.action == Action::ReportFailure);
  st = *d.next;
  CHECK(st->restarts == 1);
  REQUIRE(st->failure);
  CHECK(st->failure->node == b.id);
  auto seen = assessRound(st, ra, a.id, s);
  CHECK(seen.status == RoundStatus::PeerFailed);
  CHECK_THAT(seen.reason, Catch::Contains("rank 1 exited with code 3"));
  CHECK(assessRound(st, rb, b.id, s).status == RoundStatus::Healthy);  // its own report
  // A second failure in the same round (a's workers too) is not counted again.
  CHECK(decideReportFailure(st, view(a, s, kT0 + 1s), ra.round, "rank 0 exited").action == Action::Finish);
  // A report for an old round changes nothing.
  CHECK(decideReportFailure(st, view(a, s, kT0 + 1s), ra.round - 1, "x").action == Action::Finish);
  // A slow node that reads the round after the report still sees the count the round started with.
  CHECK(roundResult(*st, a.id).restartCount == 0);

  drive(st, decideExit, view(b, s, kT0 + 2s));
  drive(st, decideExit, view(a, s, kT0 + 2s));
  CHECK(st->round == 1);
  CHECK_FALSE(st->failure);
  joinAll(st, {b, a}, s, kT0 + 2s);
  REQUIRE(st->complete);
  CHECK(roundResult(*st, a.id).restartCount == 1);
  CHECK(roundResult(*st, b.id).restartCount == 1);
}

TEST_CASE("rendezvous: the store host removes a node whose connection dropped", "[rendezvous]") {
  auto s = settings(2, 3);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b, c}, s, kT0);
  REQUIRE(st->complete);
  auto ra = roundResult(*st, a.id);
  Decision d = decideRemove(st, view(a, s, kT0 + 1s), {c.id, "ghost_1_0", a.id}, "its connection closed");
  REQUIRE(d.action == Action::RemoveDead);
  CHECK_THAT(d.reason, Catch::Contains(c.id) && !Catch::Contains("ghost") && Catch::Contains("connection closed"));
  st = *d.next;
  CHECK_FALSE(st->isParticipant(c.id));
  CHECK(st->isParticipant(a.id));  // never removes itself
  CHECK(assessRound(st, ra, a.id, s).status == RoundStatus::PeerLost);
  // Gone already: nothing to do.
  CHECK(decideRemove(st, view(a, s, kT0 + 1s), {c.id}, "again").action == Action::Finish);
}

TEST_CASE("rendezvous: a re-forming round closes as soon as every expected node is back", "[rendezvous]") {
  auto s = settings(1, 4);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  beat(st, {a, b}, kT0 + 31s);
  drive(st, decideJoin, view(a, s, kT0 + 31s));  // last call over
  REQUIRE(st->complete);
  // c arrives late: waits; a and b see it at their next step boundary.
  drive(st, decideJoin, view(c, s, kT0 + 32s));
  CHECK(st->inWaitList(c.id));
  drive(st, decideExit, view(a, s, kT0 + 33s));
  drive(st, decideExit, view(b, s, kT0 + 33s));
  REQUIRE(st->round == 1);
  CHECK(st->expected.size() == 3);
  joinAll(st, {a, b}, s, kT0 + 33s);
  CHECK_FALSE(st->complete);  // c is expected and alive: a last call runs meanwhile
  CHECK(st->lastCallDeadline);
  drive(st, decideJoin, view(c, s, kT0 + 33s));
  REQUIRE(st->complete);  // all three back, long before the 30 s last call ends
  CHECK(st->participantCount() == 3);
  CHECK(st->expected.empty());
}

TEST_CASE("rendezvous: an expected node that dies does not hold the next round back", "[rendezvous]") {
  auto s = settings(1, 3);
  auto a = node("a"), b = node("b");
  std::optional<State> st;
  joinAll(st, {a, b}, s, kT0);
  beat(st, {a, b}, kT0 + 31s);
  drive(st, decideJoin, view(a, s, kT0 + 31s));
  REQUIRE(st->complete);
  drive(st, decideExit, view(a, s, kT0 + 32s));
  drive(st, decideExit, view(b, s, kT0 + 32s));  // b then dies before joining again
  joinAll(st, {a}, s, kT0 + 32s);
  CHECK_FALSE(st->complete);
  CHECK(st->isExpected(b.id));
  // 16 s later b's heartbeat has expired: removed from the expected nodes, the round closes.
  beat(st, {a}, kT0 + 48s);
  drive(st, decideJoin, view(a, s, kT0 + 48s));
  CHECK_FALSE(st->isExpected(b.id));
  REQUIRE(st->complete);
  CHECK(st->participantCount() == 1);
}

TEST_CASE("rendezvous: a node that leaves for good is not waited for", "[rendezvous]") {
  auto s = settings(1, 3);
  auto a = node("a"), b = node("b"), c = node("c");
  std::optional<State> st;
  joinAll(st, {a, b, c}, s, kT0);
  REQUIRE(st->complete);
  auto ra = roundResult(*st, a.id);
  Decision d = decideLeave(st, view(c, s, kT0 + 1s));
  REQUIRE(d.action == Action::Leave);
  st = *d.next;
  CHECK_FALSE(st->isParticipant(c.id));
  CHECK_FALSE(st->inWaitList(c.id));
  CHECK_FALSE(st->heartbeats.count(c.id));
  CHECK(assessRound(st, ra, a.id, s).status == RoundStatus::PeerLost);
  CHECK(decideLeave(st, view(c, s, kT0 + 1s)).action == Action::Finish);
  drive(st, decideExit, view(a, s, kT0 + 2s));
  drive(st, decideExit, view(b, s, kT0 + 2s));
  CHECK(st->expected == std::vector<std::string>{a.id, b.id});
  joinAll(st, {b, a}, s, kT0 + 2s);
  REQUIRE(st->complete);
  CHECK(st->participantCount() == 2);
}

TEST_CASE("rendezvous: a node that sees the close after another node left does not start a smaller group", "[rendezvous]") {
  auto s = settings(2, 2);
  auto a = node("a"), b = node("b");
  std::optional<State> st;
  drive(st, decideJoin, view(a, s, kT0));        // a waits for b
  drive(st, decideJoin, view(b, s, kT0));        // b joins and closes
  REQUIRE(st->complete);
  CHECK(st->roundSize == 2);
  // b's workers fail at once: it reports and leaves before a has even read the closed round.
  st = *decideReportFailure(st, view(b, s, kT0), st->round, "rank 1 exit 3").next;
  drive(st, decideExit, view(b, s, kT0));
  // a must not start a one-node group: it leaves too and joins the next round with b.
  std::vector<Action> actions;
  Decision d = drive(st, decideJoin, view(a, s, kT0), &actions);
  CHECK(actions.front() == Action::LeaveRound);
  CHECK(st->round == 1);
  drive(st, decideJoin, view(b, s, kT0));
  drive(st, decideJoin, view(a, s, kT0));
  REQUIRE(st->complete);
  CHECK(st->participantCount() == 2);
  CHECK(roundResult(*st, a.id).restartCount == 1);
  // Control: without the failure and the departure, a finishes at once.
  std::optional<State> st2;
  drive(st2, decideJoin, view(a, s, kT0));
  drive(st2, decideJoin, view(b, s, kT0));
  CHECK(drive(st2, decideJoin, view(a, s, kT0)).action == Action::Finish);
}

// ---- the scalable join: admitting announcements --------------------------------------------------------
namespace {
std::vector<Announcement> announced(std::int64_t round, const std::vector<NodeInfo>& nodes) {
  std::vector<Announcement> out;
  for (const auto& n : nodes) out.push_back(Announcement{round, n});
  return out;
}
} // namespace

TEST_CASE("rendezvous: announcements are admitted in number order in one write", "[rendezvous]") {
  auto s = settings(3, 5);
  const auto a = node("a"), b = node("b"), c = node("c"), d = node("d");
  SECTION("below min: Join, and the first admitted is the designated writer") {
    Decision x = admitAnnounced(std::nullopt, view(b, s, kT0), announced(0, {a, b}), 2);
    REQUIRE(x.action == Action::Join);
    CHECK(ids(*x.next) == std::vector<std::string>{a.id, b.id});
    CHECK(x.next->announced == 2);
    CHECK(x.next->nextJoinSeq == 2);
    CHECK(x.next->heartbeats.at(a.id) == kT0);
    CHECK(designatedWriter(x.next) == a.id);
    CHECK_FALSE(x.next->lastCallDeadline);
    CHECK(x.reason.find("admitted 2") != std::string::npos);
  }
  SECTION("at min: the same write opens the last call") {
    Decision x = admitAnnounced(std::nullopt, view(a, s, kT0), announced(0, {a, b, c}), 3);
    REQUIRE(x.action == Action::OpenLastCall);
    CHECK(x.next->lastCallDeadline == kT0 + s.lastCallTimeout);
    CHECK_FALSE(x.next->complete);
  }
  SECTION("at max: the same write closes the round; the rest are consumed, not admitted") {
    auto e = node("e"), f = node("f");
    Decision x = admitAnnounced(std::nullopt, view(a, s, kT0), announced(0, {a, b, c, d, e, f}), 6);
    REQUIRE(x.action == Action::CloseRound);
    CHECK(x.next->complete);
    CHECK(x.next->participantCount() == 5);
    CHECK_FALSE(x.next->isParticipant(f.id));
    CHECK(x.next->announced == 6);
    CHECK(rankOf(*x.next, a) == 0);
    CHECK(rankOf(*x.next, e) == 4);
    CHECK_FALSE(designatedWriter(x.next));  // complete: nobody writes for it
  }
  SECTION("a stale round's announcement and a second one of a participant are consumed only") {
    Decision x = admitAnnounced(std::nullopt, view(a, s, kT0), announced(0, {a}), 1);
    std::optional<State> st = *x.next;
    auto batch = announced(0, {a, b});
    batch.push_back(Announcement{7, c});  // announced for a round that is not this one
    Decision y = admitAnnounced(st, view(a, s, kT0 + 1s), batch, 4);  // number 4 unreadable: skipped
    REQUIRE(y.action == Action::Join);
    CHECK(ids(*y.next) == std::vector<std::string>{a.id, b.id});
    CHECK(y.next->announced == 4);
    CHECK(y.next->heartbeats.at(a.id) == kT0);  // a's entry untouched
  }
  SECTION("nothing pending, a complete or closed round: no write") {
    Decision x = admitAnnounced(std::nullopt, view(a, s, kT0), announced(0, {a}), 1);
    CHECK(admitAnnounced(x.next, view(a, s, kT0), {}, 1).action == Action::Finish);
    State done = *x.next;
    done.complete = true;
    CHECK(admitAnnounced(done, view(a, s, kT0), announced(0, {b}), 2).action == Action::Finish);
    done.complete = false;
    done.closed = true;
    CHECK(admitAnnounced(done, view(a, s, kT0), announced(0, {b}), 2).action == Action::Finish);
  }
  SECTION("a re-forming round closes once every expected node is back, and admission clears the wait list") {
    State st = freshState(s.runId);
    st.round = 3;
    st.expected = {a.id, b.id, c.id};
    st.waitList = {a.id, b.id, c.id};
    for (const auto& n : {a, b, c}) st.heartbeats[n.id] = kT0;
    Decision x = admitAnnounced(st, view(a, s, kT0), announced(3, {c, a}), 2);
    REQUIRE(x.action == Action::Join);  // 2 of min 3
    CHECK(x.next->waitList == std::vector<std::string>{b.id});
    CHECK(designatedWriter(x.next) == c.id);  // first admitted
    Decision y = admitAnnounced(x.next, view(c, s, kT0), announced(3, {b}), 3);
    REQUIRE(y.action == Action::CloseRound);  // 3 of max 5, but every expected node is back
    CHECK(y.next->complete);
    CHECK(y.next->waitList.empty());
  }
  SECTION("another run's state is refused") {
    State other = freshState("other-job");
    CHECK_THROWS_AS(admitAnnounced(other, view(a, s, kT0), announced(0, {a}), 1), RendezvousStateError);
  }
}
