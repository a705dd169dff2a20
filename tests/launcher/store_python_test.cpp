// The native TCPStore server against PyTorch 1.13's own Python client: TCPStore operations, and
// a real init_process_group("gloo") + all_reduce of several Python ranks using it as agent store.
#include "ctorch_catch.hpp"

#include "ctorch/store/tcp_store_server.hpp"
#include "launcher_test_util.hpp"

#include <memory>

using namespace ctorch;
using namespace ctorch::launcher_test;

TEST_CASE("store python: PyTorch's own TCPStore client operations against the native server") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  store::TcpStoreServer server({});
  test::SpawnOptions so;
  so.argv = {kSystemPython, dataDir() + "/store_ops.py", "127.0.0.1", std::to_string(server.port())};
  so.timeout = std::chrono::seconds(90);
  auto r = test::run(so);
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(r.output.find("STORE-OPS-OK") != std::string::npos);
  auto stats = server.stats();
  // PyTorch 1.13 (bookworm) speaks the legacy protocol, 2.2+ (the modern lane) the validated one;
  // one client never mixes them.
  const bool legacy = r.output.find("torch 1.") != std::string::npos;
  INFO("legacy " << stats.legacyConnections << " validated " << stats.validatedConnections);
  CHECK((legacy ? stats.legacyConnections : stats.validatedConnections) >= 2);
  CHECK((legacy ? stats.validatedConnections : stats.legacyConnections) == 0);
  CHECK(stats.protocolErrors == 0);
}

TEST_CASE("store python: init_process_group gloo and all_reduce over the native agent store") {
  if (!pythonHasTorch()) CTORCH_SKIP("/usr/bin/python3 cannot import torch (install python3-torch)");
  store::TcpStoreServer server({});
  const int world = 3;
  std::vector<std::unique_ptr<test::Process>> procs;
  for (int rank = 0; rank < world; ++rank) {
    test::SpawnOptions so;
    so.argv = {kSystemPython, dataDir() + "/gloo_allreduce.py"};
    so.timeout = std::chrono::seconds(120);
    so.setEnv = {{"RANK", std::to_string(rank)},
                 {"WORLD_SIZE", std::to_string(world)},
                 {"LOCAL_RANK", std::to_string(rank)},
                 {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", std::to_string(server.port())},
                 {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                 {"TORCHELASTIC_RESTART_COUNT", "0"},
                 {"OMP_NUM_THREADS", "1"}};
    procs.push_back(std::make_unique<test::Process>(so));
  }
  for (int rank = 0; rank < world; ++rank) {
    auto r = procs[static_cast<std::size_t>(rank)]->wait();
    INFO("rank " << rank << ": " << r.describe() << "\n" << r.output);
    CHECK(r.ok());
    CHECK(r.output.find("ALLREDUCE-OK rank=" + std::to_string(rank) + " world=3 sum=6.0") != std::string::npos);
  }
  CHECK(server.stats().protocolErrors == 0);
}
