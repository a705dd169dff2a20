// In-place recovery's coordinator as pure decisions (launcher/control/coordinator.hpp): peers are
// numbers, time is a fake clock, and each test reads the messages it would send. What a stranger
// on the port could do is the session layer's business (control_plane_test.cpp); here the
// questions are what a registered, authenticated process can make the coordinator do, including a
// stale or confused one: a former process of a rank, a replayed request, an absurd generation.
#include "ctorch_catch.hpp"

#include "ctorch/control/coordinator.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

// Named, not anonymous: the launcher test sources are compiled in batches (unity build).
namespace coordinator_test {

namespace cc = ctorch::contract::control;
using ctorch::control::Coordinator;
using ctorch::control::Outgoing;
using ctorch::control::PeerId;
using cc::Message;
using cc::Type;
using namespace std::chrono_literals;
using Time = ctorch::control::Clock::time_point;

// Peer ids: agents are their node + 1; the first process of rank r is 100 + r, a replacement
// 200 + r, spares 300 and up. Incarnations: the first process of rank r is 0x1000 + r, a
// replacement 0x2000 + r.
constexpr PeerId agentPeer(int node) { return static_cast<PeerId>(node + 1); }
constexpr PeerId workerPeer(int rank) { return static_cast<PeerId>(100 + rank); }
constexpr PeerId replacementPeer(int rank) { return static_cast<PeerId>(200 + rank); }
constexpr std::uint64_t firstIncarnation(int rank) { return 0x1000u + static_cast<std::uint64_t>(rank); }
constexpr std::uint64_t replacementIncarnation(int rank) { return 0x2000u + static_cast<std::uint64_t>(rank); }

Message registerRank(int rank, std::uint64_t incarnation, bool replacement = false) {
  Message m = cc::message(Type::kRegister);
  m.rank = rank;
  m.incarnation = incarnation;
  m.value = replacement ? 1 : 0;
  return m;
}
Message reform(std::int64_t generation, bool holdsState) {
  Message m = cc::message(Type::kReform);
  m.generation = generation;
  m.value = holdsState ? 1 : 0;
  return m;
}
Message groupBuilt(std::int64_t generation) {
  Message m = cc::message(Type::kGroupBuilt);
  m.generation = generation;
  return m;
}
Message evictSilent(std::int64_t generation, std::chrono::milliseconds waited) {
  Message m = cc::message(Type::kEvictSilent);
  m.generation = generation;
  m.value = waited.count();
  return m;
}
Message declare(bool can, const std::string& why = "") {
  Message m = cc::message(Type::kDeclare);
  m.value = can ? 1 : 0;
  m.text = why;
  return m;
}
Message assignSpare(int rank, const std::string& spareId, std::uint64_t incarnation) {
  Message m = cc::message(Type::kAssignSpare);
  m.rank = rank;
  m.text = spareId;
  m.incarnation = incarnation;
  m.value = 0;   // local rank
  m.value2 = 1;  // replacement number
  return m;
}

// The messages of `out` to `peer` (of `type`, when given).
std::vector<Message> to(const std::vector<Outgoing>& out, PeerId peer) {
  std::vector<Message> r;
  for (const auto& o : out)
    if (o.peer == peer) r.push_back(o.message);
  return r;
}
std::vector<Outgoing> ofType(const std::vector<Outgoing>& out, Type type) {
  std::vector<Outgoing> r;
  for (const auto& o : out)
    if (o.message.type == type) r.push_back(o);
  return r;
}
std::set<PeerId> peersOf(const std::vector<Outgoing>& out) {
  std::set<PeerId> r;
  for (const auto& o : out) r.insert(o.peer);
  return r;
}
// `out` is exactly one message, of `type`, to `peer`; returns it.
Message only(const std::vector<Outgoing>& out, PeerId peer, Type type) {
  REQUIRE(out.size() == 1);
  CHECK(out[0].peer == peer);
  CHECK(static_cast<int>(out[0].message.type) == static_cast<int>(type));
  return out[0].message;
}
bool isRefusal(const std::vector<Outgoing>& out, PeerId peer) {
  return out.size() == 1 && out[0].peer == peer && out[0].message.type == Type::kRefused && out[0].close;
}
bool isHex(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A coordinator with a fake clock and the log it writes. Each call returns what that one event made
// it send.
struct Job {
  std::vector<std::string> log;
  Coordinator c{[this](const std::string& line) { log.push_back(line); }};
  Time now = Time{} + 1h;

  std::vector<Outgoing> hello(PeerId peer, const Message& m) {
    std::vector<Outgoing> out;
    c.hello(peer, m, now, out);
    return out;
  }
  std::vector<Outgoing> send(PeerId peer, const Message& m) {
    std::vector<Outgoing> out;
    c.message(peer, m, now, out);
    return out;
  }
  std::vector<Outgoing> close(PeerId peer) {
    std::vector<Outgoing> out;
    c.closed(peer, out);
    return out;
  }

  // Node `node`'s agent (ranks first .. first + count - 1 of `world`) connects.
  void agent(int node, int first, int count, int world) {
    only(hello(agentPeer(node), cc::agentHello(node, first, count, world)), agentPeer(node), Type::kWelcome);
  }
  // Rank `rank`'s process `incarnation` is registered by its agent and connects as `peer`.
  void process(int node, int rank, std::uint64_t incarnation, PeerId peer, bool replacement = false) {
    CHECK(send(agentPeer(node), registerRank(rank, incarnation, replacement)).empty());
    const Message w = only(hello(peer, cc::workerHello(rank, incarnation, 1000 + rank)), peer, Type::kWelcome);
    CHECK(w.generation == c.generation());
  }
  // Every rank waits in the re-form of the current generation, holding the training state.
  std::vector<Outgoing> allReform() {
    std::vector<Outgoing> last;
    for (int r = 0; r < c.worldSize(); ++r) last = send(workerPeer(r), reform(c.generation(), true));
    return last;
  }
};

// Four ranks on two nodes (node 0: ranks 0-1, node 1: ranks 2-3), each rank's first process
// registered and connected at `job.now`.
void twoNodes(Job& job) {
  job.agent(0, 0, 2, 4);
  job.agent(1, 2, 2, 4);
  for (int r = 0; r < 4; ++r) job.process(r / 2, r, firstIncarnation(r), workerPeer(r));
}

} // namespace coordinator_test

namespace coordinator_test {

TEST_CASE("coordinator: a worker is welcomed only once its agent registered its incarnation") {
  Job job;
  // Before any agent: the worker waits, nothing is said to it.
  CHECK(job.hello(workerPeer(1), cc::workerHello(1, firstIncarnation(1), 1001)).empty());
  job.agent(0, 0, 2, 2);  // the agent's own welcome only: the worker is not registered yet
  // Another process claiming the same rank, with an incarnation its agent never gives it.
  CHECK(job.hello(900, cc::workerHello(1, 0xbad, 666)).empty());

  const auto out = job.send(agentPeer(0), registerRank(1, firstIncarnation(1)));
  const Message w = only(out, workerPeer(1), Type::kWelcome);
  CHECK(w.generation == 0);
  // Registered again (its agent reconnected): nobody is welcomed twice.
  CHECK(job.send(agentPeer(0), registerRank(1, firstIncarnation(1))).empty());
  // The impostor is never welcomed, whatever else is registered.
  CHECK(job.send(agentPeer(0), registerRank(0, firstIncarnation(0))).empty());
  CHECK(isRefusal(job.send(900, reform(0, true)), 900));  // and what it says is refused

  // Hellos that cannot name a rank of this job are refused outright.
  CHECK(isRefusal(job.hello(901, cc::workerHello(2, 0x77, 1)), 901));   // rank 2 of a world of 2
  CHECK(isRefusal(job.hello(902, cc::workerHello(-1, 0x77, 1)), 902));
  CHECK(isRefusal(job.hello(903, cc::workerHello(0, 0, 1)), 903));      // incarnation 0
  CHECK(isRefusal(job.hello(904, cc::message(Type::kReform)), 904));    // not a hello
  Message role = cc::workerHello(0, 0x77, 1);
  role.value = 9;
  CHECK(isRefusal(job.hello(905, role), 905));
}

TEST_CASE("coordinator: the group re-forms at generation 1 once every rank's current process waits or joins") {
  Job job;
  twoNodes(job);
  // Rank 2's process died; its agent started a replacement, which connected.
  CHECK(job.close(workerPeer(2)).empty());
  job.now += 3s;
  job.process(1, 2, replacementIncarnation(2), replacementPeer(2), /*replacement=*/true);

  // Each one that waits is reported to its own agent, and nothing forms before the last.
  const Message s0 = only(job.send(workerPeer(0), reform(0, true)), agentPeer(0), Type::kRankState);
  CHECK(s0.rank == 0);
  CHECK(s0.incarnation == firstIncarnation(0));
  only(job.send(workerPeer(1), reform(0, true)), agentPeer(0), Type::kRankState);
  const Message s3 = only(job.send(workerPeer(3), reform(0, false)), agentPeer(1), Type::kRankState);
  CHECK(s3.rank == 3);
  CHECK(job.c.generation() == 0);

  const auto out = job.send(replacementPeer(2), cc::message(Type::kJoin));
  CHECK(job.c.generation() == 1);
  const auto formed = ofType(out, Type::kFormed);
  CHECK(peersOf(formed) == std::set<PeerId>{workerPeer(0), workerPeer(1), replacementPeer(2), workerPeer(3)});
  REQUIRE(formed.size() == 4);
  const std::string nonce = formed[0].message.text;
  CHECK(nonce.size() == 32);
  CHECK(isHex(nonce));
  for (const auto& f : formed) {
    CHECK(f.message.generation == 1);
    CHECK(f.message.value == 2);  // ranks 0 and 1 hold the state; rank 3 did not, the replacement cannot
    CHECK(f.message.text == nonce);
    CHECK_FALSE(f.close);
  }
  CHECK(ofType(out, Type::kRankState).size() == 1);  // the replacement's own, to its agent
  CHECK(out.size() == 5);
  // The agents hear that the group re-formed once every rank built it (issue 58.3): until then a
  // rank whose build fails fails inside the re-form. A build of another generation counts nothing.
  CHECK(ofType(out, Type::kReformed).empty());
  CHECK(job.send(workerPeer(0), groupBuilt(0)).empty());
  CHECK(job.send(workerPeer(0), groupBuilt(2)).empty());
  CHECK(job.send(workerPeer(0), groupBuilt(1)).empty());
  CHECK(job.send(workerPeer(1), groupBuilt(1)).empty());
  CHECK(job.send(replacementPeer(2), groupBuilt(1)).empty());
  const auto reformed = ofType(job.send(workerPeer(3), groupBuilt(1)), Type::kReformed);
  CHECK(peersOf(reformed) == std::set<PeerId>{agentPeer(0), agentPeer(1)});
  REQUIRE(reformed.size() == 2);
  for (const auto& r : reformed) CHECK(r.message.generation == 1);
  CHECK(job.send(workerPeer(3), groupBuilt(1)).empty());  // said again: said once

  // The next re-form needs everyone again, and gets a nonce of its own.
  CHECK(ofType(job.send(workerPeer(0), reform(1, true)), Type::kFormed).empty());
  CHECK(ofType(job.send(workerPeer(1), reform(1, true)), Type::kFormed).empty());
  CHECK(ofType(job.send(replacementPeer(2), reform(1, true)), Type::kFormed).empty());
  const auto again = ofType(job.send(workerPeer(3), reform(1, true)), Type::kFormed);
  REQUIRE(again.size() == 4);
  CHECK(again[0].message.generation == 2);
  CHECK(again[0].message.value == 4);
  CHECK(again[0].message.text.size() == 32);
  CHECK(again[0].message.text != nonce);
}

TEST_CASE("coordinator: a re-form naming another generation changes nothing") {
  Job job;
  twoNodes(job);
  for (int r = 0; r < 3; ++r) job.send(workerPeer(r), reform(0, true));
  for (std::int64_t g : {std::int64_t{1}, std::int64_t{-1}, std::int64_t{7}}) {
    CHECK(job.send(workerPeer(3), reform(g, true)).empty());
    CHECK(job.c.generation() == 0);
  }
  // Nor does a join from a process that is no replacement.
  CHECK(job.send(workerPeer(3), cc::message(Type::kJoin)).empty());
  CHECK(job.c.generation() == 0);
  // Rank 3 was never counted as waiting: its real re-form is what completes the group.
  CHECK(ofType(job.send(workerPeer(3), reform(0, true)), Type::kFormed).size() == 4);
  CHECK(job.c.generation() == 1);
  // After it, a re-form of the generation just left is stale too.
  for (int r = 0; r < 4; ++r) CHECK(job.send(workerPeer(r), reform(0, true)).empty());
  CHECK(job.c.generation() == 1);
}

TEST_CASE("coordinator: a rank's former process changes nothing once another process is registered for it") {
  Job job;
  twoNodes(job);
  // Rank 1's process hangs (still connected); its agent registers a replacement.
  job.now += 1s;
  CHECK(job.send(agentPeer(0), registerRank(1, replacementIncarnation(1), true)).empty());
  for (const Message& m : {reform(0, true), cc::message(Type::kJoin), evictSilent(0, 0ms), declare(false, "stale")})
    CHECK(job.send(workerPeer(1), m).empty());
  CHECK(job.c.capability() == -1);
  CHECK(job.c.killsOrdered() == 0);

  for (int r : {0, 2, 3}) CHECK(ofType(job.send(workerPeer(r), reform(0, true)), Type::kFormed).empty());
  CHECK(job.send(workerPeer(1), reform(0, true)).empty());  // the former process cannot complete it
  CHECK(job.c.generation() == 0);
  // Its connection closing does not make the rank gone: the replacement holds it.
  CHECK(job.close(workerPeer(1)).empty());

  only(job.hello(replacementPeer(1), cc::workerHello(1, replacementIncarnation(1), 2001)), replacementPeer(1), Type::kWelcome);
  const auto formed = ofType(job.send(replacementPeer(1), cc::message(Type::kJoin)), Type::kFormed);
  CHECK(peersOf(formed) == std::set<PeerId>{workerPeer(0), replacementPeer(1), workerPeer(2), workerPeer(3)});
  CHECK(job.c.generation() == 1);
}

TEST_CASE("coordinator: EvictSilent kills only silent processes, each once, through the agent that owns the rank") {
  Job job;
  twoNodes(job);
  job.now += 10s;
  job.send(workerPeer(0), reform(0, true));
  job.send(workerPeer(3), reform(0, true));
  CHECK(job.close(workerPeer(1)).empty());  // rank 1 died: gone, its agent replaces it; no kill
  // Rank 2 is silent (alive, neither waiting nor joining).

  // Only a process waiting in the re-form of this generation may ask.
  CHECK(job.send(workerPeer(2), evictSilent(0, 5s)).empty());
  CHECK(job.send(workerPeer(0), evictSilent(1, 5s)).empty());
  CHECK(job.c.killsOrdered() == 0);

  auto out = job.send(workerPeer(0), evictSilent(0, 5s));
  const auto kills = ofType(out, Type::kKill);
  REQUIRE(kills.size() == 1);
  CHECK(kills[0].peer == agentPeer(1));  // rank 2 is node 1's
  CHECK(kills[0].message.rank == 2);
  CHECK(kills[0].message.incarnation == firstIncarnation(2));
  const auto answer = to(out, workerPeer(0));
  REQUIRE(answer.size() == 1);
  CHECK(answer[0].type == Type::kEvicting);
  CHECK(answer[0].value == 1);   // rank 2 killed now
  CHECK(answer[0].value2 == 2);  // rank 2's and rank 1's replacements are on their way
  CHECK(answer[0].text == "waiting for rank(s) 1, 2");
  CHECK(to(out, agentPeer(0)).empty());
  CHECK(out.size() == 2);
  CHECK(job.c.killsOrdered() == 1);

  // Asked again (by another waiting rank, much later): the same process is not killed twice.
  job.now += 1h;
  out = job.send(workerPeer(3), evictSilent(0, 5s));
  CHECK(ofType(out, Type::kKill).empty());
  const Message again = only(out, workerPeer(3), Type::kEvicting);
  CHECK(again.value == 0);
  CHECK(again.value2 == 2);
  CHECK(job.c.killsOrdered() == 1);
}

TEST_CASE("coordinator: EvictSilent spares processes registered less than the grace ago") {
  Job job;
  twoNodes(job);
  job.send(workerPeer(0), reform(0, true));
  job.now += 4999ms;
  Message m = only(job.send(workerPeer(0), evictSilent(0, 5s)), workerPeer(0), Type::kEvicting);
  CHECK(m.value == 0);
  CHECK(m.value2 == 0);
  CHECK(m.text == "waiting for rank(s) 1, 2, 3");
  job.now += 1ms;
  const auto out = job.send(workerPeer(0), evictSilent(0, 5s));
  CHECK(ofType(out, Type::kKill).size() == 3);
  CHECK(to(out, workerPeer(0)).at(0).value == 3);
  CHECK(job.c.killsOrdered() == 3);
}

TEST_CASE("coordinator: a replacement that has not joined is killed only after the long grace") {
  Job job;
  twoNodes(job);
  for (int r : {0, 1, 3}) job.send(workerPeer(r), reform(0, true));
  // Rank 2 died; its replacement is registered (it never says hello: it hangs while starting).
  job.close(workerPeer(2));
  const Time registered = job.now + 1h;
  job.now = registered;
  job.send(agentPeer(1), registerRank(2, replacementIncarnation(2), true));

  // grace 1 s: a replacement gets max(4 x 1 s, 20 s).
  job.now = registered + 19999ms;
  Message m = only(job.send(workerPeer(0), evictSilent(0, 1s)), workerPeer(0), Type::kEvicting);
  CHECK(m.value == 0);
  CHECK(m.value2 == 1);  // under way
  job.now = registered + 20s;
  auto out = job.send(workerPeer(0), evictSilent(0, 1s));
  const auto kill = ofType(out, Type::kKill);
  REQUIRE(kill.size() == 1);
  CHECK(kill[0].peer == agentPeer(1));
  CHECK(kill[0].message.incarnation == replacementIncarnation(2));

  // grace 10 s: 4 x 10 s = 40 s for the next replacement.
  const Time next = job.now;
  job.send(agentPeer(1), registerRank(2, replacementIncarnation(2) + 1, true));
  job.now = next + 39s;
  CHECK(ofType(job.send(workerPeer(1), evictSilent(0, 10s)), Type::kKill).empty());
  job.now = next + 40s;
  CHECK(ofType(job.send(workerPeer(1), evictSilent(0, 10s)), Type::kKill).size() == 1);
  CHECK(job.c.killsOrdered() == 2);
}

TEST_CASE("coordinator: a closed connection marks its rank gone: no kill for it, the group waits for a replacement") {
  Job job;
  twoNodes(job);
  for (int r : {0, 1, 2}) job.send(workerPeer(r), reform(0, true));
  CHECK(job.close(workerPeer(3)).empty());
  job.now += 1h;
  const Message m = only(job.send(workerPeer(0), evictSilent(0, 1s)), workerPeer(0), Type::kEvicting);
  CHECK(m.value == 0);
  CHECK(m.value2 == 1);
  CHECK(m.text == "waiting for rank(s) 3");
  CHECK(job.c.generation() == 0);
  job.process(1, 3, replacementIncarnation(3), replacementPeer(3), true);
  CHECK(ofType(job.send(replacementPeer(3), cc::message(Type::kJoin)), Type::kFormed).size() == 4);
  CHECK(job.c.generation() == 1);
}

TEST_CASE("coordinator: a silent rank whose agent is not connected is killed at the first request after it reconnects") {
  Job job;
  twoNodes(job);
  for (int r : {0, 1, 2}) job.send(workerPeer(r), reform(0, true));
  CHECK(job.close(agentPeer(1)).empty());
  job.now += 1h;
  Message m = only(job.send(workerPeer(0), evictSilent(0, 1s)), workerPeer(0), Type::kEvicting);
  CHECK(m.value == 0);  // nobody to order it to: not counted as done
  CHECK(m.value2 == 0);
  CHECK(job.c.killsOrdered() == 0);
  job.hello(50, cc::agentHello(1, 2, 2, 4));
  const auto kill = ofType(job.send(workerPeer(0), evictSilent(0, 1s)), Type::kKill);
  REQUIRE(kill.size() == 1);
  CHECK(kill[0].peer == 50);
  CHECK(kill[0].message.rank == 3);
}

TEST_CASE("coordinator: every rank that can recover in place is told to agents once, also to one that connects later") {
  Job job;
  twoNodes(job);
  for (int r = 0; r < 3; ++r) CHECK(job.send(workerPeer(r), declare(true)).empty());
  CHECK(job.c.capability() == -1);
  const auto out = job.send(workerPeer(3), declare(true));
  CHECK(peersOf(out) == std::set<PeerId>{agentPeer(0), agentPeer(1)});
  REQUIRE(out.size() == 2);
  for (const auto& o : out) {
    CHECK(o.message.type == Type::kCapability);
    CHECK(o.message.value == 1);
  }
  CHECK(job.c.capability() == 1);
  CHECK(job.send(workerPeer(1), declare(true)).empty());  // said again: not broadcast again

  // Node 1's agent reconnects: it learns the answer with its welcome.
  job.close(agentPeer(1));
  const auto late = job.hello(50, cc::agentHello(1, 2, 2, 4));
  REQUIRE(late.size() == 2);
  CHECK(late[0].message.type == Type::kWelcome);
  CHECK(late[1].message.type == Type::kCapability);
  CHECK(late[1].message.value == 1);
}

TEST_CASE("coordinator: one rank that cannot recover in place is told to agents once, with its rank and reason") {
  Job job;
  twoNodes(job);
  CHECK(job.send(workerPeer(0), declare(true)).empty());
  const auto out = job.send(workerPeer(2), declare(false, "its optimizer cannot be rebuilt"));
  CHECK(peersOf(out) == std::set<PeerId>{agentPeer(0), agentPeer(1)});
  REQUIRE(out.size() == 2);
  for (const auto& o : out) {
    CHECK(o.message.type == Type::kCapability);
    CHECK(o.message.value == 0);
    CHECK(o.message.rank == 2);
    CHECK(o.message.text == "its optimizer cannot be rebuilt");
  }
  CHECK(job.c.capability() == 0);
  CHECK(job.send(workerPeer(3), declare(false, "another reason")).empty());
  CHECK(job.send(workerPeer(1), declare(true)).empty());
  CHECK(job.c.capability() == 0);
  const auto late = job.hello(50, cc::agentHello(1, 2, 2, 4));  // node 1's agent again
  REQUIRE(late.size() == 3);  // the old connection is told to go, the new one is welcomed and told
  const auto cap = to(late, 50).back();
  CHECK(cap.type == Type::kCapability);
  CHECK(cap.rank == 2);
  CHECK(cap.text == "its optimizer cannot be rebuilt");
}

TEST_CASE("coordinator: an agent hello naming another world size, or ranks outside it, is refused") {
  Job job;
  job.agent(0, 0, 2, 4);
  const auto out = job.hello(agentPeer(1), cc::agentHello(1, 2, 2, 8));
  REQUIRE(isRefusal(out, agentPeer(1)));
  CHECK_THAT(out[0].message.text, Catch::Contains("8") && Catch::Contains("4"));
  CHECK(job.c.worldSize() == 4);
  // Refused means not an agent: what it says next is refused, and registers nothing.
  CHECK(job.hello(workerPeer(2), cc::workerHello(2, firstIncarnation(2), 1)).empty());
  CHECK(isRefusal(job.send(agentPeer(1), registerRank(2, firstIncarnation(2))), agentPeer(1)));

  CHECK(isRefusal(job.hello(10, cc::agentHello(1, 3, 2, 4)), 10));  // ranks 3 and 4 of 4
  CHECK(isRefusal(job.hello(11, cc::agentHello(1, 2, 0, 4)), 11));  // no ranks
  Message node = cc::agentHello(1, 2, 2, 4);
  node.text = "one";
  CHECK(isRefusal(job.hello(12, node), 12));
  // A well-formed agent of node 1 still gets in, and registers its rank.
  job.agent(1, 2, 2, 4);
  only(job.send(agentPeer(1), registerRank(2, firstIncarnation(2))), workerPeer(2), Type::kWelcome);
  // An agent cannot register a rank of another node.
  CHECK(job.hello(workerPeer(0), cc::workerHello(0, firstIncarnation(0), 1)).empty());
  CHECK(job.send(agentPeer(1), registerRank(0, firstIncarnation(0))).empty());
}

TEST_CASE("coordinator: a second connection of the same node's agent replaces the first") {
  Job job;
  twoNodes(job);
  const PeerId newer = 50;
  const auto out = job.hello(newer, cc::agentHello(0, 0, 2, 4));
  REQUIRE(out.size() == 2);
  CHECK(out[0].peer == agentPeer(0));
  CHECK(out[0].message.type == Type::kRefused);
  CHECK(out[0].close);
  CHECK(out[1].peer == newer);
  CHECK(out[1].message.type == Type::kWelcome);
  // The older connection is no agent any more; its close changes nothing.
  CHECK(isRefusal(job.send(agentPeer(0), registerRank(0, 0x999)), agentPeer(0)));
  CHECK(job.close(agentPeer(0)).empty());

  // Rank 0 goes silent: its kill goes to the newer connection.
  for (int r : {1, 2, 3}) job.send(workerPeer(r), reform(0, true));
  job.now += 1h;
  const auto kill = ofType(job.send(workerPeer(1), evictSilent(0, 1s)), Type::kKill);
  REQUIRE(kill.size() == 1);
  CHECK(kill[0].peer == newer);
  CHECK(kill[0].message.rank == 0);
}

TEST_CASE("coordinator: a spare is announced to its node's agent and given a rank only by id and incarnation") {
  Job job;
  // A spare that connects before its agent is announced with the agent's welcome.
  only(job.hello(300, cc::spareHello(0, "early", 0x3000, 3000)), 300, Type::kWelcome);
  const auto agentOut = job.hello(agentPeer(0), cc::agentHello(0, 0, 2, 2));
  REQUIRE(agentOut.size() == 2);
  CHECK(agentOut[1].message.type == Type::kSpareReady);
  CHECK(agentOut[1].message.text == "early");
  CHECK(agentOut[1].message.incarnation == 0x3000u);
  for (int r = 0; r < 2; ++r) job.process(0, r, firstIncarnation(r), workerPeer(r));

  auto out = job.hello(301, cc::spareHello(0, "s1", 0x3001, 3001));
  REQUIRE(out.size() == 2);
  CHECK(out[0].peer == 301);
  CHECK(out[0].message.type == Type::kWelcome);
  CHECK(out[1].peer == agentPeer(0));
  CHECK(out[1].message.type == Type::kSpareReady);
  CHECK(out[1].message.text == "s1");
  CHECK(out[1].message.incarnation == 0x3001u);
  // A spare of a node whose agent is not connected: welcomed, announced to nobody.
  only(job.hello(302, cc::spareHello(5, "far", 0x3002, 3002)), 302, Type::kWelcome);
  // What a spare says before it holds a rank is ignored.
  CHECK(job.send(301, cc::message(Type::kJoin)).empty());
  CHECK(isRefusal(job.hello(303, cc::spareHello(0, "", 0x3003, 1)), 303));  // no id

  // Rank 1 died; its agent gives it to spare s1. The id and the incarnation must both match.
  job.close(workerPeer(1));
  CHECK(job.send(agentPeer(0), assignSpare(1, "s1", 0x3000)).empty());
  CHECK(job.send(agentPeer(0), assignSpare(1, "early", 0x3001)).empty());
  out = job.send(agentPeer(0), assignSpare(1, "s1", 0x3001));
  const Message a = only(out, 301, Type::kAssign);
  CHECK(a.rank == 1);
  CHECK(a.value == 0);
  CHECK(a.value2 == 1);
  // It is rank 1's process now: its join completes the re-form.
  CHECK(ofType(job.send(workerPeer(0), reform(0, true)), Type::kFormed).empty());
  const auto formed = ofType(job.send(301, cc::message(Type::kJoin)), Type::kFormed);
  CHECK(peersOf(formed) == std::set<PeerId>{workerPeer(0), 301});
  // Assigned once: the same spare cannot be given another rank.
  job.close(workerPeer(0));
  CHECK(job.send(agentPeer(0), assignSpare(0, "s1", 0x3001)).empty());
}

TEST_CASE("coordinator: messages from peers that were never welcomed are refused and forgotten") {
  Job job;
  job.agent(0, 0, 1, 1);
  CHECK(isRefusal(job.send(999, declare(true)), 999));  // never said hello
  // A pending worker that speaks before its registration is dropped: registering its process
  // later welcomes nobody.
  CHECK(job.hello(100, cc::workerHello(0, firstIncarnation(0), 1)).empty());
  CHECK(isRefusal(job.send(100, reform(0, true)), 100));
  CHECK(job.send(agentPeer(0), registerRank(0, firstIncarnation(0))).empty());
  CHECK(job.c.generation() == 0);
}

TEST_CASE("coordinator: workers waiting to be registered are bounded by maxPending") {
  Job job;
  job.agent(0, 0, 2, 2);
  const std::size_t cap = job.c.maxPending();
  CHECK(cap == 4 * 2 + 64);
  for (std::size_t i = 0; i < cap; ++i)
    REQUIRE(job.hello(1000 + i, cc::workerHello(0, 0x5000 + i, 1)).empty());
  CHECK(isRefusal(job.hello(1000 + cap, cc::workerHello(0, 0x9999, 1)), 1000 + cap));
  // One of them registered (welcomed) makes room for one more.
  only(job.send(agentPeer(0), registerRank(0, 0x5000)), 1000, Type::kWelcome);
  CHECK(job.hello(5000, cc::workerHello(1, 0x7000, 1)).empty());
  CHECK(isRefusal(job.hello(5001, cc::workerHello(1, 0x7001, 1)), 5001));
  // A refusal is logged once, not once per refused process.
  CHECK(std::count_if(job.log.begin(), job.log.end(), [](const std::string& l) {
          return l.find("too many processes") != std::string::npos;
        }) == 1);
}

// ---- What a stale or confused process of the job could try ---------------------------------------
TEST_CASE("coordinator: an EvictSilent replayed from a previous generation kills nobody") {
  Job job;
  twoNodes(job);
  job.allReform();
  REQUIRE(job.c.generation() == 1);
  job.now += 1h;  // everyone is long past any grace
  // Rank 0 waits in generation 1's re-form, the others compute: an old request comes again.
  job.send(workerPeer(0), reform(1, true));
  CHECK(job.send(workerPeer(0), evictSilent(0, 0ms)).empty());
  CHECK(job.send(workerPeer(0), evictSilent(-1, 0ms)).empty());
  // From a process that is not waiting, even this generation's asks for nothing.
  CHECK(job.send(workerPeer(1), evictSilent(1, 0ms)).empty());
  CHECK(job.c.killsOrdered() == 0);
  // The genuine request of this generation is what would kill.
  CHECK(ofType(job.send(workerPeer(0), evictSilent(1, 0ms)), Type::kKill).size() == 3);
}

TEST_CASE("coordinator: a re-form naming generation 2^63-1 forms nothing and costs nothing") {
  constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
  Job job;
  twoNodes(job);
  for (int r = 0; r < 3; ++r) job.send(workerPeer(r), reform(0, true));
  job.now += 1h;
  // No walk over generations (one to 2^63-1 would never end: CTest's timeout fails the test): a
  // thousand of them return and say nothing.
  for (int i = 0; i < 1000; ++i) {
    REQUIRE(job.send(workerPeer(3), reform(kMax, true)).empty());
    REQUIRE(job.send(workerPeer(0), evictSilent(kMax, 0ms)).empty());
  }
  CHECK(job.c.generation() == 0);
  CHECK(job.c.killsOrdered() == 0);
  CHECK(job.send(workerPeer(3), reform(std::numeric_limits<std::int64_t>::min(), true)).empty());
  // Logged once, not a thousand times.
  CHECK(std::count_if(job.log.begin(), job.log.end(), [](const std::string& l) {
          return l.find("re-form of generation") != std::string::npos;
        }) == 1);
  // The group goes on to generation 1, not past it.
  CHECK(ofType(job.send(workerPeer(3), reform(0, true)), Type::kFormed).size() == 4);
  CHECK(job.c.generation() == 1);
}


TEST_CASE("coordinator: a rank given to a spare that has not connected yet is handed over at its hello") {
  Job job;
  job.agent(0, 0, 2, 2);
  for (int r = 0; r < 2; ++r) job.process(0, r, firstIncarnation(r), workerPeer(r));
  job.close(workerPeer(1));
  // The agent's only spare is still starting: the assignment waits for it, nothing is sent now.
  CHECK(job.send(agentPeer(0), assignSpare(1, "late", 0x3100)).empty());
  // Another spare of the node, or the same id with another incarnation, does not get it.
  const auto other = job.hello(310, cc::spareHello(0, "late", 0x3101, 3101));
  REQUIRE(to(other, 310).size() == 1);
  CHECK(to(other, 310)[0].type == Type::kWelcome);
  CHECK(ofType(other, Type::kAssign).empty());
  CHECK(to(job.send(310, cc::message(Type::kJoin)), 310).empty());
  // The spare it was meant for: welcomed, then its assignment at once; it is rank 1's process now.
  auto out = job.hello(311, cc::spareHello(0, "late", 0x3100, 3100));
  REQUIRE(out.size() == 2);
  CHECK(out[0].message.type == Type::kWelcome);
  const Message a = out[1].message;
  CHECK(out[1].peer == 311);
  CHECK(a.type == Type::kAssign);
  CHECK(a.rank == 1);
  CHECK(ofType(job.send(workerPeer(0), reform(0, true)), Type::kFormed).empty());
  CHECK(peersOf(ofType(job.send(311, cc::message(Type::kJoin)), Type::kFormed)) == std::set<PeerId>{workerPeer(0), 311});
}

} // namespace coordinator_test
