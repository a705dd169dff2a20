// Tests of the Slurm derivation against environments captured from real srun tasks of the lab
// cluster (tests/slurm/data/<case>/task<N>.env, made by tests/slurm/data/capture.sh), plus a
// live check on a running lab cluster where this machine can make one.
#include "ctorch_catch.hpp"

#include "ctorch/slurm/derive.hpp"
#include "lab.hpp"
#include "multiproc.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <set>
#include <sstream>

#ifndef CTORCH_SLURM_DATA_DIR
#error "CTORCH_SLURM_DATA_DIR must name tests/slurm/data"
#endif

using namespace ctorch::slurm;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
using Env = std::map<std::string, std::string>;

namespace {

Env loadEnv(const fs::path& file) {
  std::ifstream in(file);
  REQUIRE(in);
  Env env;
  std::string line;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

fs::path dataDir() { return fs::path(CTORCH_SLURM_DATA_DIR); }

// The tasks of one captured case, by SLURM_PROCID.
std::vector<Env> tasksOf(const std::string& name) {
  std::vector<Env> tasks;
  for (int i = 0;; ++i) {
    fs::path f = dataDir() / name / ("task" + std::to_string(i) + ".env");
    if (!fs::exists(f)) break;
    tasks.push_back(loadEnv(f));
  }
  REQUIRE(!tasks.empty());
  return tasks;
}

Derivation derive(const Env& env, UserChoices user = {}) { return deriveFromSlurm(user, mapEnv(env)); }

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

int jobPort(const Env& env) { return ctorch::contract::slurmDerivedPort(std::stoull(env.at("SLURM_JOB_ID"))); }

} // namespace

TEST_CASE("slurm: two nodes derive nnodes node rank endpoint and id", "[slurm]") {
  auto tasks = tasksOf("two_nodes");
  REQUIRE(tasks.size() == 2);
  for (int t = 0; t < 2; ++t) {
    auto d = derive(tasks[t]);
    INFO(joined(d.lines));
    CHECK(d.active);
    CHECK(d.nnodes == 2);
    CHECK(d.nodeRank == t);
    CHECK(d.rdzvBackend == "c10d");
    CHECK(d.rdzvEndpoint == "n1:" + std::to_string(jobPort(tasks[t])));
    CHECK(d.rdzvId == "slurm-" + tasks[t].at("SLURM_JOB_ID") + ".0");
    CHECK_FALSE(d.nprocPerNode);  // no GPUs requested: the launcher's own default
    CHECK(d.warnings.empty());
    CHECK(d.tasksOnThisNode == 1);
    const auto log = joined(d.lines);
    CHECK_THAT(log, Catch::Contains("derived --nnodes=2 from SLURM_NNODES=2"));
    CHECK_THAT(log, Catch::Contains("derived node rank " + std::to_string(t) + " from SLURM_NODEID=" + std::to_string(t)));
    CHECK_THAT(log, Catch::Contains("from the first host of SLURM_STEP_NODELIST=n[1-2]"));
    CHECK_THAT(log, Catch::Contains("SLURM_JOB_ID=" + tasks[t].at("SLURM_JOB_ID") + " (port 20000 + job id mod 12000)"));
  }
}

TEST_CASE("slurm: a step on a subset of the allocation uses the step's nodes and first host", "[slurm]") {
  auto tasks = tasksOf("subset_step");  // salloc -N3; srun -N2 -w n2,n3
  REQUIRE(tasks.size() == 2);
  REQUIRE(tasks[0].at("SLURM_JOB_NODELIST") == "n[1-3]");  // the trap: the allocation starts at n1
  for (int t = 0; t < 2; ++t) {
    auto d = derive(tasks[t]);
    CHECK(d.nnodes == 2);  // SLURM_NNODES is the step's; SLURM_JOB_NUM_NODES=3 is not used
    CHECK(d.nodeRank == t);
    CHECK(d.rdzvEndpoint == "n2:" + std::to_string(jobPort(tasks[t])));
  }
}

TEST_CASE("slurm: MASTER_PORT in the environment chooses the port", "[slurm]") {
  auto tasks = tasksOf("master_port");
  auto d = derive(tasks[1]);
  CHECK(d.rdzvEndpoint == "n1:29555");
  CHECK_THAT(joined(d.lines), Catch::Contains("from the first host of SLURM_STEP_NODELIST=n[1-2] and MASTER_PORT=29555"));
  auto bad = tasks[1];
  bad["MASTER_PORT"] = "99999";
  CHECK_THROWS_WITH(derive(bad), "MASTER_PORT='99999' is out of range (1..65535)");
}

TEST_CASE("slurm: the node's GPUs give the default nproc-per-node", "[slurm]") {
  auto tasks = tasksOf("gpus");  // srun --gpus-per-node=2
  auto d = derive(tasks[0]);
  CHECK(d.nprocPerNode == 2);
  CHECK_THAT(joined(d.lines), Catch::Contains("derived --nproc-per-node=2 from SLURM_GPUS_ON_NODE=2"));
  auto onlyVisible = tasks[0];
  onlyVisible.erase("SLURM_GPUS_ON_NODE");
  onlyVisible["CUDA_VISIBLE_DEVICES"] = "0,1,3";
  auto v = derive(onlyVisible);
  CHECK(v.nprocPerNode == 3);
  CHECK_THAT(joined(v.lines), Catch::Contains("from CUDA_VISIBLE_DEVICES=0,1,3"));
  UserChoices user;
  user.nprocPerNode = "1";
  CHECK_FALSE(derive(tasks[0], user).nprocPerNode);
  auto batchStep = tasksOf("batch_step");  // #SBATCH --gpus-per-node=1, srun inside
  CHECK(derive(batchStep[1]).nprocPerNode == 1);
}

TEST_CASE("slurm: two ctorchrun per node are warned about and get unique ranks", "[slurm]") {
  auto tasks = tasksOf("two_per_node");  // srun -N2 --ntasks-per-node=2
  REQUIRE(tasks.size() == 4);
  std::set<int> ranks;
  for (const auto& env : tasks) {
    auto d = derive(env);
    REQUIRE(d.warnings.size() == 1);
    CHECK_THAT(d.warnings[0], Catch::Contains("srun started 4 ctorchrun tasks on 2 node(s)") &&
                                  Catch::Contains("SLURM_STEP_TASKS_PER_NODE=2(x2)") &&
                                  Catch::Contains("--ntasks-per-node=1"));
    CHECK(d.nnodes == 4);
    CHECK(d.tasksOnThisNode == 2);
    CHECK(d.nodeRank == std::stoi(env.at("SLURM_PROCID")));
    ranks.insert(*d.nodeRank);
    CHECK_FALSE(d.nprocPerNode);
    CHECK_THAT(joined(d.lines), Catch::Contains("derived node rank") && Catch::Contains("from SLURM_PROCID="));
  }
  CHECK(ranks == std::set<int>{0, 1, 2, 3});
  // Control: one task per node gives no warning.
  CHECK(derive(tasksOf("two_nodes")[0]).warnings.empty());
}

TEST_CASE("slurm: uneven tasks per node are detected too", "[slurm]") {
  auto tasks = tasksOf("uneven_tasks");  // srun -N2 -n3: 2,1
  std::set<int> ranks;
  for (const auto& env : tasks) {
    auto d = derive(env);
    REQUIRE(d.warnings.size() == 1);
    CHECK_THAT(d.warnings[0], Catch::Contains("=2,1"));
    CHECK(d.nnodes == 3);
    ranks.insert(*d.nodeRank);
  }
  CHECK(ranks == std::set<int>{0, 1, 2});
}

TEST_CASE("slurm: a batch script outside srun derives nothing", "[slurm]") {
  auto env = loadEnv(dataDir() / "batch_script" / "batch.env");
  REQUIRE(env.count("SLURM_JOB_ID"));
  REQUIRE(env.count("SLURM_NODEID"));  // set in the batch script too: not enough on its own
  auto d = derive(env);
  CHECK_FALSE(d.active);
  CHECK_THAT(d.inactiveReason, Catch::Contains("SLURM_STEP_NODELIST"));
  CHECK(d.lines.empty());
  UserChoices on;
  on.mode = SlurmMode::On;
  CHECK_THROWS_WITH(derive(env, on), Catch::Contains("--slurm on") && Catch::Contains("run ctorchrun with srun"));
  CHECK_FALSE(derive(Env{}).active);
}

TEST_CASE("slurm: what the user gave is kept and only the rest is derived", "[slurm]") {
  auto env = tasksOf("two_nodes")[1];
  UserChoices user;
  user.nnodes = "1:4";
  user.nodeRank = 0;
  user.rdzvEndpoint = "head:1234";
  user.rdzvId = "mine";
  user.rdzvBackend = "c10d";
  auto d = derive(env, user);
  CHECK(d.active);
  CHECK_FALSE(d.nnodes);
  CHECK_FALSE(d.nodeRank);
  CHECK_FALSE(d.rdzvEndpoint);
  CHECK_FALSE(d.rdzvId);
  CHECK_FALSE(d.rdzvBackend);
  CHECK(d.warnings.empty());  // an elastic range is not a mismatch

  UserChoices fixed;
  fixed.nnodes = "3";
  CHECK_THAT(joined(derive(env, fixed).warnings),
             Catch::Contains("--nnodes 3 was given but this srun step runs 2 ctorchrun task(s)"));

  UserChoices staticUser;
  staticUser.rdzvBackend = "static";
  auto s = derive(env, staticUser);
  CHECK(s.masterAddr == "n1");
  CHECK(s.masterPort == jobPort(env));
  CHECK_FALSE(s.rdzvEndpoint);
  CHECK(s.nodeRank == 1);
  UserChoices masterGiven;
  masterGiven.masterPort = 4000;  // the two-terminal recipe's flags imply static
  auto m = derive(env, masterGiven);
  CHECK(m.masterAddr == "n1");
  CHECK_FALSE(m.masterPort);
  CHECK_FALSE(m.rdzvBackend);

  auto withMasterAddr = env;
  withMasterAddr["MASTER_ADDR"] = "n9";
  CHECK_THAT(joined(derive(withMasterAddr).lines), Catch::Contains("not using MASTER_ADDR=n9"));

  UserChoices off;
  off.mode = SlurmMode::Off;
  CHECK_FALSE(derive(env, off).active);
  UserChoices standalone;
  standalone.standalone = true;
  CHECK_FALSE(derive(env, standalone).active);
}

TEST_CASE("slurm: malformed variables fail with one line naming them", "[slurm]") {
  auto env = tasksOf("two_nodes")[0];
  auto with = [&](const std::string& k, const std::string& v) {
    auto e = env;
    e[k] = v;
    return e;
  };
  CHECK_THROWS_WITH(derive(with("SLURM_NNODES", "two")), "SLURM_NNODES='two' is not a whole number");
  CHECK_THROWS_WITH(derive(with("SLURM_NODEID", "2")), "SLURM_NODEID='2' is not below SLURM_NNODES=2");
  CHECK_THROWS_WITH(derive(with("SLURM_STEP_NODELIST", "n[1-")), Catch::StartsWith("SLURM_STEP_NODELIST: invalid Slurm hostlist 'n[1-'"));
  CHECK_THROWS_WITH(derive(with("SLURM_STEP_TASKS_PER_NODE", "2(y2)")), "SLURM_STEP_TASKS_PER_NODE='2(y2)' is not like 2(x3),1");
  CHECK_THROWS_AS(derive(with("SLURM_JOB_ID", "-1")), SlurmEnvError);
}

TEST_CASE("slurm: tasks-per-node expressions expand like Slurm's", "[slurm]") {
  CHECK(expandTasksPerNode("1(x2)") == std::vector<int>{1, 1});
  CHECK(expandTasksPerNode("2(x3),1") == std::vector<int>{2, 2, 2, 1});
  CHECK(expandTasksPerNode("4") == std::vector<int>{4});
  CHECK(expandTasksPerNode("2,1") == std::vector<int>{2, 1});
  CHECK_THROWS_AS(expandTasksPerNode("2(x)"), SlurmEnvError);
  CHECK_THROWS_AS(expandTasksPerNode(""), SlurmEnvError);
  CHECK_THROWS_AS(expandTasksPerNode("a"), SlurmEnvError);
}

TEST_CASE("slurm: --slurm takes auto on and off", "[slurm]") {
  CHECK(parseSlurmMode("auto") == SlurmMode::Auto);
  CHECK(parseSlurmMode("OFF") == SlurmMode::Off);
  CHECK(parseSlurmMode("on") == SlurmMode::On);
  CHECK_THROWS_WITH(parseSlurmMode("maybe"), "--slurm 'maybe' is not one of auto, on, off");
}

TEST_CASE("slurm: every captured step agrees on one endpoint and id with distinct ranks", "[slurm]") {
  for (const auto& entry : fs::directory_iterator(dataDir())) {
    if (!entry.is_directory() || entry.path().filename() == "batch_script") continue;
    const std::string name = entry.path().filename().string();
    INFO("case " << name);
    auto tasks = tasksOf(name);
    std::set<std::string> endpoints, ids;
    std::set<int> ranks;
    for (const auto& env : tasks) {
      auto d = derive(env);
      REQUIRE(d.active);
      endpoints.insert(*d.rdzvEndpoint);
      ids.insert(*d.rdzvId);
      ranks.insert(*d.nodeRank);
      CHECK(*d.nnodes == static_cast<int>(tasks.size()));
    }
    CHECK(endpoints.size() == 1);
    CHECK(ids.size() == 1);
    CHECK(ranks.size() == tasks.size());
    CHECK(*ranks.rbegin() == static_cast<int>(tasks.size()) - 1);
  }
}

// ---- live, on the lab's Slurm cluster -----------------------------------------------------------------
CTORCH_TEST_WORKER(slurm_derive) {
  auto d = deriveFromSlurm({}, processEnv());
  std::printf("active=%d nnodes=%d rank=%d endpoint=%s id=%s\n", d.active ? 1 : 0, d.nnodes.value_or(-1),
              d.nodeRank.value_or(-1), d.rdzvEndpoint.value_or("").c_str(), d.rdzvId.value_or("").c_str());
  return 0;
}

TEST_CASE("slurm: live srun steps derive the step's head node and distinct ranks", "[slurm][lab]") {
  CTORCH_REQUIRE_SLURM();
  ctorch::test::lab::SlurmLab slurm({.nodes = 3});
  const std::string self = ctorch::test::selfExe().string();
  auto all = slurm.run({"srun", "-N3", "-l", self, "--ctorch-worker", "slurm_derive"});
  INFO(all.output);
  REQUIRE(all.ok());
  auto subset = slurm.run({"salloc", "-N3", "srun", "-N2", "-w", "n2,n3", "-l", self, "--ctorch-worker", "slurm_derive"});
  INFO(subset.output);
  REQUIRE(subset.ok());
  const std::regex line(R"((\d+): active=1 nnodes=(\d+) rank=(\d+) endpoint=(n\d):\d+ id=slurm-\d+\.0)");
  auto parse = [&](const std::string& out) {
    std::map<int, std::pair<int, std::string>> byTask;  // task → (rank, head)
    std::istringstream in(out);
    std::string l;
    std::smatch m;
    while (std::getline(in, l))
      if (std::regex_search(l, m, line)) byTask[std::stoi(m[1])] = {std::stoi(m[3]), m[4]};
    return byTask;
  };
  auto a = parse(all.output);
  REQUIRE(a.size() == 3);
  for (auto& [task, rh] : a) {
    CHECK(rh.first == task);
    CHECK(rh.second == "n1");
  }
  auto s = parse(subset.output);
  REQUIRE(s.size() == 2);
  for (auto& [task, rh] : s) {
    CHECK(rh.first == task);
    CHECK(rh.second == "n2");
  }
}
