// ctorchrun across nodes, end to end: two and three real ctorchrun agents with fake_worker (and
// Python gloo workers), on loopback and on separate network-namespace hosts (scripts/lab). Every
// scenario runs in both topologies where it makes sense: static and c10d rendezvous,
// heterogeneous nproc, one endpoint shared by two jobs, a late joiner, a killed node, a cut-off
// (netns) or paused (loopback) node, fewer than MIN nodes, a worker failure restarting every
// node. Short heartbeats and timeouts come from --rdzv-conf; every wait is bounded, and nothing is
// asserted of how long anything took: what happened shows in the order of the agents' lines.
// On loopback the rendezvous store is the test's own (bound to port 0) unless the scenario is about
// an agent serving it; then that agent gets a fixed port, drawn again if the port was taken.
#include "ctorch_catch.hpp"

#include "lab.hpp"
#include "launcher_test_util.hpp"

#include <csignal>
#include <functional>
#include <memory>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

using namespace ctorch;
using namespace ctorch::launcher_test;
using namespace std::chrono_literals;

namespace {

// Heartbeat every 0.5 s, dead after 1.5 s; a short last call; bounded waits everywhere.
const std::string kConf = "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=0.5,close_timeout=3";
// Bounds against a hang only.
constexpr auto kAgentTimeout = 120s;
constexpr auto kWaitBound = 60s;

// "[n2:default3]:ENV RANK=3" (or "[default3]:...") -> global rank -> {KEY: VALUE}; later lines of
// the same rank (a later round) overwrite earlier ones.
std::map<int, std::map<std::string, std::string>> envOf(const std::string& output) {
  std::map<int, std::map<std::string, std::string>> out;
  static const std::regex line(R"(^\[(?:[^\]:]*:)?default(\d+)\]:ENV ([A-Z_]+)=(.*)$)");
  std::istringstream in(output);
  std::string l;
  std::smatch m;
  while (std::getline(in, l))
    if (std::regex_match(l, m, line)) out[std::stoi(m[1])][m[2]] = m[3];
  return out;
}

std::size_t countOf(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (auto p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// Who serves the c10d rendezvous store on loopback: the test itself (the agents are all clients),
// or host 1's agent (the scenario is about that agent: its loss, its view of the others).
enum class RdzvStore { kTest, kHost1 };

// Where the agents run: all on this machine (loopback), or one per network-namespace host.
class Topology {
 public:
  virtual ~Topology() = default;
  virtual std::string name() const = 0;
  // The c10d endpoint, and flags that make host 1's agent the store host (or nobody's).
  virtual std::string endpoint() const = 0;
  virtual std::string confFor(int host) const = 0;
  // Address of host `host` as the others see it (MASTER_ADDR when it is node rank 0).
  virtual std::string addr(int host) const = 0;
  // Static rendezvous: node 0 (host 1) address and port.
  virtual std::string masterAddr() const = 0;
  virtual int masterPort() const = 0;
  virtual test::SpawnOptions spawn(int host, const std::vector<std::string>& args) const = 0;
  // Starts host 1's c10d agent, the first of a scenario. Where it serves the rendezvous store on a
  // fixed port (loopback, RdzvStore::kHost1) `args` are made once the port is drawn, and made
  // again with a fresh one while the agent says the port was taken; it returns once the agent
  // serves the store.
  virtual std::unique_ptr<test::Process> startHost1(const std::function<std::vector<std::string>()>& args) {
    return std::make_unique<test::Process>(spawn(1, args()));
  }
  // Runs one agent per host to the end (args(host), host 1 first; c10d or static), again with a
  // fresh port on loopback while host 1 says its port was taken. Results in host order.
  virtual std::vector<test::ProcessResult> runAll(int hosts,
                                                  const std::function<std::vector<std::string>(int host)>& args) {
    std::vector<std::unique_ptr<test::Process>> agents;
    for (int host = 1; host <= hosts; ++host) agents.push_back(std::make_unique<test::Process>(spawn(host, args(host))));
    std::vector<test::ProcessResult> out;
    for (auto& a : agents) out.push_back(a->wait());
    return out;
  }
  // A crashed machine: every process of the node dies at once.
  virtual void kill(int host, test::Process& agent) = 0;
  // The node stops answering without closing anything (netns: link down; loopback: SIGSTOP).
  virtual void silence(int host, test::Process& agent) = 0;
  virtual void unsilence(int host, test::Process& agent) = 0;
  virtual bool isLab() const = 0;
};

class Loopback final : public Topology {
 public:
  explicit Loopback(RdzvStore store) : storeAt_(store) {
    if (store == RdzvStore::kTest) store_ = std::make_unique<test::HostedStore>(test::HostedStore::rendezvous());
  }
  std::string name() const override { return "loopback"; }
  std::string endpoint() const override {
    return "127.0.0.1:" + std::to_string(store_ ? store_->port() : port_);
  }
  // On one machine every agent matches the endpoint: name the host explicitly (or none).
  std::string confFor(int host) const override {
    return kConf + (storeAt_ == RdzvStore::kHost1 && host == 1 ? ",is_host=true" : ",is_host=false");
  }
  std::string addr(int) const override { return "127.0.0.1"; }
  std::string masterAddr() const override { return "127.0.0.1"; }
  int masterPort() const override { return port_; }
  test::SpawnOptions spawn(int, const std::vector<std::string>& args) const override {
    return ctorchrunSpawn(args, {}, kAgentTimeout);
  }
  std::unique_ptr<test::Process> startHost1(const std::function<std::vector<std::string>()>& args) override {
    if (storeAt_ == RdzvStore::kTest) return Topology::startHost1(args);
    std::unique_ptr<test::Process> agent;
    test::withFreshPort([&](int port) {
      port_ = port;
      agent = std::make_unique<test::Process>(spawn(1, args()));
      eventually(
          [&] {
            return !agent->running() ||
                   agent->outputSoFar().find("hosting the rendezvous store on port") != std::string::npos;
          },
          kWaitBound);
      return !agent->running() && test::portTaken(agent->outputSoFar());
    });
    return agent;
  }
  std::vector<test::ProcessResult> runAll(int hosts,
                                          const std::function<std::vector<std::string>(int host)>& args) override {
    if (storeAt_ == RdzvStore::kTest) return Topology::runAll(hosts, args);
    return test::withFreshPort([&](int port) {
      port_ = port;
      std::vector<std::unique_ptr<test::Process>> agents;
      for (int host = 1; host <= hosts; ++host)
        agents.push_back(std::make_unique<test::Process>(spawn(host, args(host))));
      std::vector<test::ProcessResult> out{agents[0]->wait()};
      // Host 1 could not serve the port: the others may be talking to whoever has it.
      if (test::portTaken(out[0]))
        for (auto& a : agents) a->signalGroup(SIGKILL);
      for (std::size_t i = 1; i < agents.size(); ++i) out.push_back(agents[i]->wait());
      return out;
    });
  }
  void kill(int, test::Process& agent) override { agent.signalGroup(SIGKILL); }
  void silence(int, test::Process& agent) override { agent.signalGroup(SIGSTOP); }
  void unsilence(int, test::Process& agent) override { agent.signalGroup(SIGCONT); }
  bool isLab() const override { return false; }

 private:
  RdzvStore storeAt_;
  std::unique_ptr<test::HostedStore> store_;  // RdzvStore::kTest
  int port_ = 0;  // host 1's fixed port (c10d endpoint or static --master-port), when it serves one
};

class NetnsHosts final : public Topology {
 public:
  explicit NetnsHosts(int hosts) : lab_(hosts) {}
  std::string name() const override { return "netns"; }
  // The endpoint names host 1 by its lab host name: its agent finds that it is the host.
  std::string endpoint() const override { return "n1:29400"; }
  std::string confFor(int) const override { return kConf; }
  std::string addr(int host) const override { return lab_.addr(host); }
  std::string masterAddr() const override { return lab_.addr(1); }
  int masterPort() const override { return 29500; }
  test::SpawnOptions spawn(int host, const std::vector<std::string>& args) const override {
    return lab_.spawnIn(host, ctorchrunSpawn(args, {}, kAgentTimeout));
  }
  void kill(int host, test::Process&) override { lab_.killHost(host); }
  void silence(int host, test::Process&) override { lab_.cut(host); }
  void unsilence(int host, test::Process&) override { lab_.restore(host); }
  bool isLab() const override { return true; }
  // Only hosts a and b stop reaching each other (loopback has no such cut: one address for all).
  void cutBetween(int a, int b) { lab_.cutBetween(a, b); }

 private:
  test::lab::NetnsLab lab_;
};

// ctorchrun args for a c10d agent on `host`.
std::vector<std::string> c10d(const Topology& t, int host, const std::string& nnodes, int nproc,
                              const std::vector<std::string>& extra, const std::vector<std::string>& worker,
                              const std::string& id = "job", const std::string& joinTimeout = "20") {
  std::vector<std::string> a = {"--log-level", "info", "--nnodes", nnodes, "--nproc-per-node", std::to_string(nproc),
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", t.endpoint(), "--rdzv-id", id,
                                "--rdzv-conf", t.confFor(host) + ",join_timeout=" + joinTimeout,
                                "--shutdown-timeout", "3"};
  a.insert(a.end(), extra.begin(), extra.end());
  a.push_back(fakeWorkerBin());
  a.insert(a.end(), worker.begin(), worker.end());
  return a;
}

bool waitFor(test::Process& p, const std::string& text, std::chrono::milliseconds deadline = kWaitBound, int count = 1) {
  return eventually([&] { return countOf(p.outputSoFar(), text) >= static_cast<std::size_t>(count); }, deadline);
}

} // namespace

// One scenario, two test cases: agents on loopback (the rendezvous store served by STORE), and
// agents on HOSTS network-namespace hosts (skipped with the reason where this machine cannot make
// namespaces; there host 1's agent serves the store, on a port of its own host).
#define MULTINODE_SCENARIO(NAME, TITLE, HOSTS, STORE)            \
  static void NAME(Topology& t);                                 \
  TEST_CASE(TITLE " (loopback)", "[multinode]") {                \
    Loopback t(STORE);                                           \
    NAME(t);                                                     \
  }                                                              \
  TEST_CASE(TITLE " (netns)", "[multinode][netns]") {            \
    CTORCH_REQUIRE_NETNS();                                      \
    NetnsHosts t(HOSTS);                                         \
    NAME(t);                                                     \
  }                                                              \
  static void NAME(Topology& t)

// ---- c10d: forming a group ------------------------------------------------------------------------

MULTINODE_SCENARIO(threeAgentsHeterogeneous, "multinode c10d: three agents with different nproc get predictable node ranks and prefix-sum global ranks", 3, RdzvStore::kTest) {
  // Host 2 asks for node rank 0, host 1 for 2; host 3 takes the lowest free rank (1).
  test::Process a1(t.spawn(1, c10d(t, 1, "3", 1, {"--node-rank", "2"}, {"env"})));
  test::Process a2(t.spawn(2, c10d(t, 2, "3", 2, {"--node-rank", "0"}, {"env"})));
  test::Process a3(t.spawn(3, c10d(t, 3, "3", 1, {}, {"env"})));
  auto r1 = a1.wait(), r2 = a2.wait(), r3 = a3.wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << r3.output);
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  REQUIRE(r3.ok());
  auto e1 = envOf(r1.output), e2 = envOf(r2.output), e3 = envOf(r3.output);
  REQUIRE(e2.size() == 2);
  REQUIRE(e3.size() == 1);
  REQUIRE(e1.size() == 1);
  CHECK(e2.count(0));
  CHECK(e2.count(1));
  CHECK(e3.count(2));
  CHECK(e1.count(3));
  CHECK(e2[0]["GROUP_RANK"] == "0");
  CHECK(e3[2]["GROUP_RANK"] == "1");
  CHECK(e1[3]["GROUP_RANK"] == "2");
  CHECK(e2[1]["LOCAL_RANK"] == "1");
  CHECK(e2[1]["LOCAL_WORLD_SIZE"] == "2");
  CHECK(e1[3]["LOCAL_WORLD_SIZE"] == "1");
  std::set<std::string> ports;
  for (auto* e : {&e1, &e2, &e3})
    for (auto& [rank, vars] : *e) {
      CHECK(vars["WORLD_SIZE"] == "4");
      CHECK(vars["GROUP_WORLD_SIZE"] == "3");
      CHECK(vars["TORCHELASTIC_RUN_ID"] == "job");
      CHECK(vars["TORCHELASTIC_RESTART_COUNT"] == "0");
      CHECK(vars["TORCHELASTIC_USE_AGENT_STORE"] == "True");
      // The workers' store is node rank 0's (host 2's), the same for every worker.
      CHECK(vars["MASTER_ADDR"] == t.addr(2));
      ports.insert(vars["MASTER_PORT"]);
    }
  CHECK(ports.size() == 1);
  if (t.isLab()) {
    // Host 1 is the endpoint's host: it serves the rendezvous store, not node rank 0's host.
    CHECK_THAT(r1.output, Catch::Contains("hosting the rendezvous store"));
    CHECK_THAT(r2.output, !Catch::Contains("hosting the rendezvous store"));
  }
}

MULTINODE_SCENARIO(twoJobsOneEndpoint, "multinode c10d: two jobs on the same endpoint with different rdzv ids never mix", 2, RdzvStore::kTest) {
  // Both jobs have an agent on host 1: in the lab both match the endpoint, one hosts the store and
  // the other falls back to being a client of it.
  test::Process a1(t.spawn(1, c10d(t, 1, "2", 1, {}, {"env", "sleep", "300"}, "jobA")));
  REQUIRE(waitFor(a1, "joins rendezvous"));
  test::Process b1(t.spawn(1, c10d(t, 2, "2", 2, {}, {"env", "sleep", "300"}, "jobB")));
  test::Process a2(t.spawn(2, c10d(t, 2, "2", 1, {}, {"env", "sleep", "300"}, "jobA")));
  test::Process b2(t.spawn(2, c10d(t, 2, "2", 1, {}, {"env", "sleep", "300"}, "jobB")));
  auto ra1 = a1.wait(), ra2 = a2.wait(), rb1 = b1.wait(), rb2 = b2.wait();
  INFO(ra1.output << "\n----\n" << ra2.output << "\n----\n" << rb1.output << "\n----\n" << rb2.output);
  REQUIRE(ra1.ok());
  REQUIRE(ra2.ok());
  REQUIRE(rb1.ok());
  REQUIRE(rb2.ok());
  auto check = [](const std::vector<test::ProcessResult*>& agents, const std::string& id, int world) {
    std::set<int> ranks;
    std::set<std::string> ports;
    for (auto* r : agents)
      for (auto& [rank, vars] : envOf(r->output)) {
        ranks.insert(rank);
        CHECK(vars["TORCHELASTIC_RUN_ID"] == id);
        CHECK(vars["WORLD_SIZE"] == std::to_string(world));
        ports.insert(vars["MASTER_PORT"]);
      }
    CHECK(static_cast<int>(ranks.size()) == world);
    CHECK(ports.size() == 1);
    return *ports.begin();
  };
  auto portA = check({&ra1, &ra2}, "jobA", 2);
  auto portB = check({&rb1, &rb2}, "jobB", 3);
  CHECK(portA != portB);  // each job's own workers' store
  if (t.isLab()) CHECK_THAT(rb1.output, Catch::Contains("joining that store as a client"));
}

// ---- c10d: elastic membership -------------------------------------------------------------------

MULTINODE_SCENARIO(lateJoiner, "multinode c10d: a late joiner triggers a new round at the step boundary and is not counted as a failure", 3, RdzvStore::kTest) {
  // Workers run until told to stop (SIGTERM: "snapshot" and exit 0), and finish at once in a
  // group of three.
  std::vector<std::string> worker = {"env", "if-world", "3", "exit", "0", "trap-term", "0", "hang"};
  test::Process a1(t.spawn(1, c10d(t, 1, "2:3", 1, {"--node-rank", "0"}, worker)));
  test::Process a2(t.spawn(2, c10d(t, 2, "2:3", 1, {"--node-rank", "1"}, worker)));
  REQUIRE(waitFor(a1, "ENV WORLD_SIZE=2"));
  REQUIRE(waitFor(a2, "ENV WORLD_SIZE=2"));
  test::Process a3(t.spawn(3, c10d(t, 3, "2:3", 1, {}, worker)));
  auto r1 = a1.wait(), r2 = a2.wait(), r3 = a3.wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << r3.output);
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  REQUIRE(r3.ok());
  for (auto* r : {&r1, &r2}) {
    // Stopped gracefully (SIGTERM: the trainer snapshots), re-formed without counting a failure.
    CHECK_THAT(r->output, Catch::Contains("got SIGTERM") && Catch::Contains("without counting a failure"));
    CHECK(countOf(r->output, "ENV WORLD_SIZE=3") == 1);
  }
  // At least one of them saw the waiting node (the other may see the first one leave first).
  CHECK_THAT(r1.output + r2.output, Catch::Contains("1 node(s) wait to join"));
  // The old nodes keep their ranks; the new one goes last; the restart count stays 0.
  CHECK(envOf(r1.output)[0]["GROUP_RANK"] == "0");
  CHECK(envOf(r2.output)[1]["GROUP_RANK"] == "1");
  CHECK(envOf(r3.output)[2]["GROUP_RANK"] == "2");
  for (auto* r : {&r1, &r2, &r3})
    for (auto& [rank, vars] : envOf(r->output)) CHECK(vars["TORCHELASTIC_RESTART_COUNT"] == "0");
}

MULTINODE_SCENARIO(killedNode, "multinode c10d: a killed node is removed and the survivors continue without it", 3, RdzvStore::kHost1) {
  std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "trap-term", "0", "hang"};
  auto a1 = t.startHost1([&] { return c10d(t, 1, "2:3", 1, {"--node-rank", "0"}, worker); });
  test::Process a2(t.spawn(2, c10d(t, 2, "2:3", 1, {"--node-rank", "1"}, worker)));
  test::Process a3(t.spawn(3, c10d(t, 3, "2:3", 1, {"--node-rank", "2"}, worker)));
  for (auto* a : {a1.get(), &a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=3"));
  t.kill(3, a3);
  auto r1 = a1->wait(), r2 = a2.wait(), r3 = a3.wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << r3.output);
  CHECK(r3.termSignal == SIGKILL);
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  // Host 1 hosts the store and sees the dead agent's connection close.
  CHECK_THAT(r1.output, Catch::Contains("connection of its ctorchrun to the store closed"));
  for (auto* r : {&r1, &r2}) {
    CHECK_THAT(r->output, Catch::Contains("left round 0") && Catch::Contains("without counting a failure"));
    CHECK(countOf(r->output, "ENV WORLD_SIZE=2") == 1);
  }
  CHECK(envOf(r1.output)[0]["GROUP_RANK"] == "0");
  CHECK(envOf(r2.output)[1]["GROUP_RANK"] == "1");
  CHECK(envOf(r2.output)[1]["TORCHELASTIC_RESTART_COUNT"] == "0");
}

MULTINODE_SCENARIO(silentNode, "multinode c10d: a node that goes silent is dropped by heartbeat and gives up on its own", 3, RdzvStore::kTest) {
  std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "trap-term", "0", "hang"};
  test::Process a1(t.spawn(1, c10d(t, 1, "2:3", 1, {"--node-rank", "0"}, worker)));
  test::Process a2(t.spawn(2, c10d(t, 2, "2:3", 1, {"--node-rank", "1"}, worker)));
  test::Process a3(t.spawn(3, c10d(t, 3, "2:3", 1, {"--node-rank", "2"}, worker)));
  for (auto* a : {&a1, &a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=3"));
  // netns: the link of host 3 goes down (packets vanish, nothing is closed); loopback: the agent is
  // paused (its connection stays open, its heartbeats stop).
  t.silence(3, a3);
  auto r1 = a1.wait(), r2 = a2.wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << a3.outputSoFar());
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  CHECK_THAT(r1.output + r2.output, Catch::Contains("no heartbeat for more than 1.5 s"));
  for (auto* r : {&r1, &r2}) CHECK(countOf(r->output, "ENV WORLD_SIZE=2") == 1);
  if (t.isLab()) {
    // The cut-off agent notices by itself: it stops its workers and exits 3 with the reason.
    auto r3 = a3.wait();
    INFO(r3.output);
    CHECK(r3.exitCode == 3);
    CHECK_THAT(r3.output, Catch::Contains("cut off from the others") && Catch::Contains("got SIGTERM"));
    t.unsilence(3, a3);
  } else {
    // Woken up after the others finished: its round is gone; it stops its workers and fails.
    t.unsilence(3, a3);
    auto r3 = a3.wait();
    INFO(r3.output);
    CHECK(r3.exitCode == 3);
    CHECK_THAT(r3.output, Catch::Contains("got SIGTERM"));
  }
}

MULTINODE_SCENARIO(belowMin, "multinode c10d: below MIN the survivor waits for the join timeout and then fails with one clear line", 2, RdzvStore::kTest) {
  std::vector<std::string> worker = {"env", "trap-term", "0", "hang"};
  test::Process a1(t.spawn(1, c10d(t, 1, "2", 1, {}, worker, "job", "1.5")));
  test::Process a2(t.spawn(2, c10d(t, 2, "2", 1, {}, worker, "job", "1.5")));
  for (auto* a : {&a1, &a2}) {
    INFO(a->outputSoFar());
    REQUIRE(waitFor(*a, "ENV WORLD_SIZE=2"));
  }
  t.kill(2, a2);
  auto r1 = a1.wait();
  INFO(r1.output);
  CHECK(r1.exitCode == 3);
  // The error is one line: what timed out, how many nodes came, how many are needed.
  std::regex err(R"(ctorchrun: error: rendezvous 'job' timed out after 1\.5 s: 1 node\(s\) joined round 1, at least 2 needed \(--nnodes 2\)[^\n]*\n?$)");
  CHECK(std::regex_search(r1.output, err));
}

// ---- c10d: store failover (--store-failover) ------------------------------------------------------

namespace {
// Every agent with --store-failover; host i asks for node rank i - 1 (host 1, the store host, is 0).
std::vector<std::string> failoverNode(const std::string& rank) { return {"--store-failover", "--node-rank", rank}; }
} // namespace

MULTINODE_SCENARIO(storeHostKilled, "multinode c10d --store-failover: the store host is killed and the others re-form on the next node's standby store", 3, RdzvStore::kHost1) {
  std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "trap-term", "0", "hang"};
  auto a1 = t.startHost1([&] { return c10d(t, 1, "2:3", 1, failoverNode("0"), worker); });
  test::Process a2(t.spawn(2, c10d(t, 2, "2:3", 1, failoverNode("1"), worker)));
  test::Process a3(t.spawn(3, c10d(t, 3, "2:3", 1, failoverNode("2"), worker)));
  for (auto* a : {a1.get(), &a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=3"));
  for (auto* a : {&a2, &a3}) CHECK_THAT(a->outputSoFar(), Catch::Contains("standby rendezvous store on port"));
  t.kill(1, *a1);
  auto r2 = a2.wait(), r3 = a3.wait();
  auto r1 = a1->wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << r3.output);
  CHECK(r1.termSignal == SIGKILL);
  REQUIRE(r2.ok());
  REQUIRE(r3.ok());
  // Host 2 is the first node (by rank) that did not serve the store: it re-creates the state in its
  // standby and host 3 moves there; host 1's node is removed, the two re-form with world size 2.
  CHECK_THAT(r2.output, Catch::Contains("this node serves the rendezvous store now"));
  CHECK_THAT(r3.output, Catch::Contains("now using the rendezvous store of node"));
  CHECK_THAT(r2.output, Catch::Contains("its agent served the rendezvous store, which was lost"));
  for (auto* r : {&r2, &r3}) {
    CHECK(countOf(r->output, "ENV WORLD_SIZE=2") == 1);
    CHECK_THAT(r->output, !Catch::Contains("cut off"));
  }
  // The workers of world size 2 use a new workers' store, a survivor's (host 1's died with it).
  for (auto* r : {&r2, &r3}) {
    const auto first = r->output.find("ENV MASTER_PORT="), last = r->output.rfind("ENV MASTER_PORT=");
    REQUIRE(first != last);
    CHECK(r->output.substr(first, r->output.find('\n', first) - first) !=
          r->output.substr(last, r->output.find('\n', last) - last));
    if (t.isLab()) {
      const auto a = r->output.rfind("ENV MASTER_ADDR=") + std::string("ENV MASTER_ADDR=").size();
      CHECK(r->output.substr(a, r->output.find('\n', a) - a) != t.addr(1));
    }
  }
  // In order: the loss, the take-over, the round of two - with no rendezvous timing out on the way
  // (the agents' own bounds are what a slow take-over would hit).
  const auto lost = r2.output.find("its agent served the rendezvous store, which was lost");
  const auto serves = r2.output.find("this node serves the rendezvous store now");
  const auto reformed = r2.output.find("ENV WORLD_SIZE=2");
  CHECK(lost < serves);
  CHECK(serves < reformed);
  CHECK(reformed != std::string::npos);
  for (auto* r : {&r2, &r3}) {
    const auto from = r->output.find("ENV WORLD_SIZE=3");
    CHECK(countOf(r->output.substr(from, r->output.find("ENV WORLD_SIZE=2") - from), "timed out") == 0);
  }
}

MULTINODE_SCENARIO(storeHostSilenced, "multinode c10d --store-failover: a cut-off store host stops, the others take the store over and finish", 3, RdzvStore::kHost1) {
  std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "trap-term", "0", "hang"};
  auto host1 = t.startHost1([&] { return c10d(t, 1, "1:3", 1, failoverNode("0"), worker); });
  test::Process& a1 = *host1;
  test::Process a2(t.spawn(2, c10d(t, 2, "1:3", 1, failoverNode("1"), worker)));
  test::Process a3(t.spawn(3, c10d(t, 3, "1:3", 1, failoverNode("2"), worker)));
  for (auto* a : {&a1, &a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=3"));
  // --nnodes 1:3: without the majority rule host 1 would go on alone (a second group training).
  t.silence(1, a1);
  auto r2 = a2.wait(), r3 = a3.wait();
  INFO(r2.output << "\n----\n" << r3.output << "\n----\n" << a1.outputSoFar());
  REQUIRE(r2.ok());
  REQUIRE(r3.ok());
  CHECK_THAT(r2.output, Catch::Contains("this node serves the rendezvous store now"));
  for (auto* r : {&r2, &r3}) CHECK(countOf(r->output, "ENV WORLD_SIZE=2") == 1);
  if (!t.isLab()) t.unsilence(1, a1);  // loopback: woken up after the others finished
  auto r1 = a1.wait();
  if (t.isLab()) t.unsilence(1, a1);
  INFO(r1.output);
  CHECK(r1.exitCode == 3);
  CHECK_THAT(r1.output, Catch::Contains("not a majority"));
  CHECK(countOf(r1.output, "ENV WORLD_SIZE=1") == 0);
}

MULTINODE_SCENARIO(storeFailoverNeedsMajority, "multinode c10d --store-failover: with two nodes the survivor of the store host does not take the store over", 2, RdzvStore::kHost1) {
  std::vector<std::string> worker = {"env", "trap-term", "0", "hang"};
  auto a1 = t.startHost1([&] { return c10d(t, 1, "1:2", 1, failoverNode("0"), worker); });
  test::Process a2(t.spawn(2, c10d(t, 2, "1:2", 1, failoverNode("1"), worker)));
  for (auto* a : {a1.get(), &a2}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=2"));
  t.kill(1, *a1);
  auto r2 = a2.wait();
  INFO(r2.output);
  CHECK(r2.exitCode == 3);
  CHECK_THAT(r2.output, Catch::Contains("only 1 of round 0's 2 nodes confirm that they lost the rendezvous store"));
  CHECK(countOf(r2.output, "ENV WORLD_SIZE=1") == 0);
}

// Issue 47.5: only the store host and the successor cut from each other; host 3 reaches both. The
// successor loses the store, host 3 does not: host 3 never marks a loss, so the successor counts 1
// of 3 and does not open a second store (it used to, because host 3's standby port answered); it
// is the one cut off and stops, hosts 1 and 3 re-form at 2 and finish. Namespace hosts only.
TEST_CASE("multinode c10d --store-failover: a partial partition (only the store host and the successor cut): no second store, the successor stops, the others finish (netns)", "[multinode][netns]") {
  CTORCH_REQUIRE_NETNS();
  NetnsHosts t(3);
  std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "trap-term", "0", "hang"};
  test::Process a1(t.spawn(1, c10d(t, 1, "2:3", 1, failoverNode("0"), worker)));
  test::Process a2(t.spawn(2, c10d(t, 2, "2:3", 1, failoverNode("1"), worker)));
  test::Process a3(t.spawn(3, c10d(t, 3, "2:3", 1, failoverNode("2"), worker)));
  for (auto* a : {&a1, &a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=3"));
  t.cutBetween(1, 2);
  auto r1 = a1.wait(), r3 = a3.wait(), r2 = a2.wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << r3.output);
  REQUIRE(r1.ok());
  REQUIRE(r3.ok());
  for (auto* r : {&r1, &r3}) CHECK(countOf(r->output, "ENV WORLD_SIZE=2") == 1);
  CHECK(r2.exitCode == 3);
  CHECK_THAT(r2.output, Catch::Contains("only 1 of round 0's 3 nodes confirm that they lost the rendezvous store"));
  CHECK_THAT(r2.output, !Catch::Contains("this node serves the rendezvous store now"));
  CHECK_THAT(r3.output, !Catch::Contains("moving to the standby store"));  // host 3 never lost the store
  CHECK(countOf(r2.output, "ENV WORLD_SIZE=2") == 0);
}

// Issue 58.12: after a failover the job's store lives at the successor's standby. ctorchrun
// restarted on the lost store host with the original command serves a fresh store at the original
// endpoint, and a new node started with that endpoint joins it: the two used to form a second round
// 0 under the same run id (world size 2) while the job trained on. Now the successor writes where
// the store is into whatever answers at the old endpoint, and both join the live job: 2 -> 4.
MULTINODE_SCENARIO(staleEndpoint, "multinode c10d --store-failover: ctorchrun restarted on the lost store host and a new node, both given the original endpoint, join the live job: no second round 0 (issue 58.12)", 4, RdzvStore::kHost1) {
  std::vector<std::string> worker = {"env", "if-world", "4", "exit", "0", "trap-term", "0", "hang"};
  auto original = [&] { return c10d(t, 1, "2:4", 1, failoverNode("0"), worker); };
  auto host1 = t.startHost1(original);
  test::Process a2(t.spawn(2, c10d(t, 2, "2:4", 1, failoverNode("1"), worker)));
  test::Process a3(t.spawn(3, c10d(t, 3, "2:4", 1, failoverNode("2"), worker)));
  for (auto* a : {host1.get(), &a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=3"));
  t.kill(1, *host1);
  INFO(host1->wait().output);
  for (auto* a : {&a2, &a3}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=2"));
  test::Process b1(t.spawn(1, original()));
  test::Process b4(t.spawn(4, c10d(t, 4, "2:4", 1, {"--store-failover"}, worker)));
  // The first round either new node runs in is the live job's (3 or 4 nodes), never one of its own.
  for (auto* b : {&b1, &b4}) {
    const bool started = waitFor(*b, "ENV WORLD_SIZE=");
    INFO(b->outputSoFar() << "\n----\n" << a2.outputSoFar());
    REQUIRE(started);
    const std::string out = b->outputSoFar();
    const auto at = out.find("ENV WORLD_SIZE=") + std::string("ENV WORLD_SIZE=").size();
    REQUIRE(out.substr(at, 1) != "2");
  }
  auto r2 = a2.wait(), r3 = a3.wait(), r1 = b1.wait(), r4 = b4.wait();
  INFO(r1.output << "\n----\n" << r2.output << "\n----\n" << r3.output << "\n----\n" << r4.output);
  for (auto* r : {&r1, &r2, &r3, &r4}) {
    CHECK(r->ok());
    CHECK(countOf(r->output, "ENV WORLD_SIZE=4") == 1);
  }
  for (auto* r : {&r1, &r4}) {
    CHECK_THAT(r->output, Catch::Contains("in a store failover; this node's endpoint"));
    CHECK_THAT(r->output, Catch::Contains(": joining it there"));
    CHECK(countOf(r->output, "ENV WORLD_SIZE=2") == 0);
  }
  CHECK_THAT(r2.output, Catch::Contains("told it where the rendezvous store is now"));
  // The restarted store host keeps its store at the old endpoint open, pointing the way.
  CHECK_THAT(r1.output, Catch::Contains("stays open and sends later nodes there too"));
}

MULTINODE_SCENARIO(storeHostLostNoFailover, "multinode c10d without --store-failover: losing the store host ends the survivor with what happened and what survives it (issue 28.3)", 2, RdzvStore::kHost1) {
  std::vector<std::string> worker = {"env", "trap-term", "0", "hang"};
  auto a1 = t.startHost1([&] { return c10d(t, 1, "1:2", 1, {"--node-rank", "0"}, worker); });
  test::Process a2(t.spawn(2, c10d(t, 2, "1:2", 1, {"--node-rank", "1"}, worker)));
  for (auto* a : {a1.get(), &a2}) REQUIRE(waitFor(*a, "ENV WORLD_SIZE=2"));
  t.kill(1, *a1);
  auto r2 = a2.wait();
  INFO(r2.output);
  CHECK(r2.exitCode == 3);
  CHECK_THAT(r2.output, Catch::Contains("got SIGTERM"));
  // Which node served the store, that it is gone (or this node cut off), and the flag that survives it.
  CHECK_THAT(r2.output, Catch::Contains("the rendezvous store at"));
  CHECK_THAT(r2.output, Catch::Contains("node '") && Catch::Contains("the rendezvous store"));
  CHECK_THAT(r2.output, Catch::Contains("Without --store-failover no other store takes its place: with 3 or more "
                                        "nodes, --store-failover keeps the nodes that still reach each other training"));
  CHECK_THAT(r2.output, !Catch::Contains("they have removed it by now") || Catch::Contains("was lost, or this node"));
}

TEST_CASE("multinode c10d: an agent alone below MIN fails after the join timeout without starting workers", "[multinode]") {
  Loopback t(RdzvStore::kTest);
  auto r = test::run(t.spawn(1, c10d(t, 1, "2", 1, {}, {"env"}, "job", "1")));
  INFO(r.output);
  CHECK(r.exitCode == 3);
  CHECK_THAT(r.output, Catch::Contains("timed out after 1 s: 1 node(s) joined round 0, at least 2 needed"));
  CHECK(countOf(r.output, "ENV RANK") == 0);  // no worker ever started
}

// ---- failures restart every node ------------------------------------------------------------------

namespace {

std::vector<std::string> staticArgs(const Topology& t, int rank, int nproc, const std::vector<std::string>& extra,
                                    const std::vector<std::string>& worker) {
  std::vector<std::string> a = {"--log-level", "info", "--nnodes", "2", "--node-rank", std::to_string(rank),
                                "--nproc-per-node", std::to_string(nproc), "--master-addr", t.masterAddr(),
                                "--master-port", std::to_string(t.masterPort()), "--rdzv-id", "static-job",
                                "--shutdown-timeout", "3"};
  a.insert(a.end(), extra.begin(), extra.end());
  a.push_back(fakeWorkerBin());
  a.insert(a.end(), worker.begin(), worker.end());
  return a;
}

} // namespace

// Global rank 2 (node 1's first worker) fails in the first attempt, once all four workers run (a
// barrier in their store); the others wait to be stopped. Then everyone succeeds.
static void workerFailureRestartsAll(Topology& t, const std::string& backend) {
  std::vector<std::string> worker = {"env", "barrier", "4", "if-rank", "2", "if-restart-below", "1", "exit", "3",
                                     "if-restart-below", "1", "hang"};
  // Each part its own rendezvous id (on loopback both meet in one store of the test's).
  auto args = [&](int host, std::vector<std::string> extra, const std::string& id) {
    if (backend == "static") return staticArgs(t, host - 1, 2, extra, worker);
    extra.insert(extra.end(), {"--node-rank", std::to_string(host - 1)});
    return c10d(t, host, "2", 2, extra, worker, id);
  };
  {
    auto results = t.runAll(2, [&](int host) { return args(host, {"--max-restarts", "1"}, "restarts"); });
    const auto& r1 = results[0];
    const auto& r2 = results[1];
    INFO(r1.output << "\n----\n" << r2.output);
    REQUIRE(r1.ok());
    REQUIRE(r2.ok());
    // Both nodes ran twice; the second attempt is restart 1 everywhere (the store prefix agrees).
    for (auto* r : {&r1, &r2}) {
      CHECK(countOf(r->output, "ENV TORCHELASTIC_RESTART_COUNT=0") == 2);
      CHECK(countOf(r->output, "ENV TORCHELASTIC_RESTART_COUNT=1") == 2);
      CHECK_THAT(r->output, Catch::Contains("restarting, restart 1 of 1"));
    }
    CHECK_THAT(r1.output, Catch::Contains("workers failed on"));  // told by node 1
    CHECK_THAT(r2.output, Catch::Contains("failed: exit 3"));
    std::set<std::string> ports;
    for (auto* r : {&r1, &r2})
      for (auto& [rank, vars] : envOf(r->output)) ports.insert(vars["MASTER_PORT"]);
    CHECK(ports.size() == 1);  // the last attempt's store, the same on both nodes
  }
  {
    // Control: no restart allowed, both nodes fail: node 1 with its worker's code, node 0 with 1.
    auto results = t.runAll(2, [&](int host) { return args(host, {}, "no-restarts"); });
    const auto& r1 = results[0];
    const auto& r2 = results[1];
    INFO(r1.output << "\n----\n" << r2.output);
    CHECK(r2.exitCode == 3);
    CHECK(r1.exitCode == 1);
    CHECK_THAT(r1.output, Catch::Contains("workers failed on") && Catch::Contains("no restarts allowed"));
    CHECK(countOf(r1.output, "ENV TORCHELASTIC_RESTART_COUNT=1") == 0);
  }
}

MULTINODE_SCENARIO(workerFailureC10d, "multinode c10d: a worker failure on one node restarts the workers of every node and counts once", 2, RdzvStore::kTest) {
  workerFailureRestartsAll(t, "c10d");
}

MULTINODE_SCENARIO(workerFailureStatic, "multinode static: a worker failure on one node restarts the workers of every node and counts once", 2, RdzvStore::kHost1) {
  workerFailureRestartsAll(t, "static");
}

// ---- Python workers across hosts ------------------------------------------------------------------

TEST_CASE("multinode c10d: Python gloo workers on two hosts all-reduce then crash then restart everywhere and all-reduce again (netns)", "[multinode][netns]") {
  CTORCH_REQUIRE_NETNS();
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  NetnsHosts t(2);
  test::TempDir dir;
  auto script = (dir / "crash_once.py").string();
  // Rank 3 (on host 2) dies after the first all-reduce of the first attempt.
  test::writeFile(script,
                  "import os, sys\n"
                  "exec(open(sys.argv[1]).read())\n"
                  "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '3':\n"
                  "    sys.exit(17)\n");
  auto args = [&](int host) {
    return std::vector<std::string>{"--log-level", "info", "--nnodes", "2", "--node-rank", std::to_string(host - 1),
                                    "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
                                    "--rdzv-endpoint", t.endpoint(), "--rdzv-id", "py", "--rdzv-conf",
                                    t.confFor(host) + ",join_timeout=60", script, dataDir() + "/gloo_allreduce.py"};
  };
  auto s1 = t.spawn(1, args(1)), s2 = t.spawn(2, args(2));
  s1.timeout = s2.timeout = 180s;
  test::Process a1(s1), a2(s2);
  auto r1 = a1.wait(), r2 = a2.wait();
  INFO(r1.output << "\n----\n" << r2.output);
  REQUIRE(r1.ok());
  REQUIRE(r2.ok());
  // Two attempts, four ranks each; the second attempt's stores agree on the restart count.
  CHECK(countOf(r1.output + r2.output, "ALLREDUCE-OK") == 8);
  CHECK(countOf(r1.output + r2.output, "world=4 sum=10.0") == 8);
  CHECK_THAT(r1.output, Catch::Contains("workers failed on"));
}
