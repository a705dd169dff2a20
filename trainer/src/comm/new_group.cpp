// Subgroups of the default group (Python's dist.new_group): the same backends and timeout, keys beside
// the default group's under Python's counter-based group name.
#include "ctorch/distributed.hpp"

#include "comm/group_state.hpp"

#include <algorithm>
#include <string>
#include <vector>

namespace ctorch {

namespace {

std::string rankList(const std::vector<int>& ranks) {
  std::string out = "[";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out + "]";
}

} // namespace

c10::intrusive_ptr<c10d::ProcessGroup> newGroup(std::vector<int> ranks) {
  detail::GroupState& s = detail::groupState();
  std::unique_lock<std::mutex> lock(s.mutex);
  detail::initializedGroupState(s);
  const DistributedEnv env = s.env;
  std::sort(ranks.begin(), ranks.end());
  if (ranks.empty()) throw ConfigError("newGroup: no ranks given");
  if (ranks.front() < 0 || ranks.back() >= env.worldSize)
    throw ConfigError("newGroup: ranks " + rankList(ranks) + " are not all in the world of " +
                      std::to_string(env.worldSize) + " ranks (0 to " + std::to_string(env.worldSize - 1) + ")");
  if (std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end())
    throw ConfigError("newGroup: ranks " + rankList(ranks) + " name a rank twice");
  // Counted on every rank, member or not: the next group's name is the same everywhere.
  const std::string name = std::to_string(s.groupCount++);
  const auto mine = std::find(ranks.begin(), ranks.end(), env.rank);
  if (mine == ranks.end()) return {};
  const int rank = static_cast<int>(mine - ranks.begin()), size = static_cast<int>(ranks.size());
  const auto root = s.store;
  const std::string prefix = s.prefix;
  const ProcessGroupOptions options = s.options;
  const EnvLookup lookup = s.lookup;
  const detail::GroupRecipe recipe = s.recipe;
  lock.unlock();  // connecting waits for the other members

  const std::string where = "rank " + std::to_string(env.rank) + "/" + std::to_string(env.worldSize);
  std::string phase = "making process group " + name + " of ranks " + rankList(ranks) + " (timeout " +
                      detail::seconds(options.timeout()) + ")";
  try {
    auto defaultPg = c10::make_intrusive<c10d::PrefixStore>(prefix, root);
    auto group = compat::groupStore(defaultPg, name);
    std::vector<compat::BoundBackend> backends;
    std::vector<compat::BackendPtr> sequenced;
    if (recipe.useGloo) {
      auto gloo = compat::makeGloo(compat::backendStore(group, "cpu"), rank, size,
                                   detail::glooDevices(options, lookup, env), options.timeout());
      sequenced.push_back(gloo);
      std::vector<c10::DeviceType> devices{c10::DeviceType::CPU};
      if (options.backend() == Backend::kGloo) devices.push_back(c10::DeviceType::CUDA);  // as the default group
      backends.push_back({compat::BackendKind::kGloo, devices, gloo});
    }
#ifdef USE_C10D_NCCL
    if (recipe.useNccl) {
      auto nccl = compat::makeNccl(compat::backendStore(group, "cuda"), rank, size, options.timeout());
      sequenced.push_back(nccl);
      backends.push_back({compat::BackendKind::kNccl, {c10::DeviceType::CUDA}, nccl});
    }
#endif
    if constexpr (compat::kSequenceNumberFromStore)
      for (auto& b : sequenced) b->setSequenceNumberForGroup();
    return compat::makeProcessGroup(group, rank, size, options.timeout(), backends, recipe.defaultKind);
  } catch (...) {
    detail::rethrowDuring(where, phase);
  }
}

} // namespace ctorch
