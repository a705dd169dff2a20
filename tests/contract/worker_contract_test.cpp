#include "ctorch_catch.hpp"

#include "ctorch/contract/control_protocol.hpp"
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

TEST_CASE("contract: a process's incarnation is 16 hex digits, never 0, and reads back as written") {
  namespace cc = ctorch::contract::control;
  for (int i = 0; i < 100; ++i) {
    const std::uint64_t v = cc::randomIncarnation();
    CHECK(v != 0);
    CHECK(cc::parseIncarnation(cc::incarnationText(v)) == v);
  }
  CHECK(cc::incarnationText(0x0123456789abcdefull) == "0123456789abcdef");
  for (const char* bad : {"", "0000000000000000", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg", " 123456789abcdef"})
    CHECK_FALSE(cc::parseIncarnation(bad));
}
