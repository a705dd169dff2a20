#include "ctorch/slurm/derive.hpp"

#include <ctorch/contract/hostlist.hpp>
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/text/text.hpp>

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
  const std::string v = text::toLower(text);
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

namespace {

// What this srun step says about itself: the job, its nodes and this node's place among them.
struct Step {
  std::string jobIdText;
  std::uint64_t jobId = 0;
  std::string nnodesText;
  int nnodes = 0;
  std::string nodeIdText;
  int nodeId = 0;
  std::string nodelist;
  std::vector<std::string> hosts;
};

// How many ctorchrun tasks this step runs, and which one this is: a node each, or (several per
// node) every task as its own node.
struct Layout {
  bool manyPerNode = false;
  int nodes = 0;
  int rank = 0;
  std::string nodesFrom;  // where `nodes` came from, for the derivation's lines
  std::string rankFrom;
};

// Whether ctorchrun runs inside an srun step and may derive from it; sets d.inactiveReason when
// not (or throws when --slurm on asks for what cannot be).
bool insideStep(const UserChoices& user, const EnvLookup& env, Derivation& d) {
  if (user.mode == SlurmMode::Off) {
    d.inactiveReason = "--slurm off";
    return false;
  }
  if (user.standalone) {
    if (user.mode == SlurmMode::On) throw std::invalid_argument("--slurm on cannot be combined with --standalone");
    d.inactiveReason = "--standalone";
    return false;
  }
  std::vector<std::string> missing;
  for (const char* name : {env::kSlurmJobId, env::kSlurmNodeId, env::kSlurmNNodes, env::kSlurmStepNodeList})
    if (!nonEmpty(env, name)) missing.push_back(name);
  if (missing.empty()) return true;
  const std::string names = text::join(missing, ", ");
  d.inactiveReason = "not inside an srun step (" + names + " not set)";
  if (user.mode == SlurmMode::On)
    throw std::invalid_argument("--slurm on, but this is not an srun step (" + names +
                                " not set): run ctorchrun with srun");
  return false;
}

Step readStep(const EnvLookup& env, Derivation& d) {
  Step s;
  s.jobIdText = *env(env::kSlurmJobId);
  s.jobId = static_cast<std::uint64_t>(parseNumber(env::kSlurmJobId, s.jobIdText, 0, (1LL << 62)));
  s.nnodesText = *env(env::kSlurmNNodes);
  s.nnodes = static_cast<int>(parseNumber(env::kSlurmNNodes, s.nnodesText, 1, 1000000));
  s.nodeIdText = *env(env::kSlurmNodeId);
  s.nodeId = static_cast<int>(parseNumber(env::kSlurmNodeId, s.nodeIdText, 0, 1000000));
  if (s.nodeId >= s.nnodes) bad(env::kSlurmNodeId, s.nodeIdText, "is not below SLURM_NNODES=" + s.nnodesText);
  s.nodelist = *env(env::kSlurmStepNodeList);
  try {
    s.hosts = contract::expandHostlist(s.nodelist);
  } catch (const std::invalid_argument& e) {
    throw SlurmEnvError(std::string(env::kSlurmStepNodeList) + ": " + e.what());
  }
  if (s.hosts.empty()) bad(env::kSlurmStepNodeList, s.nodelist, "names no host");
  if (static_cast<int>(s.hosts.size()) != s.nnodes)
    d.warnings.push_back(std::string(env::kSlurmStepNodeList) + "=" + s.nodelist + " names " +
                         std::to_string(s.hosts.size()) + " host(s) but SLURM_NNODES=" + s.nnodesText);
  return s;
}

Layout taskLayout(const EnvLookup& env, const Step& step, Derivation& d) {
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
  if (step.nodeId < static_cast<int>(perNode.size())) d.tasksOnThisNode = perNode[step.nodeId];
  Layout l;
  l.manyPerNode = (ntasks && *ntasks > step.nnodes) ||
                  std::any_of(perNode.begin(), perNode.end(), [](int n) { return n > 1; });
  l.nodes = step.nnodes;
  l.rank = step.nodeId;
  l.nodesFrom = std::string(env::kSlurmNNodes) + "=" + step.nnodesText + " (this step's nodes)";
  l.rankFrom = std::string(env::kSlurmNodeId) + "=" + step.nodeIdText;
  if (!l.manyPerNode) return l;
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
      std::to_string(total) + " ctorchrun tasks on " + std::to_string(step.nnodes) + " node(s) (" + counts + ")";
  d.warnings.push_back("srun started " + layout +
                       ": every task is a separate ctorchrun starting its own workers. For one ctorchrun per "
                       "node use `srun --ntasks-per-node=1 ctorchrun ...` (or #SBATCH --ntasks-per-node=1) "
                       "and set the workers per node with --nproc-per-node. Continuing with each task as its "
                       "own node: --nnodes=" + std::to_string(total) + ", node rank from SLURM_PROCID");
  l.nodes = total;
  l.rank = proc;
  l.nodesFrom = "the number of srun tasks (" + counts + ")";
  l.rankFrom = std::string(env::kSlurmProcId) + "=" + *procId;
  return l;
}

void deriveNodes(const UserChoices& user, const Layout& layout, Derivation& d) {
  if (!user.nnodes) {
    d.nnodes = layout.nodes;
    d.lines.push_back("derived --nnodes=" + std::to_string(layout.nodes) + " from " + layout.nodesFrom);
  } else if (user.nnodes->find(':') == std::string::npos && *user.nnodes != std::to_string(layout.nodes)) {
    d.warnings.push_back("--nnodes " + *user.nnodes + " was given but this srun step runs " +
                         std::to_string(layout.nodes) + " ctorchrun task(s) (" + layout.nodesFrom + ")");
  }
  if (!user.nodeRank) {
    d.nodeRank = layout.rank;
    d.lines.push_back("derived node rank " + std::to_string(layout.rank) + " from " + layout.rankFrom);
  }
}

// Backend, endpoint (or static master address and port) and rendezvous id.
void deriveRendezvous(const UserChoices& user, const EnvLookup& env, const Step& step, Derivation& d) {
  const bool isStatic = user.rdzvBackend ? *user.rdzvBackend == "static"
                                         : (user.masterAddr.has_value() || user.masterPort.has_value());
  if (!user.rdzvBackend && !isStatic) {
    d.rdzvBackend = "c10d";
    d.lines.push_back("using --rdzv-backend=c10d under srun");
  }
  const std::string& head = step.hosts.front();
  int port = 0;
  std::string portFrom;
  if (auto mp = nonEmpty(env, env::kMasterPort)) {
    port = static_cast<int>(parseNumber(env::kMasterPort, *mp, 1, 65535));
    portFrom = "MASTER_PORT=" + *mp;
  } else {
    port = contract::slurmDerivedPort(step.jobId);
    portFrom = "SLURM_JOB_ID=" + step.jobIdText + " (port " + std::to_string(contract::kSlurmPortBase) +
               " + job id mod " + std::to_string(contract::kSlurmPortSpan) + ")";
  }
  const std::string hostFrom = "the first host of " + std::string(env::kSlurmStepNodeList) + "=" + step.nodelist;
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
    auto stepId = nonEmpty(env, env::kSlurmStepId);
    if (!stepId) stepId = nonEmpty(env, "SLURM_STEPID");
    std::string id = "slurm-" + step.jobIdText + (stepId ? "." + *stepId : "");
    d.rdzvId = id;
    d.lines.push_back("derived --rdzv-id=" + id + " from SLURM_JOB_ID=" + step.jobIdText +
                      (stepId ? " and SLURM_STEP_ID=" + *stepId : ""));
  }
}

void deriveWorkersPerNode(const UserChoices& user, const EnvLookup& env, const Layout& layout, Derivation& d) {
  if (user.nprocPerNode) return;
  if (d.tasksOnThisNode > 1 || layout.manyPerNode) {
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

} // namespace

Derivation deriveFromSlurm(const UserChoices& user, const EnvLookup& env) {
  Derivation d;
  if (!insideStep(user, env, d)) return d;
  d.active = true;
  const Step step = readStep(env, d);
  const Layout layout = taskLayout(env, step, d);
  deriveNodes(user, layout, d);
  deriveRendezvous(user, env, step, d);
  deriveWorkersPerNode(user, env, layout, d);
  return d;
}

} // namespace ctorch::slurm
