#include "ctorch/distributed_env.hpp"

#include "ctorch/errors.hpp"

#include <ctorch/contract/hostlist.hpp>
#include <ctorch/contract/worker_contract.hpp>

#include <cctype>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <vector>

namespace ctorch {

namespace env = contract::env;

namespace {

// A variable's name and value, kept together so every message can quote both.
struct Var {
  const char* name;
  std::optional<std::string> value;

  bool set() const { return value.has_value(); }
  std::string quoted() const { return std::string(name) + "='" + value.value_or("") + "'"; }
};

Var read(const EnvLookup& lookup, const char* name) {
  auto v = lookup(name);
  if (v && v->empty()) v.reset();
  return {name, std::move(v)};
}

// Strict decimal integer: digits only (leading '+'/'-' and blanks refused), no overflow.
std::int64_t parseInteger(const Var& var, std::int64_t min, std::int64_t max, const char* what) {
  const std::string& s = *var.value;
  bool digits = !s.empty() && s.size() <= 18;
  for (char c : s) digits = digits && std::isdigit(static_cast<unsigned char>(c));
  if (!digits) throw ConfigError(var.quoted() + " is not " + what);
  std::int64_t v = std::strtoll(s.c_str(), nullptr, 10);
  if (v < min || v > max) throw ConfigError(var.quoted() + " is not " + what);
  return v;
}

int parseCount(const Var& var) {  // a size: 1 ..
  return static_cast<int>(parseInteger(var, 1, std::numeric_limits<int>::max(), "a positive integer"));
}

int parseIndex(const Var& var) {  // a rank: 0 ..
  return static_cast<int>(
      parseInteger(var, 0, std::numeric_limits<int>::max(), "a non-negative integer"));
}

int parsePort(const Var& var) {
  return static_cast<int>(parseInteger(var, 1, 65535, "a TCP port number (1-65535)"));
}

void requireBelow(const Var& index, int value, const Var& bound, int boundValue) {
  if (value >= boundValue)
    throw ConfigError(index.quoted() + " is out of range for " + bound.quoted() + " (must be 0.." +
                      std::to_string(boundValue - 1) + ")");
}

// TORCHELASTIC_USE_AGENT_STORE: Python compares with str(True); we also accept the contract's other
// truthy spellings, and refuse values that are neither clearly true nor clearly false.
bool parseFlag(const Var& var) {
  if (!var.set()) return false;
  if (contract::isTruthy(*var.value)) return true;
  const std::string& v = *var.value;
  if (v == "False" || v == "false" || v == "FALSE" || v == "0" || v == "no") return false;
  throw ConfigError(var.quoted() + " is neither True nor False");
}

// SLURM_TASKS_PER_NODE ("2(x3),1": three nodes with 2 tasks, then one with 1) at node `nodeId`.
std::optional<int> tasksOnNode(const Var& var, int nodeId) {
  std::vector<int> perNode;
  std::stringstream in(*var.value);
  std::string item;
  while (std::getline(in, item, ',')) {
    int count = 0, repeat = 1;
    char open = 0, x = 0, close = 0;
    std::istringstream one(item);
    one >> count;
    if (!one || count <= 0) throw ConfigError(var.quoted() + " is not a Slurm task count list");
    if (one >> open) {
      if (!(open == '(' && one >> x >> repeat >> close && x == 'x' && close == ')' && repeat > 0))
        throw ConfigError(var.quoted() + " is not a Slurm task count list");
    }
    for (int i = 0; i < repeat && perNode.size() < 1000000; ++i) perNode.push_back(count);
  }
  if (nodeId < 0 || nodeId >= static_cast<int>(perNode.size())) return std::nullopt;
  return perNode[nodeId];
}

DistributedEnv fromTorchrun(const EnvLookup& lookup) {
  DistributedEnv e;
  e.launcher = Launcher::kTorchrun;
  const Var rank = read(lookup, env::kRank), world = read(lookup, env::kWorldSize);
  if (!rank.set())
    throw ConfigError(world.quoted() + " is set but RANK is not (set both, or neither for a world of 1)");
  if (!world.set())
    throw ConfigError(rank.quoted() + " is set but WORLD_SIZE is not (set both, or neither for a world of 1)");
  e.rank = parseIndex(rank);
  e.worldSize = parseCount(world);
  requireBelow(rank, e.rank, world, e.worldSize);
  e.rankFrom = env::kRank;
  e.worldSizeFrom = env::kWorldSize;

  const Var localRank = read(lookup, env::kLocalRank), localWorld = read(lookup, env::kLocalWorldSize);
  if (localWorld.set()) {
    e.localWorldSize = parseCount(localWorld);
    e.localWorldSizeFrom = env::kLocalWorldSize;
    if (e.localWorldSize > e.worldSize)
      throw ConfigError(localWorld.quoted() + " is larger than " + world.quoted());
  } else {
    e.localWorldSize = e.worldSize;
    e.localWorldSizeFrom = "default (WORLD_SIZE: one node)";
  }
  if (localRank.set()) {
    e.localRank = parseIndex(localRank);
    e.localRankFrom = env::kLocalRank;
    if (localWorld.set()) requireBelow(localRank, e.localRank, localWorld, e.localWorldSize);
    else requireBelow(localRank, e.localRank, world, e.worldSize);
  } else {
    e.localRank = e.rank;
    e.localRankFrom = "default (RANK: one node)";
  }

  const Var addr = read(lookup, env::kMasterAddr), port = read(lookup, env::kMasterPort);
  const Var agent = read(lookup, env::kUseAgentStore);
  e.useAgentStore = parseFlag(agent);
  if (e.worldSize == 1 && !addr.set() && !port.set() && !e.useAgentStore) {
    return e;  // RANK=0 WORLD_SIZE=1 by hand: a world of 1, no store needed
  }
  if (!addr.set())
    throw ConfigError("MASTER_ADDR is not set (needed with " + world.quoted() + " to reach the store)");
  if (!port.set())
    throw ConfigError("MASTER_PORT is not set (needed with " + world.quoted() + " to reach the store)");
  e.masterAddr = *addr.value;
  e.masterAddrFrom = env::kMasterAddr;
  e.masterPort = parsePort(port);
  e.masterPortFrom = env::kMasterPort;

  if (e.useAgentStore) {
    const Var restarts = read(lookup, env::kRestartCount);
    if (!restarts.set())
      throw ConfigError(agent.quoted() + " but TORCHELASTIC_RESTART_COUNT is not set (the agent store "
                        "key prefix needs it)");
    e.restartCount = parseInteger(restarts, 0, std::numeric_limits<int>::max(), "a non-negative integer");
  } else if (const Var restarts = read(lookup, env::kRestartCount); restarts.set()) {
    e.restartCount = parseInteger(restarts, 0, std::numeric_limits<int>::max(), "a non-negative integer");
  }
  return e;
}

DistributedEnv fromSlurm(const EnvLookup& lookup) {
  DistributedEnv e;
  e.launcher = Launcher::kSlurm;
  const Var procId = read(lookup, env::kSlurmProcId), nTasks = read(lookup, env::kSlurmNTasks);
  if (!nTasks.set())
    throw ConfigError(procId.quoted() + " is set but SLURM_NTASKS is not (start the job with srun -n N)");
  e.rank = parseIndex(procId);
  e.worldSize = parseCount(nTasks);
  requireBelow(procId, e.rank, nTasks, e.worldSize);
  e.rankFrom = env::kSlurmProcId;
  e.worldSizeFrom = env::kSlurmNTasks;

  const Var localId = read(lookup, env::kSlurmLocalId);
  const Var perNode = read(lookup, env::kSlurmTasksPerNode), nodeId = read(lookup, env::kSlurmNodeId);
  e.localWorldSize = e.worldSize;
  e.localWorldSizeFrom = "default (SLURM_NTASKS: one node)";
  if (perNode.set() && nodeId.set()) {
    if (auto n = tasksOnNode(perNode, parseIndex(nodeId))) {
      e.localWorldSize = *n;
      e.localWorldSizeFrom = std::string(env::kSlurmTasksPerNode) + " at " + nodeId.quoted();
    } else {
      throw ConfigError(nodeId.quoted() + " is out of range for " + perNode.quoted());
    }
  }
  if (localId.set()) {
    e.localRank = parseIndex(localId);
    e.localRankFrom = env::kSlurmLocalId;
    if (e.localRank >= e.localWorldSize)
      throw ConfigError(localId.quoted() + " is out of range for " + e.localWorldSizeFrom + " (" +
                        std::to_string(e.localWorldSize) + " tasks on this node)");
  } else {
    e.localRank = e.rank;
    e.localRankFrom = "default (SLURM_PROCID: one node)";
  }

  if (const Var addr = read(lookup, env::kMasterAddr); addr.set()) {
    e.masterAddr = *addr.value;
    e.masterAddrFrom = env::kMasterAddr;
  } else {
    Var nodes = read(lookup, env::kSlurmStepNodeList);
    if (!nodes.set()) nodes = read(lookup, env::kSlurmJobNodeList);
    if (!nodes.set())
      throw ConfigError("neither MASTER_ADDR nor SLURM_STEP_NODELIST is set: cannot tell the host of rank 0");
    try {
      e.masterAddr = contract::firstHost(*nodes.value);
    } catch (const std::invalid_argument& ex) {
      throw ConfigError(nodes.quoted() + " is not a Slurm hostlist: " + ex.what());
    }
    e.masterAddrFrom = "first host of " + nodes.quoted();
  }

  if (const Var port = read(lookup, env::kMasterPort); port.set()) {
    e.masterPort = parsePort(port);
    e.masterPortFrom = env::kMasterPort;
  } else {
    const Var jobId = read(lookup, env::kSlurmJobId);
    if (!jobId.set())
      throw ConfigError("neither MASTER_PORT nor SLURM_JOB_ID is set: cannot choose the store port");
    const auto id = parseInteger(jobId, 0, std::numeric_limits<std::int64_t>::max() / 2, "a job id");
    e.masterPort = contract::slurmDerivedPort(static_cast<std::uint64_t>(id));
    e.masterPortFrom = "derived from " + jobId.quoted();
  }
  return e;
}

} // namespace

EnvLookup processEnvironment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
}

const char* toString(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "no launcher";
    case Launcher::kTorchrun: return "torchrun environment";
    case Launcher::kSlurm: return "srun";
  }
  return "?";
}

std::string DistributedEnv::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << worldSize << " (local " << localRank << "/" << localWorldSize
     << ") from " << toString(launcher);
  if (!needsStore()) {
    os << ", no store";
  } else if (useAgentStore) {
    os << ", agent store " << masterAddr << ":" << masterPort << " (restart " << restartCount << ")";
  } else {
    os << ", store " << masterAddr << ":" << masterPort << " hosted by rank 0";
  }
  return os.str();
}

DistributedEnv detectDistributedEnv(const EnvLookup& lookup) {
  auto isSet = [&](const char* name) {
    auto v = lookup(name);
    return v && !v->empty();
  };
  DistributedEnv e;
  if (isSet(env::kRank) || isSet(env::kWorldSize)) e = fromTorchrun(lookup);
  else if (isSet(env::kSlurmProcId)) e = fromSlurm(lookup);
  if (const Var libuv = read(lookup, "USE_LIBUV"); libuv.set()) e.useLibUV = *libuv.value == "1";
  return e;
}

} // namespace ctorch
