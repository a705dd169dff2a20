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
  CHECK_FALSE(refuseTakeOver(three, {"b_100_0", "c_100_0"}));  // 2 of 3
  CHECK_FALSE(refuseTakeOver(three, {"a_100_0", "b_100_0", "c_100_0"}));
  auto refused = refuseTakeOver(three, {"b_100_0"});
  REQUIRE(refused);
  CHECK(*refused == "only 1 of round 3's 3 nodes confirm that they lost the rendezvous store too (a majority must: "
                    "the others still reach it, or this node is the one cut off): not taking the store over");
  // Two nodes: the survivor of the store host holds half, which is no majority.
  CHECK(refuseTakeOver(roundOf(2), {"b_100_0"}));
  const auto four = roundOf(4);
  CHECK(refuseTakeOver(four, {"b_100_0", "c_100_0"}));
  CHECK_FALSE(refuseTakeOver(four, {"b_100_0", "c_100_0", "d_100_0"}));
  // Ids that are not in the round (a newcomer, a node of an older round, an outsider's name) do not count.
  CHECK(refuseTakeOver(three, {"b_100_0", "x_100_0", "y_100_0"}));
}

// Issue 47: with only the a-b link cut, c still reaches the store; its standby answering must not
// count as a vote. Only a mark that c wrote because it lost the store too does.
TEST_CASE("failover: a node counts towards the majority only by a loss mark that confirms it lost the store in this round", "[rendezvous]") {
  const auto r = roundOf(3, 5);
  const auto plan = planFailover(r);
  const NodeSlot& c = r.nodes[2];
  CHECK(lossMarkKey("job", 5) == "ctorchrun/failover/job/lost/5");
  const std::string mark = lossMarkValue("job", r, c.id, plan, "");
  CHECK(mark == "ctorchrun-lost-store 1\njob\n5\nc_100_0\na_100_0\n-");
  CHECK(confirmsLoss(mark, "job", r, c, plan, ""));
  // A port that answers with nothing in it, or with anything but this node's mark, is no vote.
  CHECK_FALSE(confirmsLoss("", "job", r, c, plan, ""));
  CHECK_FALSE(confirmsLoss(lossMarkValue("job", r, "b_100_0", plan, ""), "job", r, c, plan, ""));  // another node's
  CHECK_FALSE(confirmsLoss(lossMarkValue("other", r, c.id, plan, ""), "job", r, c, plan, ""));     // another run's
  // A stale mark: written for an older round (a node rejoining with an old round's view, or left by
  // an earlier failover), or naming another lost store host, does not count in this one.
  CHECK_FALSE(confirmsLoss(lossMarkValue("job", roundOf(3, 4), c.id, plan, ""), "job", r, c, plan, ""));
  FailoverPlan otherLoss = plan;
  otherLoss.lost = {"b_100_0"};
  CHECK_FALSE(confirmsLoss(lossMarkValue("job", r, c.id, otherLoss, ""), "job", r, c, plan, ""));
}

TEST_CASE("failover: with a job secret, only marks signed with its key count, and garbage is refused, never parsed loosely", "[rendezvous]") {
  const auto r = roundOf(3, 2);
  const auto plan = planFailover(r);
  const NodeSlot& c = r.nodes[2];
  const std::string key = deriveFailoverKey("0123456789abcdef-secret", "job");
  CHECK(key.size() == 32);
  CHECK(key != deriveFailoverKey("0123456789abcdef-secret", "job2"));  // per run id
  const std::string signedMark = lossMarkValue("job", r, c.id, plan, key);
  CHECK(confirmsLoss(signedMark, "job", r, c, plan, key));
  // An outsider who reaches the standby port but lacks the secret: unsigned, signed with another
  // key, or a signature copied from another round or node.
  CHECK_FALSE(confirmsLoss(lossMarkValue("job", r, c.id, plan, ""), "job", r, c, plan, key));
  CHECK_FALSE(confirmsLoss(lossMarkValue("job", r, c.id, plan, deriveFailoverKey("not-the-secret-at-all", "job")),
                           "job", r, c, plan, key));
  const std::string otherRound = lossMarkValue("job", roundOf(3, 1), c.id, plan, key);
  const std::string replayed = signedMark.substr(0, signedMark.rfind('\n') + 1) + otherRound.substr(otherRound.rfind('\n') + 1);
  CHECK_FALSE(confirmsLoss(replayed, "job", r, c, plan, key));
  // Garbage: truncated, extended, oversized, binary. None counts, none throws.
  CHECK_FALSE(confirmsLoss(signedMark.substr(0, signedMark.size() - 1), "job", r, c, plan, key));
  CHECK_FALSE(confirmsLoss(signedMark + "\n", "job", r, c, plan, key));
  CHECK_FALSE(confirmsLoss(signedMark + std::string(kMaxLossMarkSize, 'x'), "job", r, c, plan, key));
  CHECK_FALSE(confirmsLoss(std::string("\0\xff\n\n\n\n\n", 7), "job", r, c, plan, key));
  const std::string unsignedMark = lossMarkValue("job", r, c.id, plan, "");
  CHECK_FALSE(confirmsLoss(unsignedMark + "x", "job", r, c, plan, ""));
  CHECK_FALSE(confirmsLoss(unsignedMark.substr(0, unsignedMark.size() - 1) + std::string(64, 'z'), "job", r, c, plan, ""));
  // No lost store host in the plan: nothing can confirm it.
  CHECK_FALSE(confirmsLoss(unsignedMark, "job", r, c, FailoverPlan{}, ""));
}

TEST_CASE("failover: the successor waits for the others' marks a heartbeat expiry and 1 s, well within the others' wait for it", "[rendezvous]") {
  Settings s;
  s.keepAliveInterval = 1s;
  s.keepAliveMaxAttempt = 3;
  CHECK(lossMarkWait(s) == 4s);
  // A node noticing the loss a heartbeat expiry before the successor still finds the state there in time.
  CHECK(s.heartbeatExpiry() + lossMarkWait(s) < successorWait(s));
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

// Issue 58.12: the record the live store's node writes at the job's original endpoint.
TEST_CASE("failover: the moved-store record names the live store - only a well-formed one of this run, signed under a secret, is acted on", "[rendezvous]") {
  MovedRecord m;
  m.round = 4;
  m.node = "b_100_0";
  m.addr = "10.0.0.2";
  m.port = 4001;
  CHECK(movedKey("job") == "ctorchrun/failover/job/moved");
  CHECK(movedKey("job") != movedKey("job2"));
  const std::string key = deriveFailoverKey("0123456789abcdef-secret", "job");
  for (const std::string& k : {std::string(), key}) {
    const std::string v = movedValue("job", m, k);
    CHECK(v.size() <= kMaxMovedSize);
    auto back = parseMoved(v, "job", k);
    REQUIRE(back);
    CHECK(back->round == 4);
    CHECK(back->node == "b_100_0");
    CHECK(back->addr == "10.0.0.2");
    CHECK(back->port == 4001);
    CHECK_FALSE(parseMoved(v, "job2", k));  // another run's
  }
  // Under a secret: unsigned, signed with another key, or another record's signature.
  const std::string signedRecord = movedValue("job", m, key);
  CHECK_FALSE(parseMoved(movedValue("job", m, ""), "job", key));
  CHECK_FALSE(parseMoved(movedValue("job", m, deriveFailoverKey("not-the-secret-at-all", "job")), "job", key));
  MovedRecord elsewhere = m;
  elsewhere.addr = "10.6.6.6";
  const std::string other = movedValue("job", elsewhere, "");
  const std::string forged = other.substr(0, other.rfind('\n') + 1) + signedRecord.substr(signedRecord.rfind('\n') + 1);
  CHECK_FALSE(parseMoved(forged, "job", key));
  // Garbage: truncated, extended, oversized, binary, bad numbers, empty fields. None parses, none throws.
  CHECK_FALSE(parseMoved(signedRecord.substr(0, signedRecord.size() - 1), "job", key));
  CHECK_FALSE(parseMoved(signedRecord + "\n", "job", key));
  CHECK_FALSE(parseMoved(signedRecord + std::string(kMaxMovedSize, 'x'), "job", key));
  CHECK_FALSE(parseMoved(std::string("\0\xff\n\n\n\n\n", 7), "job", key));
  CHECK_FALSE(parseMoved("", "job", ""));
  for (const auto& [round, port] : std::vector<std::pair<std::string, std::string>>{
           {"-1", "4001"}, {"4", "0"}, {"4", "65536"}, {"4", " 4001"}, {"x", "4001"}, {"4", "99999999999999999999"},
           {"", "4001"}, {"4", ""}}) {
    const std::string v = "ctorchrun-moved-store 1\njob\n" + round + "\nb_100_0\n10.0.0.2\n" + port + "\n-";
    CHECK_FALSE(parseMoved(v, "job", ""));
  }
  CHECK(parseMoved("ctorchrun-moved-store 1\njob\n4\nb_100_0\n10.0.0.2\n4001\n-", "job", ""));
  CHECK_FALSE(parseMoved("ctorchrun-moved-store 1\njob\n4\n\n10.0.0.2\n4001\n-", "job", ""));
  CHECK_FALSE(parseMoved("ctorchrun-moved-store 2\njob\n4\nb_100_0\n10.0.0.2\n4001\n-", "job", ""));
}

TEST_CASE("failover: a node waits the stale-endpoint guard before its first round: longer than the beacon takes to write the record", "[rendezvous]") {
  Settings s;
  s.keepAliveInterval = 1s;
  CHECK(movedBeaconInterval(s) == 500ms);
  CHECK(staleEndpointGuard(s) == 2500ms);
  // The beacon: one interval until its next write, then a connect and a request of at most 1 s each.
  CHECK(staleEndpointGuard(s) >= movedBeaconInterval(s) + 2s);
  s.keepAliveInterval = 100ms;
  CHECK(movedBeaconInterval(s) == 100ms);
  s.keepAliveInterval = 10s;
  CHECK(movedBeaconInterval(s) == 1s);
}
