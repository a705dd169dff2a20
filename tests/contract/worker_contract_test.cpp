#include "ctorch_catch.hpp"

#include "ctorch/contract/worker_contract.hpp"

#include <set>
#include <string>

namespace c = ctorch::contract;

TEST_CASE("contract: the documented variables are exactly torchrun's worker variables") {
  std::set<std::string> names;
  for (const auto& v : c::kWorkerVariables) names.insert(v.name);
  const std::set<std::string> torchrun = {
      "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
      "WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
      "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"};
  CHECK(names == torchrun);
}

TEST_CASE("contract: agent store prefix matches Python's rendezvous") {
  CHECK(c::agentStorePrefix(0) == "/worker/attempt_0");
  CHECK(c::agentStorePrefix(12) == "/worker/attempt_12");
}

TEST_CASE("contract: exit codes") {
  CHECK(c::exitCodeForSignal(9) == 137);
  CHECK(c::exitCodeForSignal(15) == 143);
  CHECK(c::kExitPreempted != c::kExitFailure);
  CHECK(c::kExitPreempted < c::kExitSignalBase);
}

TEST_CASE("contract: Slurm port rule") {
  CHECK(c::slurmDerivedPort(0) == 20000);
  CHECK(c::slurmDerivedPort(12345) == 20000 + 345);
  for (std::uint64_t id : {1ull, 11999ull, 123456789ull}) {
    int p = c::slurmDerivedPort(id);
    CHECK(p >= 20000);
    CHECK(p < 32000);
  }
}

TEST_CASE("contract: an eviction request reads back exactly what evictionPayload wrote, and nothing else") {
  using namespace ctorch::contract::inplace;
  const auto request = parseEvictionPayload(evictionPayload(4242, 7));
  REQUIRE(request);
  CHECK(request->pid == 4242);
  CHECK(request->generation == 7);
  CHECK(parseEvictionPayload(evictionPayload(1, 0)));
  for (const char* bad : {"", "pid=", "pid=12", "pid=12\ngeneration=", "pid=0\ngeneration=3", "pid=-5\ngeneration=3",
                          "pid=12\ngeneration=-1", "pid=12 \ngeneration=3", "pid=12\ngeneration=3\n",
                          "generation=3\npid=12", "pid=12\ngeneration=3x", "pid=99999999999999999999\ngeneration=1"})
    CHECK_FALSE(parseEvictionPayload(bad));
}
