// A real c10d agent (the ctorchrun binary) against a hostile client of its rendezvous store
// (issue 12): the store runs in this test (port 0), the agent joins it as a client, and a raw
// client deletes the agent's rendezvous state key. The agent used to wait for the key forever
// (each reconnect reset its "unreachable since" clock), ignoring SIGTERM and outliving its worker.
#include "ctorch_catch.hpp"

#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "launcher_test_util.hpp"

#include <csignal>
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
