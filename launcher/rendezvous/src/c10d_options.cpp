// The c10d backend's options from the validated command line: the typed --rdzv-conf (with
// ctorchrun's heartbeat defaults), the endpoint, and the agent's tick and request bound derived from them.
#include "ctorch/launcher/c10d_rendezvous.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/rdzv/c10d/errors.hpp"

#include <algorithm>

namespace ctorch::launcher {

using std::chrono::milliseconds;
namespace rc = ctorch::rdzv::c10d;

C10dRendezvousOptions c10dOptionsFrom(const LaunchConfig& c) {
  C10dRendezvousOptions o;
  try {
    if (c.rdzvId.empty()) throw rc::RendezvousConfigError("--rdzv-id must not be empty");
    o.settings = rc::ctorchrunSettings(c.rdzvId, c.minNodes, c.maxNodes, c.rdzvConf);
    o.isHost = c.rdzvConf.isHost;
  } catch (const rc::RendezvousConfigError& e) {
    throw UsageError(e.what());
  }
  o.endpointHost = c.rdzvEndpointHost.empty() ? "localhost" : c.rdzvEndpointHost;
  o.endpointPort = c.rdzvEndpointPort;
  o.localAddr = c.localAddr;
  o.requestedRank = c.nodeRank;
  o.hostname = c.hostname;
  const auto& s = o.settings;
  o.tick = std::clamp(s.keepAliveInterval / 4, milliseconds(50), milliseconds(500));
  o.operationTimeout =
      std::max(milliseconds(100), std::min({s.readTimeout, s.heartbeatTimeout, s.keepAliveInterval}));
  o.storeFailover = c.storeFailover;
  o.failoverKey = c.failoverKey;
  o.controlPlane = controlPlaneFor(c);
  return o;
}

} // namespace ctorch::launcher
