// The c10d rendezvous executor over a real c10d TCPStore (LibTorch's client and server: the
// launcher itself never links LibTorch, but this test may): the compare-and-set contract the
// executor relies on, agent processes on loopback, the time 2/8/32 agents need to complete a
// round, and, on network-namespace hosts, how long peers take to notice a killed and a cut-off
// node. Times are printed (for docs/rendezvous.md), never asserted.
#include "ctorch_catch.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"
#include "lab.hpp"
#include "multiproc.hpp"

#include "core/compat.hpp"
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

using namespace ctorch::rdzv::c10d;
using namespace ctorch::test;
using namespace std::chrono_literals;
using std::chrono::milliseconds;

namespace {

// CasStore over LibTorch's c10d::TCPStore client.
class C10dStore final : public CasStore {
 public:
  explicit C10dStore(c10d::Store& store) : store_(store) {}
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    auto out = store_.compareSet(key, bytes(expected), bytes(desired));
    return std::string(out.begin(), out.end());
  }
  std::string get(const std::string& key) override {
    auto out = store_.get(key);
    return std::string(out.begin(), out.end());
  }
  // The scalable join over LibTorch's own store: add / set / check / deleteKey as c10d has them.
  bool supportsAnnouncements() const override { return true; }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return store_.add(key, delta); }
  void set(const std::string& key, const std::string& value) override { store_.set(key, bytes(value)); }
  bool check(const std::string& key) override { return store_.check({key}); }
  void deleteKey(const std::string& key) override { store_.deleteKey(key); }

 private:
  static std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
  c10d::Store& store_;
};

long long wallMs() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

c10d::TCPStoreOptions clientOptions(int port, milliseconds timeout = 10s) {
  c10d::TCPStoreOptions o;
  ctorch::compat::setUseLibUV(o, ctorch::compat::useLibUVFromEnvironment());
  o.port = static_cast<std::uint16_t>(port);
  o.isServer = false;
  o.waitWorkers = false;
  o.timeout = timeout;
  return o;
}

std::unique_ptr<c10d::TCPStore> server(const std::string& host) {
  c10d::TCPStoreOptions o;
  ctorch::compat::setUseLibUV(o, ctorch::compat::useLibUVFromEnvironment());
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  o.timeout = 60s;
  return std::make_unique<c10d::TCPStore>(host, o);
}

} // namespace

// store_server ADDR: hosts a TCPStore on a free port, prints "PORT n", serves until killed.
CTORCH_TEST_WORKER(store_server) {
  auto s = server(args.at(0));
  std::printf("PORT %d\n", static_cast<int>(s->getPort()));
  std::fflush(stdout);
  for (;;) std::this_thread::sleep_for(1h);
}

// rdzv_agent HOST PORT RUN MIN MAX NPROC REQUESTED_RANK KEEPALIVE_MS LASTCALL_MS JOIN_MS READ_MS LABEL
// Joins rounds; between rounds heartbeats every KEEPALIVE/2 and re-rendezvous on any change.
// Prints "RESULT t=<wall ms> round= rank= nodes= base= world=" and "EVENT t=<wall ms> status= ...".
CTORCH_TEST_WORKER(rdzv_agent) {
  const std::string host = args.at(0);
  const int port = std::stoi(args.at(1));
  Settings s;
  s.runId = args.at(2);
  s.minNodes = std::stoi(args.at(3));
  s.maxNodes = std::stoi(args.at(4));
  const int nproc = std::stoi(args.at(5));
  const int requested = std::stoi(args.at(6));
  s.keepAliveInterval = milliseconds(std::stoi(args.at(7)));
  s.lastCallTimeout = milliseconds(std::stoi(args.at(8)));
  s.joinTimeout = milliseconds(std::stoi(args.at(9)));
  s.readTimeout = milliseconds(std::stoi(args.at(10)));
  const std::string label = args.at(11);
  c10d::TCPStore store(host, clientOptions(port, s.readTimeout));
  C10dStore cas(store);
  NodeInfo self;
  self.id = makeNodeId(label, ::getpid(), 0);
  self.host = label;
  self.addr = label;
  self.nproc = nproc;
  if (requested >= 0) self.requestedRank = requested;
  ExecutorOptions eo;
  eo.pollInterval = 50ms;
  eo.log = [](const std::string& line) { std::printf("LOG t=%lld %s\n", wallMs(), line.c_str()); };
  Executor ex(cas, s, self, systemClock(), eo);
  for (;;) {
    auto r = ex.nextRound();
    std::printf("RESULT t=%lld round=%lld rank=%d nodes=%d base=%d world=%d\n", wallMs(),
                static_cast<long long>(r.round), r.nodeRank, r.nodeCount, r.rankBase, r.worldSize);
    std::fflush(stdout);
    for (;;) {
      std::this_thread::sleep_for(s.keepAliveInterval / 2);
      auto a = ex.keepAlive();
      if (a.status == RoundStatus::Healthy) continue;
      std::printf("EVENT t=%lld status=%s %s\n", wallMs(), toString(a.status), a.reason.c_str());
      std::fflush(stdout);
      break;
    }
  }
}

namespace {

struct AgentLine {
  long long t = 0;
  long long round = 0;
  int rank = 0, nodes = 0, base = 0, world = 0;
};

std::vector<AgentLine> results(const std::string& out) {
  std::vector<AgentLine> r;
  const std::regex re(R"(RESULT t=(\d+) round=(\d+) rank=(\d+) nodes=(\d+) base=(\d+) world=(\d+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    r.push_back({std::stoll((*it)[1]), std::stoll((*it)[2]), std::stoi((*it)[3]), std::stoi((*it)[4]),
                 std::stoi((*it)[5]), std::stoi((*it)[6])});
  return r;
}

std::vector<std::pair<long long, std::string>> events(const std::string& out) {
  std::vector<std::pair<long long, std::string>> e;
  const std::regex re(R"(EVENT t=(\d+) status=([a-z-]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it)
    e.push_back({std::stoll((*it)[1]), (*it)[2]});
  return e;
}

// Waits (bounded) until `pred(output)` holds for the process; false on timeout or early exit.
bool waitFor(Process& p, const std::function<bool(const std::string&)>& pred, milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred(p.outputSoFar())) return true;
    if (!p.running()) return pred(p.outputSoFar());
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

std::vector<std::string> agentArgs(const std::string& host, int port, const std::string& run, int min, int max,
                                   int nproc, int requested, int keepAliveMs, int lastCallMs, int joinMs,
                                   int readMs, const std::string& label) {
  std::vector<std::string> a{selfExe().string(), "--ctorch-worker", "rdzv_agent", host, std::to_string(port), run,
                             std::to_string(min), std::to_string(max), std::to_string(nproc),
                             std::to_string(requested), std::to_string(keepAliveMs), std::to_string(lastCallMs),
                             std::to_string(joinMs), std::to_string(readMs), label};
  return a;
}

} // namespace

TEST_CASE("c10d store: compareSet behaves as the executor assumes", "[rendezvous]") {
  auto srv = server("127.0.0.1");
  c10d::TCPStore client("127.0.0.1", clientOptions(srv->getPort()));
  C10dStore cas(client);
  // Missing key, empty expected: created.
  CHECK(cas.compareSet("k", "", "v1") == "v1");
  // Wrong expected: unchanged, current value returned.
  CHECK(cas.compareSet("k", "nope", "v2") == "v1");
  // Right expected: swapped.
  CHECK(cas.compareSet("k", "v1", "v2") == "v2");
  CHECK(cas.get("k") == "v2");
  // Missing key, non-empty expected: nothing stored, `expected` returned (c10d's quirk).
  CHECK(cas.compareSet("other", "x", "y") == "x");
  CHECK_FALSE(client.check({"other"}));
  // The sentinel initialisation is idempotent.
  CHECK(cas.compareSet("s", "", kNoStateSentinel) == kNoStateSentinel);
  CHECK(cas.compareSet("s", "", "ignored") == kNoStateSentinel);
}

TEST_CASE("c10d store: three agent processes with mixed nproc complete a round", "[rendezvous]") {
  auto srv = server("127.0.0.1");
  const int port = srv->getPort();
  std::vector<std::unique_ptr<Process>> agents;
  const int nprocs[] = {2, 3, 1};
  const int requested[] = {-1, 0, -1};
  for (int i = 0; i < 3; ++i) {
    SpawnOptions o;
    o.argv = agentArgs("127.0.0.1", port, "mixed", 3, 3, nprocs[i], requested[i], 1000, 1000, 60000, 10000,
                       "agent" + std::to_string(i));
    o.timeout = 120s;
    agents.push_back(std::make_unique<Process>(o));
  }
  std::vector<AgentLine> r(3);
  for (int i = 0; i < 3; ++i) {
    INFO(agents[i]->outputSoFar());
    REQUIRE(waitFor(*agents[i], [](const std::string& out) { return !results(out).empty(); }, 60s));
    r[i] = results(agents[i]->outputSoFar()).at(0);
  }
  CHECK(r[1].rank == 0);  // requested
  std::set<int> ranks{r[0].rank, r[1].rank, r[2].rank};
  CHECK(ranks == std::set<int>{0, 1, 2});
  for (int i = 0; i < 3; ++i) {
    CHECK(r[i].world == 6);
    CHECK(r[i].nodes == 3);
  }
  // Global ranks: prefix sums in node-rank order.
  std::map<int, int> nprocByRank;
  for (int i = 0; i < 3; ++i) nprocByRank[r[i].rank] = nprocs[i];
  for (int i = 0; i < 3; ++i) {
    int base = 0;
    for (int k = 0; k < r[i].rank; ++k) base += nprocByRank[k];
    CHECK(r[i].base == base);
  }
}

TEST_CASE("c10d store: time for 2 8 and 32 agents to complete a round on loopback", "[rendezvous]") {
  auto srv = server("127.0.0.1");
  const int port = srv->getPort();
  for (int n : {2, 8, 32}) {
    const std::string run = "bench-" + std::to_string(n);
    Settings s;
    s.runId = run;
    s.minNodes = s.maxNodes = n;
    // One client connection per agent, made before the clock starts (as agents would be running).
    std::vector<std::unique_ptr<c10d::TCPStore>> clients;
    for (int i = 0; i < n; ++i) clients.push_back(std::make_unique<c10d::TCPStore>("127.0.0.1", clientOptions(port)));
    std::vector<std::unique_ptr<C10dStore>> cas;
    for (auto& c : clients) cas.push_back(std::make_unique<C10dStore>(*c));
    std::vector<RoundResult> out(n);
    std::vector<std::string> errors(n);
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        NodeInfo self;
        self.id = makeNodeId("node" + std::to_string(i), ::getpid(), i);
        self.host = self.addr = "node" + std::to_string(i);
        while (!go) std::this_thread::yield();
        try {
          Executor ex(*cas[i], s, self);
          out[i] = ex.nextRound();
        } catch (const std::exception& e) {
          errors[i] = e.what();
        }
      });
    auto start = std::chrono::steady_clock::now();
    go = true;
    for (auto& t : threads) t.join();
    auto ms = std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - start);
    std::set<int> ranks;
    for (int i = 0; i < n; ++i) {
      INFO(errors[i]);
      REQUIRE(errors[i].empty());
      ranks.insert(out[i].nodeRank);
      CHECK(out[i].nodeCount == n);
    }
    CHECK(static_cast<int>(ranks.size()) == n);
    std::printf("MEASURE rendezvous agents=%d ms=%lld (poll interval 100 ms, c10d TCPStore on loopback)\n", n,
                static_cast<long long>(ms.count()));
    WARN("rendezvous of " << n << " agents on loopback: " << ms.count() << " ms");
  }
}

// ---- on network-namespace hosts --------------------------------------------------------------------
namespace {

struct LabRun {
  std::unique_ptr<lab::NetnsLab> lab;
  std::unique_ptr<Process> server;
  std::vector<std::unique_ptr<Process>> agents;  // agent i runs on host i+1
  int port = 0;
};

// A store on host 1 and one agent on each of hosts 1..3 (2:3 nodes, heartbeat every 1 s, dead after
// 3 s, last call 1 s); returns once all three completed round 0.
void startLab(LabRun& run, const std::string& runId) {
  run.lab = std::make_unique<lab::NetnsLab>(3);
  SpawnOptions so;
  so.argv = {selfExe().string(), "--ctorch-worker", "store_server", "0.0.0.0"};
  so.timeout = 120s;
  run.server = std::make_unique<Process>(run.lab->spawnIn(1, so));
  const std::regex portRe("PORT (\\d+)");
  std::smatch m;
  REQUIRE(waitFor(*run.server, [&](const std::string& out) { return std::regex_search(out, m, portRe); }, 60s));
  std::string out = run.server->outputSoFar();
  REQUIRE(std::regex_search(out, m, portRe));
  run.port = std::stoi(m[1]);
  for (int h = 1; h <= 3; ++h) {
    SpawnOptions o;
    o.argv = agentArgs(run.lab->addr(1), run.port, runId, 2, 3, 1, h - 1, 1000, 1000, 60000, 5000,
                       "n" + std::to_string(h));
    o.timeout = 120s;
    run.agents.push_back(std::make_unique<Process>(run.lab->spawnIn(h, o)));
  }
  for (auto& a : run.agents) {
    INFO(a->outputSoFar());
    REQUIRE(waitFor(*a, [](const std::string& o) { return !results(o).empty(); }, 60s));
    CHECK(results(a->outputSoFar())[0].nodes == 3);
  }
}

// After host 3 is lost at `lostAt` (wall ms): hosts 1 and 2 notice and form round 1 without it.
void checkSurvivors(LabRun& run, long long lostAt, const char* what) {
  for (int i = 0; i < 2; ++i) {
    auto& a = *run.agents[i];
    INFO(a.outputSoFar());
    REQUIRE(waitFor(a, [](const std::string& o) { return results(o).size() >= 2; }, 60s));
    auto ev = events(a.outputSoFar());
    REQUIRE(!ev.empty());
    CHECK((ev[0].second == "peer-lost" || ev[0].second == "superseded"));
    auto r = results(a.outputSoFar());
    CHECK(r[1].nodes == 2);
    CHECK(r[1].rank == i);  // requested ranks 0 and 1 survive
    std::printf("MEASURE %s: host %d noticed after %lld ms, new round after %lld ms\n", what, i + 1,
                ev[0].first - lostAt, r[1].t - lostAt);
    WARN(what << ": host " << i + 1 << " noticed after " << ev[0].first - lostAt << " ms, round 1 after "
              << r[1].t - lostAt << " ms (heartbeat 1 s, expiry 3 s, last call 1 s)");
  }
}

} // namespace

TEST_CASE("netns rendezvous: a killed host is noticed and the others re-form", "[rendezvous][lab]") {
  CTORCH_REQUIRE_NETNS();
  LabRun run;
  startLab(run, "killed");
  long long lostAt = wallMs();
  run.lab->killHost(3);
  checkSurvivors(run, lostAt, "killed host");
}

TEST_CASE("netns rendezvous: a cut-off host is noticed and the others re-form", "[rendezvous][lab]") {
  CTORCH_REQUIRE_NETNS();
  LabRun run;
  startLab(run, "cut");
  long long lostAt = wallMs();
  run.lab->cut(3);
  checkSurvivors(run, lostAt, "cut-off host");
  // The cut-off agent cannot reach the store: its next store operation fails at read_timeout.
  auto& lost = *run.agents[2];
  bool ended = waitFor(lost, [&](const std::string&) { return !lost.running(); }, 30s);
  auto res = lost.wait();
  INFO(res.output);
  CHECK(ended);
  CHECK_FALSE(res.ok());
  run.lab->restore(3);
}
