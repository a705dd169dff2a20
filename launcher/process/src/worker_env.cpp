#include "ctorch/launcher/worker_env.hpp"

#include "ctorch/contract/control_auth.hpp"
#include "ctorch/contract/worker_contract.hpp"

extern char** environ;

namespace ctorch::launcher {

namespace env = contract::env;

namespace {

// The pre-2.x name LibTorch 1.13's ProcessGroupNCCL reads; 2.x reads the TORCH_ one first.
constexpr const char* kLegacyNcclAsyncErrorHandling = "NCCL_ASYNC_ERROR_HANDLING";

std::string keyOf(const std::string& entry) { return entry.substr(0, entry.find('=')); }

// ctorchrun's own variables (set by it or not at all) and the job secret (the workers get the key
// derived from it): never passed on from ctorchrun's own environment.
bool launcherOwned(const std::string& key) {
  if (key == contract::auth::kJobSecretEnv) return true;
  for (const char* name : contract::kLauncherOwnedVariables)
    if (key == name) return true;
  return false;
}

bool hasKey(const std::vector<std::string>& base, const std::string& key) {
  for (const auto& e : base)
    if (keyOf(e) == key) return true;
  return false;
}

} // namespace

std::map<std::string, std::string> contractVariables(const LaunchConfig& c, const RendezvousInfo& info,
                                                     int localRank, int restartCount,
                                                     const std::string& errorFile) {
  const int rank = info.globalRank(localRank);
  std::map<std::string, std::string> vars{
      {env::kRank, std::to_string(rank)},
      {env::kLocalRank, std::to_string(localRank)},
      {env::kGroupRank, std::to_string(info.nodeRank)},
      {env::kRoleRank, std::to_string(rank)},
      {env::kRoleName, c.role},
      {env::kLocalWorldSize, std::to_string(info.localNproc())},
      {env::kWorldSize, std::to_string(info.worldSize)},
      {env::kRoleWorldSize, std::to_string(info.worldSize)},
      {env::kGroupWorldSize, std::to_string(info.numNodes)},
      {env::kMasterAddr, info.storeHost},
      {env::kMasterPort, std::to_string(info.storePort)},
      {env::kRestartCount, std::to_string(restartCount)},
      {env::kMaxRestarts, std::to_string(c.maxRestarts)},
      {env::kRunId, info.runId},
      {env::kUseAgentStore, info.agentStore ? "True" : "False"},
      {env::kErrorFile, errorFile},
      {env::kRendezvousRound, std::to_string(info.round)},
  };
  if (c.inPlaceRecovery) {
    vars[env::kRecovery] = contract::kRecoveryInPlace;
    if (!c.controlKey.empty())
      vars[env::kControlKey] = contract::auth::toHex(reinterpret_cast<const std::uint8_t*>(c.controlKey.data()),
                                                     c.controlKey.size());
  }
  return vars;
}

bool shouldDefaultOmpThreads(const std::vector<std::string>& base, int localNproc) {
  return localNproc > 1 && !hasKey(base, env::kOmpNumThreads);
}

std::vector<std::string> workerEnvironment(const std::vector<std::string>& base,
                                           const std::map<std::string, std::string>& vars,
                                           bool defaultOmpThreads) {
  std::vector<std::string> out;
  out.reserve(base.size() + vars.size() + 3);
  for (const auto& e : base)
    if (!vars.count(keyOf(e)) && !launcherOwned(keyOf(e))) out.push_back(e);
  for (const auto& [k, v] : vars) out.push_back(k + "=" + v);
  for (const char* k : {env::kNcclAsyncErrorHandling, kLegacyNcclAsyncErrorHandling})
    if (!hasKey(base, k)) out.push_back(std::string(k) + "=1");
  if (defaultOmpThreads) out.push_back(std::string(env::kOmpNumThreads) + "=1");
  return out;
}

std::vector<std::string> currentEnvironment() {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) out.emplace_back(*e);
  return out;
}

} // namespace ctorch::launcher
