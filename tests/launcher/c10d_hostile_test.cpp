// A real c10d agent (the ctorchrun binary) against a hostile client of its rendezvous store
// (issue 12): the store runs in this test (port 0), the agent joins it as a client, and a raw
// client deletes the agent's rendezvous state key. The agent used to wait for the key forever
// (each reconnect reset its "unreachable since" clock), ignoring SIGTERM and outliving its worker.
#include "ctorch_catch.hpp"

#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "launcher_test_util.hpp"

#include <csignal>
#include <thread>
#include <string>
#include <vector>

using namespace ctorch;
using namespace ctorch::launcher_test;
using namespace std::chrono_literals;

namespace {

// Short heartbeats and store timeouts; the store is the test's, not the agent's.
std::vector<std::string> agentArgs(int storePort, const std::string& nnodes, const std::vector<std::string>& worker) {
  std::vector<std::string> a = {"--log-level", "info", "--nnodes", nnodes, "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:" + std::to_string(storePort),
                                "--rdzv-id", "hostile",
                                "--rdzv-conf", "is_host=false,keep_alive_interval=0.5,keep_alive_max_attempt=3,"
                                               "read_timeout=2,join_timeout=20,close_timeout=3",
                                "--shutdown-timeout", "3", fakeWorkerBin()};
  a.insert(a.end(), worker.begin(), worker.end());
  return a;
}

void deleteStateKey(int storePort) {
  store::TcpStoreClientOptions o;
  o.timeout = 5s;
  store::TcpStoreClient hostile("127.0.0.1", static_cast<std::uint16_t>(storePort), o);
  REQUIRE(hostile.deleteKey("ctorchrun.rendezvous.hostile"));
}

bool outputHas(test::Process& p, const std::string& text, std::chrono::milliseconds deadline) {
  return eventually([&] { return p.outputSoFar().find(text) != std::string::npos; }, deadline);
}

} // namespace

TEST_CASE("c10d agent: its rendezvous state key deleted while the workers run ends the agent with one clear line") {
  store::TcpStoreServer storeServer({});
  test::Process agent(ctorchrunSpawn(agentArgs(storeServer.port(), "1", {"sleep", "30000"}), {}, 45s));
  REQUIRE(outputHas(agent, "started 1 worker(s)", 30s));
  deleteStateKey(storeServer.port());
  auto deleted = std::chrono::steady_clock::now();
  auto r = agent.wait();
  auto took = std::chrono::steady_clock::now() - deleted;
  INFO(r.output);
  CHECK_FALSE(r.timedOut);
  CHECK(r.exitCode != 0);
  CHECK(took < 15s);  // a heartbeat notices at once; bounded by the read timeout in any case
  CHECK_THAT(r.output, Catch::Contains("rendezvous state key 'ctorchrun.rendezvous.hostile' is gone"));
}

TEST_CASE("c10d agent: waiting for peers with its state key deleted, it stops promptly (and on SIGTERM)") {
  store::TcpStoreServer storeServer({});
  // Two nodes wanted, one comes: the agent waits in the rendezvous, reading the state.
  test::Process agent(ctorchrunSpawn(agentArgs(storeServer.port(), "2", {"sleep", "30000"}), {}, 45s));
  REQUIRE(outputHas(agent, "joins rendezvous", 30s));
  std::this_thread::sleep_for(300ms);
  deleteStateKey(storeServer.port());
  std::this_thread::sleep_for(300ms);
  auto signalled = std::chrono::steady_clock::now();
  agent.signalGroup(SIGTERM);
  auto r = agent.wait();
  auto took = std::chrono::steady_clock::now() - signalled;
  INFO(r.output);
  CHECK_FALSE(r.timedOut);
  CHECK(r.exitCode != 0);
  CHECK(took < 10s);
}
