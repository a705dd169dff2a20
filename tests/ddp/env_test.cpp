// The environment rules of ctorch::detectDistributedEnv, as a pure function: no processes.
#include "ctorch_catch.hpp"

#include "ctorch/distributed_env.hpp"
#include "ctorch/errors.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <map>
#include <string>

using ctorch::ConfigError;
using ctorch::DistributedEnv;
using ctorch::Launcher;
using Env = std::map<std::string, std::string>;

namespace {

DistributedEnv detect(const Env& vars) {
  return ctorch::detectDistributedEnv([&](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

// The message of the ConfigError `vars` must raise ("" when none is raised).
std::string errorOf(const Env& vars) {
  try {
    detect(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

const Env kTorchrun = {{"RANK", "3"},        {"WORLD_SIZE", "8"},       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29511"},
                       {"GROUP_RANK", "1"}};

Env with(Env base, const Env& changes) {
  for (const auto& [k, v] : changes) base[k] = v;
  return base;
}

Env without(Env base, const std::string& name) {
  base.erase(name);
  return base;
}

} // namespace

// The no-environment and torchrun rules (sections share one process: each test binary start costs
// LibTorch's static initialisation).
TEST_CASE("env: a world of 1 without variables and the torchrun variables") {
  SECTION("no distributed variables at all is a world of 1 without a store") {
    auto e = detect({{"HOME", "/root"}, {"PATH", "/usr/bin"}});
    CHECK(e.launcher == Launcher::kNone);
    CHECK(e.rank == 0);
    CHECK(e.worldSize == 1);
    CHECK(e.localRank == 0);
    CHECK(e.localWorldSize == 1);
    CHECK_FALSE(e.needsStore());
    CHECK_FALSE(e.useAgentStore);
    CHECK_THAT(e.describe(), Catch::Contains("no store"));
  }
  SECTION("empty values count as unset as in Python's env:// rendezvous") {
    auto e = detect({{"RANK", ""}, {"WORLD_SIZE", ""}, {"SLURM_PROCID", ""}});
    CHECK(e.launcher == Launcher::kNone);
  }
  SECTION("torchrun variables give the ranks and the store that rank 0 hosts") {
    auto e = detect(kTorchrun);
    CHECK(e.launcher == Launcher::kTorchrun);
    CHECK(e.rank == 3);
    CHECK(e.worldSize == 8);
    CHECK(e.localRank == 1);
    CHECK(e.localWorldSize == 2);
    CHECK(e.masterAddr == "node7");
    CHECK(e.masterPort == 29511);
    CHECK_FALSE(e.useAgentStore);
    CHECK(e.rankFrom == "RANK");
    CHECK(e.localRankFrom == "LOCAL_RANK");
    CHECK(e.masterPortFrom == "MASTER_PORT");
    CHECK_THAT(e.describe(), Catch::Contains("rank 3/8") && Catch::Contains("node7:29511") &&
                                 Catch::Contains("hosted by rank 0"));
  }
  SECTION("without LOCAL_RANK and LOCAL_WORLD_SIZE one node is assumed and said so") {
    auto e = detect(without(without(kTorchrun, "LOCAL_RANK"), "LOCAL_WORLD_SIZE"));
    CHECK(e.localRank == 3);
    CHECK(e.localWorldSize == 8);
    CHECK_THAT(e.localRankFrom, Catch::Contains("default"));
  }
  SECTION("RANK=0 WORLD_SIZE=1 by hand needs no store address") {
    auto e = detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
    CHECK(e.launcher == Launcher::kTorchrun);
    CHECK(e.worldSize == 1);
    CHECK_FALSE(e.needsStore());
  }
  SECTION("the agent store of torchrun / ctorchrun with its restart count") {
    auto e = detect(with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}}));
    CHECK(e.useAgentStore);
    CHECK(e.restartCount == 2);
    CHECK(e.needsStore());
    CHECK_THAT(e.describe(), Catch::Contains("agent store node7:29511 (restart 2)"));
    CHECK(ctorch::contract::agentStorePrefix(e.restartCount) == "/worker/attempt_2");

    auto off = detect(with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}}));
    CHECK_FALSE(off.useAgentStore);
  }
}

TEST_CASE("env: plain srun takes the ranks from Slurm and the master from the step's first node") {
  const Env srun = {{"SLURM_PROCID", "5"},          {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "1"},         {"SLURM_NODEID", "2"},
                    {"SLURM_TASKS_PER_NODE", "2(x4)"}, {"SLURM_JOB_ID", "123456"},
                    {"SLURM_STEP_NODELIST", "node[01-04,07]"}, {"SLURM_JOB_NODELIST", "node[00-09]"}};
  auto e = detect(srun);
  CHECK(e.launcher == Launcher::kSlurm);
  CHECK(e.rank == 5);
  CHECK(e.worldSize == 8);
  CHECK(e.localRank == 1);
  CHECK(e.localWorldSize == 2);
  CHECK(e.masterAddr == "node01");  // the step's first host, not the allocation's
  CHECK(e.masterPort == ctorch::contract::slurmDerivedPort(123456));
  CHECK(e.masterPort == 20000 + 123456 % 12000);
  CHECK_THAT(e.masterAddrFrom, Catch::Contains("SLURM_STEP_NODELIST='node[01-04,07]'"));
  CHECK_THAT(e.masterPortFrom, Catch::Contains("SLURM_JOB_ID='123456'"));

  SECTION("MASTER_ADDR and MASTER_PORT win when the job script exports them") {
    auto m = detect(with(srun, {{"MASTER_ADDR", "10.1.1.1"}, {"MASTER_PORT", "31000"}}));
    CHECK(m.masterAddr == "10.1.1.1");
    CHECK(m.masterPort == 31000);
  }
  SECTION("uneven nodes: SLURM_TASKS_PER_NODE is read at this node's index") {
    auto m = detect(with(srun, {{"SLURM_TASKS_PER_NODE", "2(x2),3,1"}, {"SLURM_NODEID", "2"},
                                {"SLURM_LOCALID", "2"}}));
    CHECK(m.localWorldSize == 3);
    CHECK(m.localRank == 2);
  }
  SECTION("without a step node list the allocation's is used") {
    auto m = detect(without(srun, "SLURM_STEP_NODELIST"));
    CHECK(m.masterAddr == "node00");
  }
  SECTION("hostlists with several ranges and padding") {
    CHECK(detect(with(srun, {{"SLURM_STEP_NODELIST", "rack[2-3]-gpu[098-101]"}})).masterAddr == "rack2-gpu098");
    CHECK(detect(with(srun, {{"SLURM_STEP_NODELIST", "login1,gpu[1-3]"}})).masterAddr == "login1");
  }
  SECTION("RANK takes precedence: ctorchrun under srun sets the torchrun variables") {
    auto m = detect(with(srun, kTorchrun));
    CHECK(m.launcher == Launcher::kTorchrun);
    CHECK(m.rank == 3);
  }
}

TEST_CASE("env: every bad or missing variable is a one-line error naming it and its value") {
  const Env srun = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "77"},
                    {"SLURM_STEP_NODELIST", "n[1-2]"}};
  struct Case {
    Env vars;
    std::vector<std::string> mentions;
  };
  const std::vector<Case> cases = {
      {with(kTorchrun, {{"RANK", "abc"}}), {"RANK='abc'", "integer"}},
      {with(kTorchrun, {{"RANK", "-1"}}), {"RANK='-1'"}},
      {with(kTorchrun, {{"RANK", "8"}}), {"RANK='8'", "WORLD_SIZE='8'", "0..7"}},
      {with(kTorchrun, {{"RANK", "1 "}}), {"RANK='1 '"}},
      {with(kTorchrun, {{"WORLD_SIZE", "0"}}), {"WORLD_SIZE='0'", "positive"}},
      {with(kTorchrun, {{"WORLD_SIZE", "99999999999999999999"}}), {"WORLD_SIZE='99999999999999999999'"}},
      {without(kTorchrun, "WORLD_SIZE"), {"RANK='3'", "WORLD_SIZE is not"}},
      {without(kTorchrun, "RANK"), {"WORLD_SIZE='8'", "RANK is not"}},
      {with(kTorchrun, {{"LOCAL_RANK", "2"}}), {"LOCAL_RANK='2'", "LOCAL_WORLD_SIZE='2'"}},
      {with(kTorchrun, {{"LOCAL_RANK", "x"}}), {"LOCAL_RANK='x'"}},
      {with(kTorchrun, {{"LOCAL_WORLD_SIZE", "9"}}), {"LOCAL_WORLD_SIZE='9'", "larger"}},
      {with(kTorchrun, {{"MASTER_PORT", "70000"}}), {"MASTER_PORT='70000'", "1-65535"}},
      {with(kTorchrun, {{"MASTER_PORT", "0"}}), {"MASTER_PORT='0'"}},
      {with(kTorchrun, {{"MASTER_PORT", "http"}}), {"MASTER_PORT='http'"}},
      {without(kTorchrun, "MASTER_ADDR"), {"MASTER_ADDR is not set"}},
      {without(kTorchrun, "MASTER_PORT"), {"MASTER_PORT is not set"}},
      {with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}}),
       {"TORCHELASTIC_USE_AGENT_STORE='True'", "TORCHELASTIC_RESTART_COUNT"}},
      {with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "maybe"}}), {"TORCHELASTIC_USE_AGENT_STORE='maybe'"}},
      {with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "-2"}}),
       {"TORCHELASTIC_RESTART_COUNT='-2'"}},
      {with(srun, {{"SLURM_PROCID", "2"}}), {"SLURM_PROCID='2'", "SLURM_NTASKS='2'"}},
      {with(srun, {{"SLURM_PROCID", "zero"}}), {"SLURM_PROCID='zero'"}},
      {without(srun, "SLURM_NTASKS"), {"SLURM_PROCID='0'", "SLURM_NTASKS"}},
      {with(srun, {{"SLURM_STEP_NODELIST", "node[01-"}}), {"SLURM_STEP_NODELIST='node[01-'"}},
      {without(srun, "SLURM_STEP_NODELIST"), {"SLURM_STEP_NODELIST"}},
      {without(srun, "SLURM_JOB_ID"), {"MASTER_PORT", "SLURM_JOB_ID"}},
      {with(srun, {{"SLURM_JOB_ID", "12x"}}), {"SLURM_JOB_ID='12x'"}},
      {with(srun, {{"MASTER_PORT", "65536"}}), {"MASTER_PORT='65536'"}},
      {with(srun, {{"SLURM_LOCALID", "3"}}), {"SLURM_LOCALID='3'"}},
      {with(srun, {{"SLURM_TASKS_PER_NODE", "2(y2)"}, {"SLURM_NODEID", "0"}}), {"SLURM_TASKS_PER_NODE='2(y2)'"}},
      {with(srun, {{"SLURM_TASKS_PER_NODE", "1,1"}, {"SLURM_NODEID", "5"}}), {"SLURM_NODEID='5'"}},
  };
  for (const auto& c : cases) {
    const std::string message = errorOf(c.vars);
    INFO("message: " << message);
    REQUIRE_FALSE(message.empty());
    CHECK(message.find('\n') == std::string::npos);
    for (const auto& m : c.mentions) CHECK_THAT(message, Catch::Contains(m));
  }
}
