#include "ctorch/launcher/rendezvous.hpp"

#include "ctorch/launcher/c10d_rendezvous.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/static_rendezvous.hpp"
#include "log.hpp"

#include <poll.h>

#include <map>
#include <mutex>
#include <stdexcept>

namespace ctorch::launcher {

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, RendezvousFactory> factories;
};

Registry& registry() {
  static Registry r;
  static std::once_flag builtins;
  std::call_once(builtins, [] {
    auto makeStatic = [](const LaunchConfig& c) -> std::unique_ptr<RendezvousHandler> {
      return std::make_unique<StaticRendezvous>(staticOptionsFrom(c));
    };
    r.factories["static"] = makeStatic;
    r.factories["standalone"] = makeStatic;
    r.factories["c10d"] = [](const LaunchConfig& c) -> std::unique_ptr<RendezvousHandler> {
      return std::make_unique<C10dRendezvous>(c10dOptionsFrom(c));
    };
  });
  return r;
}

} // namespace

bool RendezvousRequest::stopNow() const {
  if (cancelFd < 0) return false;
  pollfd p{cancelFd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  return stopRequested ? stopRequested() : true;
}

void RendezvousInfo::computeRanks() {
  if (nprocPerNode.size() != static_cast<std::size_t>(numNodes))
    throw std::invalid_argument("rendezvous: " + std::to_string(nprocPerNode.size()) +
                                " node sizes for " + std::to_string(numNodes) + " nodes");
  if (nodeRank < 0 || nodeRank >= numNodes)
    throw std::invalid_argument("rendezvous: node rank " + std::to_string(nodeRank) +
                                " out of range for " + std::to_string(numNodes) + " nodes");
  rankOffsets.assign(nprocPerNode.size(), 0);
  int sum = 0;
  for (std::size_t i = 0; i < nprocPerNode.size(); ++i) {
    rankOffsets[i] = sum;
    sum += nprocPerNode[i];
  }
  worldSize = sum;
}

void registerRendezvousBackend(const std::string& name, RendezvousFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[name] = std::move(factory);
}

bool rendezvousBackendAvailable(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return name != "standalone" && r.factories.count(name) > 0;
}

std::vector<std::string> availableRendezvousBackends() {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& kv : r.factories)
    if (kv.first != "standalone") names.push_back(kv.first);
  return names;
}

const std::vector<std::string>& torchrunRendezvousBackends() {
  static const std::vector<std::string> names = {"static", "c10d", "etcd", "etcd-v2"};
  return names;
}

control::ControlPlaneFactory controlPlaneFor(const LaunchConfig& config) {
  if (!config.inPlaceRecovery || config.controlKey.empty()) return {};
  const std::string key = config.controlKey;
  return [key]() -> std::shared_ptr<store::SideProtocol> {
    return std::make_shared<control::ControlPlane>(key, [](const std::string& line) {
      // Refusals and kills matter to whoever reads the log; the rest is the re-form's progress.
      const bool notable = line.rfind("refused", 0) == 0 || line.rfind("ignoring", 0) == 0 ||
                           line.find("stopped answering") != std::string::npos;
      if (notable) log("control").warn("{}", line);
      else log("control").info("{}", line);
    });
  };
}

std::unique_ptr<RendezvousHandler> createRendezvousHandler(const LaunchConfig& config) {
  RendezvousFactory factory;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(config.rdzvBackend);
    if (it == r.factories.end())
      throw UsageError("unknown --rdzv-backend '" + config.rdzvBackend + "'");
    factory = it->second;
  }
  return factory(config);
}

} // namespace ctorch::launcher
