#include "ctorch/slurm/derive.hpp"

#include <ctorch/contract/hostlist.hpp>
#include <ctorch/contract/worker_contract.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <numeric>

namespace ctorch::slurm {

namespace env = ctorch::contract::env;

EnvLookup processEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

EnvLookup mapEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

SlurmMode parseSlurmMode(const std::string& text) {
  std::string v;
  for (char c : text) v.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (v == "auto") return SlurmMode::Auto;
  if (v == "on" || v == "true" || v == "1" || v == "yes") return SlurmMode::On;
  if (v == "off" || v == "false" || v == "0" || v == "no") return SlurmMode::Off;
  throw std::invalid_argument("--slurm '" + text + "' is not one of auto, on, off");
}

namespace {

[[noreturn]] void bad(const std::string& name, const std::string& value, const std::string& why) {
  throw SlurmEnvError(name + "='" + value + "' " + why);
}

long long parseNumber(const std::string& name, const std::string& value, long long min, long long max) {
  bool digits = !value.empty() && value.size() <= 18;
  for (char c : value) digits = digits && std::isdigit(static_cast<unsigned char>(c));
  if (!digits) bad(name, value, "is not a whole number");
  long long v = std::stoll(value);
  if (v < min || v > max)
    bad(name, value, "is out of range (" + std::to_string(min) + ".." + std::to_string(max) + ")");
  return v;
}

std::optional<std::string> nonEmpty(const EnvLookup& env, const std::string& name) {
  auto v = env(name);
  if (v && v->empty()) return std::nullopt;
  return v;
}

std::string tasksText(const std::vector<int>& counts) {
  // Back to Slurm's compressed form for messages: {2,2,1} → "2(x2),1".
  std::string out;
  for (std::size_t i = 0; i < counts.size();) {
    std::size_t j = i;
    while (j < counts.size() && counts[j] == counts[i]) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(counts[i]);
    if (j - i > 1) out += "(x" + std::to_string(j - i) + ")";
    i = j;
  }
  return out;
}

} // namespace

std::vector<int> expandTasksPerNode(const std::string& text) {
  const std::string name = "SLURM_TASKS_PER_NODE";
  std::vector<int> out;
  if (text.empty()) bad(name, text, "is empty");
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? text.size() + 1 : comma + 1;
    long long count = 0, repeat = 1;
    auto paren = item.find('(');
    if (paren == std::string::npos) {
      count = parseNumber(name, item, 0, 1000000);
    } else {
      if (item.size() < paren + 4 || item.compare(paren, 2, "(x") != 0 || item.back() != ')')
        bad(name, text, "is not like 2(x3),1");
      count = parseNumber(name, item.substr(0, paren), 0, 1000000);
      repeat = parseNumber(name, item.substr(paren + 2, item.size() - paren - 3), 1, 1000000);
    }
    for (long long i = 0; i < repeat; ++i) out.push_back(static_cast<int>(count));
  }
  return out;
}

Derivation deriveFromSlurm(const UserChoices& user, const EnvLookup& env) {
  Derivation d;
  if (user.mode == SlurmMode::Off) {
    d.inactiveReason = "--slurm off";
    return d;
  }
  if (user.standalone) {
    if (user.mode == SlurmMode::On) throw std::invalid_argument("--slurm on cannot be combined with --standalone");
    d.inactiveReason = "--standalone";
    return d;
  }
  std::vector<std::string> missing;
  for (const char* name : {env::kSlurmJobId, env::kSlurmNodeId, env::kSlurmNNodes, env::kSlurmStepNodeList})
    if (!nonEmpty(env, name)) missing.push_back(name);
  if (!missing.empty()) {
    std::string names;
    for (const auto& m : missing) names += (names.empty() ? "" : ", ") + m;
    d.inactiveReason = "not inside an srun step (" + names + " not set)";
    if (user.mode == SlurmMode::On)
      throw std::invalid_argument("--slurm on, but this is not an srun step (" + names +
                                  " not set): run ctorchrun with srun");
    return d;
  }
  d.active = true;

  const std::string jobIdText = *env(env::kSlurmJobId);
  const auto jobId = static_cast<std::uint64_t>(parseNumber(env::kSlurmJobId, jobIdText, 0, (1LL << 62)));
  const std::string nnodesText = *env(env::kSlurmNNodes);
  const int nnodes = static_cast<int>(parseNumber(env::kSlurmNNodes, nnodesText, 1, 1000000));
  const std::string nodeIdText = *env(env::kSlurmNodeId);
  const int nodeId = static_cast<int>(parseNumber(env::kSlurmNodeId, nodeIdText, 0, 1000000));
  if (nodeId >= nnodes) bad(env::kSlurmNodeId, nodeIdText, "is not below SLURM_NNODES=" + nnodesText);
  const std::string nodelist = *env(env::kSlurmStepNodeList);
  std::vector<std::string> hosts;
  try {
    hosts = contract::expandHostlist(nodelist);
  } catch (const std::invalid_argument& e) {
    throw SlurmEnvError(std::string(env::kSlurmStepNodeList) + ": " + e.what());
  }
  if (hosts.empty()) bad(env::kSlurmStepNodeList, nodelist, "names no host");
  if (static_cast<int>(hosts.size()) != nnodes)
    d.warnings.push_back(std::string(env::kSlurmStepNodeList) + "=" + nodelist + " names " +
                         std::to_string(hosts.size()) + " host(s) but SLURM_NNODES=" + nnodesText);

  // ---- how many ctorchrun tasks per node --------------------------------------------------------
  std::optional<int> ntasks;
  if (auto v = nonEmpty(env, env::kSlurmNTasks))
    ntasks = static_cast<int>(parseNumber(env::kSlurmNTasks, *v, 1, 100000000));
  std::vector<int> perNode;
  std::string perNodeName = "SLURM_STEP_TASKS_PER_NODE";
  auto perNodeText = nonEmpty(env, perNodeName);
  if (!perNodeText) {
    perNodeName = env::kSlurmTasksPerNode;
    perNodeText = nonEmpty(env, perNodeName);
  }
  if (perNodeText) {
    try {
      perNode = expandTasksPerNode(*perNodeText);
    } catch (const SlurmEnvError&) {
      bad(perNodeName, *perNodeText, "is not like 2(x3),1");
    }
  }
  if (nodeId < static_cast<int>(perNode.size())) d.tasksOnThisNode = perNode[nodeId];
  const bool manyPerNode = (ntasks && *ntasks > nnodes) ||
                           std::any_of(perNode.begin(), perNode.end(), [](int n) { return n > 1; });
  int nodes = nnodes, rank = nodeId;
  std::string nodesFrom = std::string(env::kSlurmNNodes) + "=" + nnodesText + " (this step's nodes)";
  std::string rankFrom = std::string(env::kSlurmNodeId) + "=" + nodeIdText;
  if (manyPerNode) {
    int total = ntasks ? *ntasks : std::accumulate(perNode.begin(), perNode.end(), 0);
    auto procId = nonEmpty(env, env::kSlurmProcId);
    if (!procId)
      throw SlurmEnvError("srun started several tasks per node but SLURM_PROCID is not set");
    int proc = static_cast<int>(parseNumber(env::kSlurmProcId, *procId, 0, 100000000));
    if (proc >= total) bad(env::kSlurmProcId, *procId, "is not below the number of tasks (" + std::to_string(total) + ")");
    std::string counts;
    if (ntasks) counts += "SLURM_NTASKS=" + std::to_string(*ntasks);
    if (perNodeText) counts += std::string(ntasks ? ", " : "") + perNodeName + "=" + tasksText(perNode);
    const std::string layout =
        std::to_string(total) + " ctorchrun tasks on " + std::to_string(nnodes) + " node(s) (" + counts + ")";
    d.warnings.push_back("srun started " + layout +
                         ": every task is a separate ctorchrun starting its own workers. For one ctorchrun per "
                         "node use `srun --ntasks-per-node=1 ctorchrun ...` (or #SBATCH --ntasks-per-node=1) "
                         "and set the workers per node with --nproc-per-node. Continuing with each task as its "
                         "own node: --nnodes=" + std::to_string(total) + ", node rank from SLURM_PROCID");
    nodes = total;
    rank = proc;
    nodesFrom = "the number of srun tasks (" + counts + ")";
    rankFrom = std::string(env::kSlurmProcId) + "=" + *procId;
  }

  // ---- nnodes and node rank ---------------------------------------------------------------------------
  if (!user.nnodes) {
    d.nnodes = nodes;
    d.lines.push_back("derived --nnodes=" + std::to_string(nodes) + " from " + nodesFrom);
  } else if (user.nnodes->find(':') == std::string::npos && *user.nnodes != std::to_string(nodes)) {
    d.warnings.push_back("--nnodes " + *user.nnodes + " was given but this srun step runs " + std::to_string(nodes) +
                         " ctorchrun task(s) (" + nodesFrom + ")");
  }
  if (!user.nodeRank) {
    d.nodeRank = rank;
    d.lines.push_back("derived node rank " + std::to_string(rank) + " from " + rankFrom);
  }

  // ---- rendezvous: backend, endpoint / master address, id ---------------------------------------------
  const bool isStatic = user.rdzvBackend ? *user.rdzvBackend == "static"
                                         : (user.masterAddr.has_value() || user.masterPort.has_value());
  if (!user.rdzvBackend && !isStatic) {
    d.rdzvBackend = "c10d";
    d.lines.push_back("using --rdzv-backend=c10d under srun");
  }
  const std::string& head = hosts.front();
  int port = 0;
  std::string portFrom;
  if (auto mp = nonEmpty(env, env::kMasterPort)) {
    port = static_cast<int>(parseNumber(env::kMasterPort, *mp, 1, 65535));
    portFrom = "MASTER_PORT=" + *mp;
  } else {
    port = contract::slurmDerivedPort(jobId);
    portFrom = "SLURM_JOB_ID=" + jobIdText + " (port " + std::to_string(contract::kSlurmPortBase) +
               " + job id mod " + std::to_string(contract::kSlurmPortSpan) + ")";
  }
  const std::string hostFrom = "the first host of " + std::string(env::kSlurmStepNodeList) + "=" + nodelist;
  bool derivedHost = false;
  if (isStatic) {
    if (!user.masterAddr) {
      d.masterAddr = head;
      derivedHost = true;
      d.lines.push_back("derived --master-addr=" + head + " from " + hostFrom);
    }
    if (!user.masterPort) {
      d.masterPort = port;
      d.lines.push_back("derived --master-port=" + std::to_string(port) + " from " + portFrom);
    }
  } else if (!user.rdzvEndpoint) {
    d.rdzvEndpoint = head + ":" + std::to_string(port);
    derivedHost = true;
    d.lines.push_back("derived --rdzv-endpoint=" + *d.rdzvEndpoint + " from " + hostFrom + " and " + portFrom);
  }
  if (derivedHost) {
    if (auto ma = nonEmpty(env, env::kMasterAddr); ma && *ma != head)
      d.lines.push_back("not using MASTER_ADDR=" + *ma + " from the environment: the rendezvous host is the first "
                        "node of this step (pass --rdzv-endpoint or --master-addr to choose another)");
  }
  if (!user.rdzvId) {
    auto step = nonEmpty(env, env::kSlurmStepId);
    if (!step) step = nonEmpty(env, "SLURM_STEPID");
    std::string id = "slurm-" + jobIdText + (step ? "." + *step : "");
    d.rdzvId = id;
    d.lines.push_back("derived --rdzv-id=" + id + " from SLURM_JOB_ID=" + jobIdText +
                      (step ? " and SLURM_STEP_ID=" + *step : ""));
  }

  // ---- workers per node --------------------------------------------------------------------------------
  if (!user.nprocPerNode) {
    if (d.tasksOnThisNode > 1 || manyPerNode) {
      d.lines.push_back("not deriving --nproc-per-node from the node's GPUs: several ctorchrun share this node");
    } else if (auto g = nonEmpty(env, "SLURM_GPUS_ON_NODE")) {
      int gpus = static_cast<int>(parseNumber("SLURM_GPUS_ON_NODE", *g, 0, 100000));
      if (gpus > 0) {
        d.nprocPerNode = gpus;
        d.lines.push_back("derived --nproc-per-node=" + std::to_string(gpus) + " from SLURM_GPUS_ON_NODE=" + *g);
      }
    } else if (auto cvd = nonEmpty(env, "CUDA_VISIBLE_DEVICES"); cvd && *cvd != "NoDevFiles") {
      int count = 1 + static_cast<int>(std::count(cvd->begin(), cvd->end(), ','));
      d.nprocPerNode = count;
      d.lines.push_back("derived --nproc-per-node=" + std::to_string(count) + " from CUDA_VISIBLE_DEVICES=" + *cvd);
    }
  }
  return d;
}

} // namespace ctorch::slurm
