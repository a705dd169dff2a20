// A real c10d agent (the ctorchrun binary) against a hostile client of its rendezvous store
// (issue 12): the store runs in this test (port 0), the agent joins it as a client, and a raw
// client deletes the agent's rendezvous state key. The agent used to wait for the key forever
// (each reconnect reset its "unreachable since" clock), ignoring SIGTERM and outliving its worker.
#include "ctorch_catch.hpp"

// The contract is header-only; its HMAC builds the signed record independently of the launcher.
#include "../../launcher/contract/include/ctorch/contract/control_auth.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "launcher_test_util.hpp"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace ctorch;
using namespace ctorch::launcher_test;
using namespace std::chrono_literals;

namespace {

// Short heartbeats; the store is the test's, not the agent's. The read and join timeouts are long:
// neither may be what ends the agent on a slow machine (the deleted key or the signal must).
std::vector<std::string> agentArgs(int storePort, const std::string& nnodes, const std::vector<std::string>& worker) {
  std::vector<std::string> a = {"--log-level", "info", "--nnodes", nnodes, "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(storePort),
                                "--rdzv-id", "hostile",
                                "--rdzv-conf", "is_host=false,keep_alive_interval=0.5,keep_alive_max_attempt=3,"
                                               "read_timeout=30,join_timeout=300,close_timeout=3",
                                "--shutdown-timeout", "3", fakeWorkerBin()};
  a.insert(a.end(), worker.begin(), worker.end());
  return a;
}

const std::string kStateKey = "ctorchrun.rendezvous.hostile";

// A client of the test's own store (generous bounds: they only keep a broken test from hanging).
store::TcpStoreClient storeClient(int storePort) {
  store::TcpStoreClientOptions o;
  o.timeout = 60s;
  return store::TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(storePort), o);
}

void deleteStateKey(int storePort) {
  auto hostile = storeClient(storePort);
  REQUIRE(hostile.deleteKey(kStateKey));
}

bool outputHas(test::Process& p, const std::string& text, std::chrono::milliseconds deadline) {
  return eventually([&] { return p.outputSoFar().find(text) != std::string::npos; }, deadline);
}

} // namespace

// The agent's worker hangs (never ends by itself): what ends the agent is the deleted key. The
// spawn's 120 s are a hang guard, not a measure.
TEST_CASE("c10d agent: its rendezvous state key deleted while the workers run ends the agent with one clear line") {
  store::TcpStoreServer storeServer({});
  test::Process agent(ctorchrunSpawn(agentArgs(storeServer.port(), "1", {"hang"}), {}, 120s));
  REQUIRE(outputHas(agent, "started 1 worker(s)", 60s));
  deleteStateKey(storeServer.port());
  auto r = agent.wait();
  INFO(r.output);
  CHECK_FALSE(r.timedOut);
  CHECK(r.exitCode != 0);
  CHECK_THAT(r.output, Catch::Contains("rendezvous state key '" + kStateKey + "' is gone"));
}

TEST_CASE("c10d agent: waiting for peers with its state key deleted, it stops on its own or on SIGTERM") {
  store::TcpStoreServer storeServer({});
  // Two nodes wanted, one comes: the agent waits in the rendezvous, reading the state.
  test::Process agent(ctorchrunSpawn(agentArgs(storeServer.port(), "2", {"hang"}), {}, 120s));
  REQUIRE(outputHas(agent, "joins rendezvous", 60s));
  // The state it waits in is in the store (the test's own client sees it), then deleted.
  auto watcher = storeClient(storeServer.port());
  REQUIRE(eventually([&] { return watcher.check({kStateKey}); }, 60s));
  deleteStateKey(storeServer.port());
  // The agent goes on asking the store after the deletion (or has ended already): then SIGTERM.
  const auto served = storeServer.stats().requests;
  REQUIRE(eventually([&] { return storeServer.stats().requests >= served + 3 || !agent.running(); }, 60s));
  agent.signalGroup(SIGTERM);
  auto r = agent.wait();
  INFO(r.output);
  CHECK_FALSE(r.timedOut);  // it used to wait for the key for ever, SIGTERM or not
  CHECK(r.exitCode != 0);
  // Whichever came first, it said why it stopped.
  const bool gone = r.output.find("rendezvous state key '" + kStateKey + "' is gone") != std::string::npos;
  const bool signalled = r.output.find("received SIGTERM") != std::string::npos;
  CHECK((gone || signalled));
}

// ---- a job whose agents host the stores (issue 58) --------------------------------------------------------
namespace {

// Agent `host` (1 or 2) of a 2-node c10d job on the loopback whose rendezvous store agent 1 serves
// at 127.0.0.1:`port`, with ctorchrun's default heartbeats (1 s, dead after 3 missed).
std::vector<std::string> hostedArgs(int port, int host, const std::vector<std::string>& extra,
                                    const std::vector<std::string>& worker) {
  std::vector<std::string> a = {"--log-level", "debug", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port),
                                "--rdzv-id", "hosted",
                                "--rdzv-conf", std::string("is_host=") + (host == 1 ? "true" : "false") +
                                                   ",last_call_timeout=0.5,join_timeout=120,close_timeout=3",
                                "--node-rank", std::to_string(host - 1), "--shutdown-timeout", "3"};
  a.insert(a.end(), extra.begin(), extra.end());
  a.push_back(fakeWorkerBin());
  a.insert(a.end(), worker.begin(), worker.end());
  return a;
}

// Both agents of the job, started once agent 1 serves the port (drawn again while it was taken).
struct HostedJob {
  HostedJob(const std::vector<std::string>& extra, const std::vector<std::string>& worker,
            const std::map<std::string, std::string>& env = {}) {
    test::withFreshPort([&](int p) {
      port = p;
      host1 = std::make_unique<test::Process>(ctorchrunSpawn(hostedArgs(p, 1, extra, worker), env, 120s));
      eventually([&] { return !host1->running() || host1->outputSoFar().find("hosting the rendezvous store on port") !=
                                                       std::string::npos; },
                 60s);
      return !host1->running() && test::portTaken(host1->outputSoFar());
    });
    REQUIRE(host1->running());
    host2 = std::make_unique<test::Process>(ctorchrunSpawn(hostedArgs(port, 2, extra, worker), env, 120s));
  }
  bool bothStarted() {
    return outputHas(*host1, "started 1 worker(s)", 60s) && outputHas(*host2, "started 1 worker(s)", 60s);
  }
  // Both agents' ends, then the attacker's connections closed.
  std::pair<test::ProcessResult, test::ProcessResult> finish(const std::vector<int>& attackers) {
    auto r1 = host1->wait();
    auto r2 = host2->wait();
    for (int fd : attackers) ::close(fd);
    return {std::move(r1), std::move(r2)};
  }
  int port = 0;
  std::unique_ptr<test::Process> host1, host2;
};

// Four connections to the store at `port` that each ask for "/large" 16 times and never read the
// replies (256 MiB each, far more than the server holds for one that does not read). The caller
// closes them.
std::vector<int> neverReadingGets(int port) {
  {
    auto writer = storeClient(port);
    writer.set("large", store::Bytes(16u << 20, 'v'));  // the largest value a request may carry
    REQUIRE(writer.get("large").size() == 16u << 20);
  }
  // Validated GETs of "/large" (the key as the client library sends it).
  store::Bytes gets = store::protocol::encodeValidate();
  for (int i = 0; i < 16; ++i) {
    store::Bytes get = store::protocol::Writer().u8(3).str("/large").take();
    gets.insert(gets.end(), get.begin(), get.end());
  }
  std::vector<int> hogs;
  for (int i = 0; i < 4; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    int size = 64 << 10;  // no autotuned 32 MiB receive buffer taking the replies for it
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::send(fd, gets.data(), gets.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(gets.size()));
    hogs.push_back(fd);
  }
  return hogs;
}

using test::Listener;
using test::listenersOf;

bool loopback(const Listener& l) {
  return l.v6 ? l.address == "00000000000000000000000001000000"
              : l.address.size() == 8 && l.address.substr(6) == "7F";
}

std::string describe(const std::vector<Listener>& ls) {
  std::string s;
  for (const auto& l : ls) s += (l.v6 ? "[" + l.address + "]" : l.address) + ":" + std::to_string(l.port) + " ";
  return s;
}

} // namespace

// Issue 58.4: with --rdzv-endpoint 127.0.0.1:P every agent is on this machine, yet the rendezvous
// store, the workers' store and the standby store listened on every interface (IPv6 dual-stack "::").
TEST_CASE("c10d agent: with a loopback endpoint the rendezvous, workers' and standby stores listen on the loopback "
          "only (issue 58.4)") {
  HostedJob job({"--store-failover"}, {"hang"});
  REQUIRE(job.bothStarted());
  // Agent 1: the rendezvous store (the endpoint's port) and the workers' store (node rank 0's);
  // agent 2: its standby store (--store-failover).
  const auto host1 = listenersOf(job.host1->pid()), host2 = listenersOf(job.host2->pid());
  INFO("agent 1 listens on " << describe(host1) << "; agent 2 on " << describe(host2));
  CHECK(host1.size() >= 2);
  CHECK(host2.size() >= 1);
  bool endpoint = false;
  for (const auto& l : host1) endpoint = endpoint || l.port == job.port;
  CHECK(endpoint);
  for (const auto& l : host1) CHECK(loopback(l));
  for (const auto& l : host2) CHECK(loopback(l));
  CHECK_THAT(job.host1->outputSoFar(), Catch::Contains("listening on 127.0.0.1"));
  job.host1->signalGroup(SIGTERM);
  job.host2->signalGroup(SIGTERM);
  INFO(job.host1->wait().output);
  INFO(job.host2->wait().output);
}

// Issue 58.1: connections that ask the rendezvous store for a large value again and again and never
// read the replies fill the server (up to 64 MiB each, past its 128 MiB in all): it stops serving
// everyone until it drops them. It waited one or two 5 s reply windows; the agents give up on a
// store silent for their heartbeat expiry (3 s): both exited 3 ("no answer from the rendezvous
// store ... 3.25 s"). Now the window is a sixth of the expiry: the job is slowed, never lost. (Two
// such connections did it in the measurement; here the socket buffers take about 4 MiB of
// each one's replies, so it takes a third: four are used.)
TEST_CASE("c10d agent: connections that never read their large replies from the rendezvous store slow the job, "
          "both agents finish (issue 58.1)") {
  HostedJob job({}, {"sleep", "8000"});
  REQUIRE(job.bothStarted());
  const std::vector<int> hogs = neverReadingGets(job.port);
  // They never read; the job runs its 8 s meanwhile.
  auto [r1, r2] = job.finish(hogs);
  INFO(r1.output);
  INFO(r2.output);
  CHECK(r1.exitCode == 0);
  CHECK(r2.exitCode == 0);
  CHECK(r1.output.find("no answer from the rendezvous store") == std::string::npos);
  CHECK(r2.output.find("no answer from the rendezvous store") == std::string::npos);
  // They did stop the server (it says so), and it dropped them.
  CHECK_THAT(r1.output, Catch::Contains("store: reading suspended"));
  CHECK_THAT(r1.output, Catch::Contains("takes its replies slower than minReplyRate"));
}

// Issue 58.1 on the workers' store: the same connections against node rank 0's workers' store
// while the workers use it. With the server's 5 s reply window their requests waited 5-10 s, past
// a training program's own store timeout (the issue's: 4 s): every restart spent. The workers here
// do a store barrier, each request bounded by 4 s; with ctorchrun's 250 ms window they pass it.
TEST_CASE("c10d agent: connections that never read their large replies from the workers' store slow the workers' "
          "store requests, never past their own 4 s bound (issue 58.1)") {
  test::TempDir dir("workers-store-hogs");
  const std::string go = (dir / "go").string();
  HostedJob job({"--max-restarts", "3"}, {"env", "wait-file", go, "barrier", "2", "exit", "0"},
                {{"FAKE_WORKER_STORE_TIMEOUT_MS", "4000"}});
  REQUIRE(outputHas(*job.host1, "ENV MASTER_PORT=", 60s));
  REQUIRE(outputHas(*job.host2, "ENV MASTER_PORT=", 60s));
  const std::string out = job.host1->outputSoFar();
  const auto at = out.find("ENV MASTER_PORT=") + std::string("ENV MASTER_PORT=").size();
  const int workersStore = std::stoi(out.substr(at, out.find('\n', at) - at));
  REQUIRE(workersStore != job.port);
  const std::vector<int> hogs = neverReadingGets(workersStore);
  std::ofstream(go).put('1');
  auto [r1, r2] = job.finish(hogs);
  INFO(r1.output);
  INFO(r2.output);
  CHECK(r1.exitCode == 0);
  CHECK(r2.exitCode == 0);
  for (auto* r : {&r1, &r2}) CHECK_THAT(r->output, Catch::Contains("(attempt 1,") && !Catch::Contains("(attempt 2,"));
  CHECK_THAT(r1.output, Catch::Contains("takes its replies slower than minReplyRate"));
}

// ---- a stale endpoint: the record that the job's store moved (issue 58.12) ----------------------------------
namespace {

const std::string kMovedSecret = "0123456789abcdef-moved-secret";

// An agent of run "moved" (2 nodes, --store-failover) whose endpoint is the test's store at `port`.
std::vector<std::string> movedArgs(int port, const std::vector<std::string>& worker) {
  std::vector<std::string> a = {"--log-level", "info", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(port),
                                "--rdzv-id", "moved",
                                "--rdzv-conf", "is_host=false,keep_alive_interval=0.5,keep_alive_max_attempt=3,"
                                               "last_call_timeout=0.5,join_timeout=60,close_timeout=3",
                                "--store-failover", "--shutdown-timeout", "3", fakeWorkerBin()};
  a.insert(a.end(), worker.begin(), worker.end());
  return a;
}

// The record the live store's agent writes at the old endpoint, as docs/store-failover.md gives it,
// built here independently of the launcher's code: it says the store of run "moved" is at
// 127.0.0.1:`port`, signed under kMovedSecret's failover key, or unsigned ("-").
void writeMovedRecord(int staleStore, int port, bool signedRecord) {
  namespace auth = contract::auth;
  const std::string body = "ctorchrun-moved-store 1\nmoved\n0\nlive_1_0\n127.0.0.1\n" + std::to_string(port);
  std::string mac = "-";
  if (signedRecord) {
    const auth::Digest k = auth::hmacSha256(kMovedSecret, "ctorch store-failover key for run moved");
    mac = auth::toHex(auth::hmacSha256(std::string(reinterpret_cast<const char*>(k.data()), k.size()), body));
  }
  storeClient(staleStore).set("ctorchrun/failover/moved/moved", store::toBytes(body + "\n" + mac));
}

const std::map<std::string, std::string> kWithSecret = {{"CTORCH_JOB_SECRET", kMovedSecret}};

} // namespace

TEST_CASE("c10d agent --store-failover: a signed record at its endpoint saying the job's store moved sends it to "
          "the live store, where it joins the job (issue 58.12)") {
  store::TcpStoreServer stale({}), live({});
  writeMovedRecord(stale.port(), live.port(), true);
  const std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "hang"};
  test::Process member(ctorchrunSpawn(movedArgs(live.port(), worker), kWithSecret, 120s));
  auto watcher = storeClient(live.port());
  REQUIRE(eventually([&] { return watcher.check({"ctorchrun.rendezvous.moved"}); }, 60s));
  test::Process late(ctorchrunSpawn(movedArgs(stale.port(), worker), kWithSecret, 120s));
  auto rm = member.wait(), rl = late.wait();
  INFO(rm.output << "\n----\n" << rl.output);
  CHECK(rm.ok());
  CHECK(rl.ok());
  CHECK_THAT(rl.output, Catch::Contains("moved to 127.0.0.1:" + std::to_string(live.port())));
  CHECK_THAT(rl.output, Catch::Contains(": joining it there"));
  for (auto* r : {&rm, &rl}) CHECK_THAT(r->output, Catch::Contains("ENV WORLD_SIZE=2"));
}

TEST_CASE("c10d agent --store-failover: a record naming a store that holds no state of the run: it refuses in one "
          "line and starts nothing (issue 58.12)") {
  store::TcpStoreServer stale({}), empty({});
  writeMovedRecord(stale.port(), empty.port(), false);
  auto r = runCtorchrun(movedArgs(stale.port(), {"env"}), {}, 120s);
  INFO(r.output);
  CHECK(r.exitCode == 3);
  CHECK_THAT(r.output, Catch::Contains("holds no rendezvous state of this run: not forming a second group under the "
                                       "same run id"));
  CHECK_THAT(r.output, !Catch::Contains("started 1 worker"));
  CHECK_THAT(r.output, !Catch::Contains("Traceback") && !Catch::Contains("terminate called"));
}

TEST_CASE("c10d agent --store-failover: with a job secret an unsigned record is ignored and the job forms at its "
          "endpoint (issue 58.12)") {
  store::TcpStoreServer here({}), elsewhere({});
  writeMovedRecord(here.port(), elsewhere.port(), false);
  const std::vector<std::string> worker = {"env", "if-world", "2", "exit", "0", "hang"};
  test::Process a(ctorchrunSpawn(movedArgs(here.port(), worker), kWithSecret, 120s));
  test::Process b(ctorchrunSpawn(movedArgs(here.port(), worker), kWithSecret, 120s));
  auto ra = a.wait(), rb = b.wait();
  INFO(ra.output << "\n----\n" << rb.output);
  for (auto* r : {&ra, &rb}) {
    CHECK(r->ok());
    CHECK_THAT(r->output, Catch::Contains("is not signed with this job's CTORCH_JOB_SECRET: ignored"));
    CHECK_THAT(r->output, !Catch::Contains("joining it there"));
    CHECK_THAT(r->output, Catch::Contains("ENV WORLD_SIZE=2"));
  }
}
