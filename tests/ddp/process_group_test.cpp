// ctorch::initProcessGroup with real processes, a real TCPStore and Gloo on 127.0.0.1: rank-0-hosted
// store, the launcher's agent store (with its key prefix), plain srun, a world of 1, timeouts, and a
// job mixing C++ and Python (PyTorch 1.13) workers, which only works if the store layout and the DDP
// protocol are exactly Python's.
#include "ctorch_catch.hpp"

#include "ddp_test_util.hpp"
#include "multiproc.hpp"

#include "core/compat.hpp"
#include "ctorch/ddp.hpp"
#include "ctorch/distributed.hpp"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <iostream>

using namespace ctorch::test;
using ddptest::arg;
using ddptest::argInt;

namespace {

ctorch::ProcessGroupOptions optionsFrom(const std::vector<std::string>& args) {
  ctorch::ProcessGroupOptions o;
  o.timeout(std::chrono::milliseconds(argInt(args, "timeout_ms", 30000)));
  if (auto s = argInt(args, "store_timeout_ms", 0)) o.storeTimeout(std::chrono::milliseconds(s));
  return o;
}

// Every rank contributes rank+1: the sum proves all ranks took part.
bool allreduceWorks() {
  auto t = torch::tensor({static_cast<float>(ctorch::getRank() + 1)});
  std::vector<torch::Tensor> ts{t};
  ctorch::getDefaultGroup()->allreduce(ts)->wait();
  const int w = ctorch::getWorldSize();
  return t.item<float>() == static_cast<float>(w * (w + 1) / 2);
}

std::string storeKeyValue(c10d::Store& store, const std::string& key) {
  auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

} // namespace

// Initialises from the environment, checks an allreduce and the ranks, prints what it saw.
CTORCH_TEST_WORKER(pg_allreduce) {
  ctorch::initProcessGroup(optionsFrom(args));
  const auto& env = ctorch::getDistributedEnv();
  std::cout << "env: " << env.describe() << "\n";
  std::cout << "backend: " << ctorch::getBackendName() << "\n";
  if (!allreduceWorks()) return 10;
  if (ctorch::getRank() != env.rank || ctorch::getLocalRank() != env.localRank) return 11;
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  if (ctorch::isInitialized()) return 12;
  std::cout << "ok\n";
  return 0;
}

// Expects initialisation to fail; prints the error's type and message.
CTORCH_TEST_WORKER(pg_expect_failure) {
  try {
    ctorch::initProcessGroup(optionsFrom(args));
  } catch (const ctorch::DistributedTimeout& e) {
    std::cout << "DistributedTimeout: " << e.what() << "\n";
    return 3;
  } catch (const ctorch::Error& e) {
    std::cout << "Error: " << e.what() << "\n";
    return 4;
  }
  std::cout << "initialised unexpectedly\n";
  return 0;
}

// A world of 1 with no variables at all: the group works, and so does a DDP step.
CTORCH_TEST_WORKER(pg_world_of_one) {
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"})
    if (std::getenv(v)) return 20;
  ctorch::initProcessGroup();
  if (ctorch::getWorldSize() != 1 || ctorch::getRank() != 0 || !allreduceWorks()) return 21;
  if (ctorch::getDistributedEnv().needsStore()) return 22;
  torch::manual_seed(0);
  torch::nn::Linear model(4, 2);
  auto before = model->weight.detach().clone();
  ctorch::DistributedDataParallel ddp(model);
  torch::optim::SGD opt(ddp.parameters(), 0.1);
  auto loss = ddp(torch::ones({3, 4})).sum();
  loss.backward();
  // With one rank the averaged gradient is the local one: sum over 3 rows of ones -> 3.
  if (!torch::equal(model->weight.grad(), torch::full({2, 4}, 3.0f))) return 23;
  opt.step();
  if (torch::equal(before, model->weight.detach())) return 24;
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  std::cout << "ok\n";
  return 0;
}

// Misuse gives ConfigErrors, not crashes.
CTORCH_TEST_WORKER(pg_misuse) {
  int problems = 0;
  try {
    ctorch::getRank();
    ++problems;
  } catch (const ctorch::ConfigError& e) {
    std::cout << "before init: " << e.what() << "\n";
  }
  ctorch::initProcessGroup();
  try {
    ctorch::initProcessGroup();
    ++problems;
  } catch (const ctorch::ConfigError& e) {
    std::cout << "twice: " << e.what() << "\n";
  }
  try {
    ctorch::ProcessGroupOptions o;
    o.timeout(std::chrono::milliseconds(0));
    o.validate();
    ++problems;
  } catch (const ctorch::ConfigError& e) {
    std::cout << "timeout: " << e.what() << "\n";
  }
  ctorch::destroyProcessGroup();
  ctorch::initProcessGroup();  // again after destroy
  ctorch::destroyProcessGroup();
  return problems;
}

// The C++ side of a mixed C++/Python job: the same MLP, data and optimizer as python_peer.py.
CTORCH_TEST_WORKER(mixed_peer) {
  const int steps = static_cast<int>(argInt(args, "steps", 3));
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
  const int rank = ctorch::getRank(), world = ctorch::getWorldSize();
  if (!allreduceWorks()) return 30;
  torch::manual_seed(1234 + rank);  // different on every rank: DDP must broadcast rank 0's
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  ctorch::DistributedDataParallel ddp(model);
  torch::optim::SGD opt(ddp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(100 + step * world + rank);
    auto x = torch::randn({4, 8});
    auto y = torch::randn({4, 4});
    opt.zero_grad();
    auto loss = torch::mse_loss(ddp(x), y);
    loss.backward();
    opt.step();
  }
  std::cout << "params " << ddptest::paramsHex(model->parameters()) << std::endl;
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

TEST_CASE("process group: rank 0 hosts the store and 3 ranks allreduce through Gloo", "[pg]") {
  auto results = runWorkerGroup({.worker = "pg_allreduce",
                                 .worldSize = 3,
                                 .timeout = std::chrono::seconds(60),
                                 .store = StoreHost::kRankZero});
  requireAllOk(results);
  CHECK_THAT(results[0].output, Catch::Contains("rank 0/3 (local 0/3) from torchrun environment"));
  CHECK_THAT(results[2].output, Catch::Contains("hosted by rank 0"));
  CHECK_THAT(results[1].output, Catch::Contains("backend: gloo"));
}

TEST_CASE("process group: the launcher's agent store is used as a client, prefixed as Python of this release", "[pg]") {
  // The test plays the launcher: it hosts the TCPStore, as torchrun's agent does.
  c10d::TCPStoreOptions so;
  ctorch::compat::setUseLibUV(so, ctorch::compat::useLibUVFromEnvironment());
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(30);
  c10d::TCPStore agent("127.0.0.1", so);
  auto results = runWorkerGroup({.worker = "pg_allreduce",
                                 .worldSize = 2,
                                 .env = {{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                         {"TORCHELASTIC_RESTART_COUNT", "3"}},
                                 .timeout = std::chrono::seconds(60),
                                 .masterPort = agent.getPort()});
  requireAllOk(results);
  CHECK_THAT(results[0].output, Catch::Contains("agent store 127.0.0.1:" + std::to_string(agent.getPort())));
  // Python's layout: [/worker/attempt_3 (rendezvous, before 2.6)] / default_pg (init_process_group) /
  // group "0".
#if CTORCH_TORCH_AGENT_STORE_PREFIX
  const std::string root = "/worker/attempt_3/default_pg/";
#else
  const std::string root = "default_pg/";
  CHECK_FALSE(agent.check({"/worker/attempt_3/default_pg/0//cpu//SEQ_NUM_STORE_KEY"}));
#endif
#if TORCH_VERSION_MAJOR >= 2
  const std::string backend = root + "0//cpu//";
#else
  const std::string backend = root + "0/";
#endif
  if constexpr (ctorch::compat::kSequenceNumberFromStore)
    CHECK(agent.check({backend + "SEQ_NUM_STORE_KEY"}));  // Gloo's sequence number, set by rank 0
  else
    CHECK(agent.check({backend + "0/0"}));  // Gloo's address of rank 0 (2.14: no sequence number key)
#if TORCH_VERSION_MAJOR < 2
  CHECK(storeKeyValue(agent, root + "store_based_barrier_key:1") == "2");  // both ranks arrived
#endif
  CHECK_FALSE(agent.check({"/worker/attempt_0/default_pg/" + std::string("store_based_barrier_key:1")}));
  CHECK_FALSE(agent.check({"default_pg/0/SEQ_NUM_STORE_KEY"}));
}

TEST_CASE("process group: plain srun with the port derived from SLURM_JOB_ID", "[pg]") {
  // Rank 0 hosts on the port derived from the job id (20000-31999, below the ephemeral range): a
  // job id of a fresh port when another server holds the one drawn.
  int port = 0;
  auto results = withFreshPort([&](int) {
    port = ddptest::portInSlurmRange();
    const std::string jobId = std::to_string(12000 * 7 + (port - 20000));  // slurmDerivedPort -> port
    WorkerGroupOptions o;
    o.worker = "pg_allreduce";
    o.worldSize = 2;
    o.torchrunEnv = false;
    o.env = {{"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", jobId}, {"SLURM_STEP_NODELIST", "127.0.0.1"},
             {"SLURM_NODEID", "0"}, {"SLURM_TASKS_PER_NODE", "2"}};
    for (int r = 0; r < 2; ++r) o.rankEnv[r] = {{"SLURM_PROCID", std::to_string(r)}, {"SLURM_LOCALID", std::to_string(r)}};
    return runWorkerGroup(o);
  });
  requireAllOk(results);
  CHECK_THAT(results[1].output, Catch::Contains("rank 1/2 (local 1/2) from srun"));
  CHECK_THAT(results[1].output, Catch::Contains("store 127.0.0.1:" + std::to_string(port)));
}

TEST_CASE("process group: a world of 1 with no environment needs no store and runs DDP", "[pg]") {
  WorkerGroupOptions o;
  o.worker = "pg_world_of_one";
  o.worldSize = 1;
  o.torchrunEnv = false;
  auto results = runWorkerGroup(o);
  requireAllOk(results);
  CHECK_THAT(results[0].output, Catch::Contains("ok"));
}

TEST_CASE("process group: misuse is a ConfigError and init works again after destroy", "[pg]") {
  WorkerGroupOptions o;
  o.worker = "pg_misuse";
  o.worldSize = 1;
  o.torchrunEnv = false;
  auto results = runWorkerGroup(o);
  requireAllOk(results);
  CHECK_THAT(results[0].output, Catch::Contains("before init: the default process group is not initialized"));
  CHECK_THAT(results[0].output, Catch::Contains("twice: initProcessGroup() called twice"));
  CHECK_THAT(results[0].output, Catch::Contains("timeout must be positive, got 0 ms"));
}

TEST_CASE("process group: a bad variable fails at once with one line naming it", "[pg]") {
  auto results = runWorkerGroup({.worker = "pg_expect_failure", .worldSize = 1, .env = {{"MASTER_PORT", "70000"}}});
  REQUIRE(results[0].exitCode == 4);
  CHECK_THAT(results[0].output, Catch::Contains("Error: MASTER_PORT='70000' is not a TCP port number (1-65535)"));
}

TEST_CASE("process group: rank 0 waiting for a rank that never comes times out with a clear message", "[pg][timeout]") {
  // A world of 2 of which only rank 0 is started.
  auto results = runWorkerGroup({.worker = "pg_expect_failure",
                                 .worldSize = 1,
                                 .args = {"timeout_ms=2000"},
                                 .env = {{"WORLD_SIZE", "2"}},
                                 .timeout = std::chrono::seconds(60),
                                 .store = StoreHost::kRankZero});
  INFO(results[0].output);
  REQUIRE(results[0].exitCode == 3);
  CHECK_THAT(results[0].output, Catch::Contains("DistributedTimeout: rank 0/2: hosting the store at 127.0.0.1:"));
#if TORCH_VERSION_MAJOR >= 2
  CHECK_THAT(results[0].output, Catch::Contains("waiting for all 2 ranks to connect (store timeout 2 s)"));
#else
  // 1.13's TCPStore host gives up waiting silently; the Gloo connect that follows fails.
  CHECK_THAT(results[0].output, Catch::Contains("not all 2 ranks connected within the store timeout (2 s)"));
#endif
}

TEST_CASE("process group: a rank whose store host never comes times out with a clear message", "[pg][timeout]") {
  ReservedPort nobody;  // bound, never listening: nothing answers there
  auto results = runWorkerGroup({.worker = "pg_expect_failure",
                                 .worldSize = 1,
                                 .args = {"timeout_ms=2000"},
                                 .env = {{"WORLD_SIZE", "2"}, {"RANK", "1"}},
                                 .timeout = std::chrono::seconds(60),
                                 .masterPort = nobody.port()});
  INFO(results[0].output);
  REQUIRE(results[0].exitCode == 3);
  CHECK_THAT(results[0].output, Catch::Contains("DistributedTimeout: rank 1/2: connecting to the store at 127.0.0.1:"));
  CHECK_THAT(results[0].output, Catch::Contains("(hosted by rank 0) (store timeout 2 s)"));
}

TEST_CASE("process group: with the agent store a peer that never comes times out in the Gloo connect", "[pg][timeout]") {
  c10d::TCPStoreOptions so;
  ctorch::compat::setUseLibUV(so, ctorch::compat::useLibUVFromEnvironment());
  so.port = 0;
  so.isServer = true;
  so.waitWorkers = false;
  c10d::TCPStore agent("127.0.0.1", so);
  auto results = runWorkerGroup({.worker = "pg_expect_failure",
                                 .worldSize = 1,
                                 .args = {"timeout_ms=2000"},
                                 .env = {{"WORLD_SIZE", "2"},
                                         {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                         {"TORCHELASTIC_RESTART_COUNT", "0"}},
                                 .timeout = std::chrono::seconds(60),
                                 .masterPort = agent.getPort()});
  INFO(results[0].output);
  REQUIRE(results[0].exitCode == 3);
  CHECK_THAT(results[0].output, Catch::Contains("DistributedTimeout: rank 0/2: connecting to the other ranks (timeout 2 s)"));
}

namespace {

// Runs a 2-rank job where `pythonRank` is a Python 1.13 worker (tests/ddp/python_peer.py) and the
// other rank is this binary's mixed_peer; returns {C++ result, Python result}.
// With agentStore, the test hosts the store on a port it bound (`port` is not used).
std::pair<ProcessResult, ProcessResult> runMixedOnce(int pythonRank, bool agentStore, int port) {
  std::optional<c10d::TCPStore> agent;
  std::map<std::string, std::string> common = {{"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                                               {"MASTER_ADDR", "127.0.0.1"}, {"OMP_NUM_THREADS", "1"}};
  if (agentStore) {
    c10d::TCPStoreOptions so;
    ctorch::compat::setUseLibUV(so, ctorch::compat::useLibUVFromEnvironment());
    so.port = 0;
    so.isServer = true;
    so.waitWorkers = false;
    agent.emplace("127.0.0.1", so);
    port = agent->getPort();
    common["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    common["TORCHELASTIC_RESTART_COUNT"] = "1";
  }
  common["MASTER_PORT"] = std::to_string(port);
  auto spawn = [&](int rank, std::vector<std::string> argv) {
    SpawnOptions s;
    s.argv = std::move(argv);
    s.setEnv = common;
    s.setEnv["RANK"] = s.setEnv["LOCAL_RANK"] = std::to_string(rank);
    s.unsetEnv = {"TORCHELASTIC_ERROR_FILE", "SLURM_PROCID"};
    if (!agentStore) s.unsetEnv.push_back("TORCHELASTIC_USE_AGENT_STORE");
    s.timeout = std::chrono::seconds(90);
    return std::make_unique<Process>(s);
  };
  const std::string script = std::string(CTORCH_DDP_TEST_DIR) + "/python_peer.py";
  auto py = spawn(pythonRank, {"/usr/bin/python3", script, "3"});
  auto cpp = spawn(1 - pythonRank, {selfExe().string(), "--ctorch-worker", "mixed_peer", "steps=3"});
  auto cppResult = cpp->wait();
  auto pyResult = py->wait();
  return {cppResult, pyResult};
}

std::pair<ProcessResult, ProcessResult> runMixed(int pythonRank, bool agentStore) {
  if (!agentStore) {  // the rank 0 of the two hosts: on a fresh port when the one drawn was taken
    return withFreshPort([&](int port) { return runMixedOnce(pythonRank, false, port); });
  }
  return runMixedOnce(pythonRank, true, 0);
}

std::string paramsLine(const std::string& output) {
  auto pos = output.find("params ");
  if (pos == std::string::npos) return "";
  return output.substr(pos, output.find('\n', pos) - pos);
}

} // namespace

TEST_CASE("process group: a C++ rank 0 and a Python rank 1 train one DDP model together", "[pg][python]") {
  if (!std::filesystem::exists("/usr/bin/python3")) CTORCH_SKIP("/usr/bin/python3 (python3-torch) is missing");
  auto [cpp, py] = runMixed(/*pythonRank=*/1, /*agentStore=*/false);
  INFO("C++:\n" << cpp.output << "\nPython:\n" << py.output);
  REQUIRE(cpp.ok());
  REQUIRE(py.ok());
  CHECK_THAT(py.output, Catch::Contains("allreduce 3"));
  REQUIRE_FALSE(paramsLine(cpp.output).empty());
  CHECK(paramsLine(cpp.output) == paramsLine(py.output));  // bit-identical replicas
}

TEST_CASE("process group: a Python rank 0 and a C++ rank 1 share the launcher's agent store", "[pg][python]") {
  if (!std::filesystem::exists("/usr/bin/python3")) CTORCH_SKIP("/usr/bin/python3 (python3-torch) is missing");
  auto [cpp, py] = runMixed(/*pythonRank=*/0, /*agentStore=*/true);
  INFO("C++:\n" << cpp.output << "\nPython:\n" << py.output);
  REQUIRE(cpp.ok());
  REQUIRE(py.ok());
  REQUIRE_FALSE(paramsLine(cpp.output).empty());
  CHECK(paramsLine(cpp.output) == paramsLine(py.output));
}
