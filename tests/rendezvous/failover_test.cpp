// Unit tests of the store-failover decisions (ctorch/rdzv/c10d/failover.hpp): no store, no probe,
// no clock. Each test builds the round a node last ran (and the state it last saw) and checks who
// takes the store over, whether it may, and when a node is on the minority side.
#include "ctorch_catch.hpp"

#include "ctorch/rdzv/c10d/failover.hpp"

using namespace ctorch::rdzv::c10d;
using namespace std::chrono_literals;

namespace {

// A complete round of `n` nodes "a", "b", ... by node rank; the first serves the store, every
// other keeps a standby on port 4000 + its rank.
RoundResult roundOf(int n, std::int64_t number = 3) {
  RoundResult r;
  r.round = number;
  r.nodeCount = n;
  for (int i = 0; i < n; ++i) {
    NodeSlot s;
    s.id = std::string(1, static_cast<char>('a' + i)) + "_100_0";
    s.addr = "10.0.0." + std::to_string(i + 1);
    s.nodeRank = i;
    s.storeHost = i == 0;
    if (i != 0) s.standbyPort = 4000 + i;
    r.nodes.push_back(s);
    r.participantIds.push_back(s.id);
  }
  return r;
}

// The state a node last saw, with these nodes still in it (a heartbeat each).
State stateWith(const std::vector<std::string>& ids) {
  State s;
  s.runId = "job";
  for (const auto& id : ids) s.heartbeats[id] = Timestamp(1'700'000'000'000ms);
  return s;
}

} // namespace

TEST_CASE("failover: every survivor computes the same successor: the first node by rank that did not serve the store", "[rendezvous]") {
  auto r = roundOf(4);
  auto plan = planFailover(r);
  CHECK(plan.lost == std::vector<std::string>{"a_100_0"});
  REQUIRE(plan.successor);
  CHECK(plan.successor->id == "b_100_0");
  CHECK(plan.successor->standbyPort == 4001);

  // A node without a standby (an older ctorchrun, or one that served a store) is skipped.
  r.nodes[1].standbyPort.reset();
  CHECK(planFailover(r).successor->id == "c_100_0");
  // The store's host need not be node rank 0.
  auto moved = roundOf(3);
  moved.nodes[0].storeHost = false;
  moved.nodes[0].standbyPort = 4000;
  moved.nodes[1].storeHost = true;
  moved.nodes[1].standbyPort.reset();
  plan = planFailover(moved);
  CHECK(plan.lost == std::vector<std::string>{"b_100_0"});
  CHECK(plan.successor->id == "a_100_0");
}

TEST_CASE("failover: no standby anywhere: no successor", "[rendezvous]") {
  auto r = roundOf(3);
  for (auto& n : r.nodes) n.standbyPort.reset();
  auto plan = planFailover(r);
  CHECK_FALSE(plan.successor);
  CHECK(plan.lost.size() == 1);
}

TEST_CASE("failover: the successor probes the round's other standbys, not itself nor the lost store host", "[rendezvous]") {
  const auto r = roundOf(4);
  std::vector<std::string> ids;
  for (const auto& n : majorityProbes(r, "b_100_0")) ids.push_back(n.id);
  CHECK(ids == std::vector<std::string>{"c_100_0", "d_100_0"});
}

TEST_CASE("failover: only a majority of the round may take the store over", "[rendezvous]") {
  const auto three = roundOf(3);
  CHECK_FALSE(refuseTakeOver(three, 2));  // 2 of 3
  CHECK_FALSE(refuseTakeOver(three, 3));
  auto refused = refuseTakeOver(three, 1);
  REQUIRE(refused);
  CHECK(*refused == "only 1 of round 3's 3 nodes answer from here (a majority must, or this node may be the one "
                    "cut off): not taking the store over");
  // Two nodes: the survivor of the store host holds half, which is no majority.
  CHECK(refuseTakeOver(roundOf(2), 1));
  const auto four = roundOf(4);
  CHECK(refuseTakeOver(four, 2));
  CHECK_FALSE(refuseTakeOver(four, 3));
}

TEST_CASE("failover: a survivor waits for the successor twice the heartbeat expiry and 2 s", "[rendezvous]") {
  Settings s;
  s.keepAliveInterval = 1s;
  s.keepAliveMaxAttempt = 3;
  CHECK(successorWait(s) == 8s);
}

TEST_CASE("failover: a node whose round kept no more than half its nodes is on the minority side", "[rendezvous]") {
  const auto r = roundOf(3);
  CHECK_FALSE(minorityReason(r, stateWith({"a_100_0", "b_100_0", "c_100_0"})));
  CHECK_FALSE(minorityReason(r, stateWith({"b_100_0", "c_100_0"})));  // the store host lost: 2 of 3
  auto why = minorityReason(r, stateWith({"a_100_0"}));             // the store host, cut off
  REQUIRE(why);
  CHECK(*why == "only 1 of round 3's 3 nodes are left here, not a majority; this node is cut off from the others "
                "(they may have taken the store over with --store-failover)");
  // Nodes of another round or the wait list count only when they were in this round.
  CHECK(minorityReason(r, stateWith({"a_100_0", "x_100_0", "y_100_0"})));
  // A round of one node has no minority.
  CHECK_FALSE(minorityReason(roundOf(1), stateWith({})));
}

TEST_CASE("failover: a round formed with no more than half of the previous one is refused", "[rendezvous]") {
  const auto previous = roundOf(4, 2);
  CHECK_FALSE(minorityRoundReason(previous, roundOf(3, 3)));
  CHECK_FALSE(minorityRoundReason(roundOf(3, 2), roundOf(2, 3)));
  auto why = minorityRoundReason(previous, roundOf(2, 3));
  REQUIRE(why);
  CHECK(*why == "round 3 formed with 2 of the previous round's 4 nodes: not a majority, so the other side may have "
                "taken the store over (--store-failover) and trains on; this side stops");
}
