// The "c10d" rendezvous backend of ctorchrun: agents on several nodes meet in a TCPStore at
// --rdzv-endpoint (hosted by the agent whose address matches it, or `is_host` in --rdzv-conf, with
// the native store server), and the pure decisions of ctorch::rdzv::c10d (applied by its Executor)
// form rounds: elastic --nnodes MIN:MAX, stable node ranks, heartbeats published from the agent's
// event loop, prompt detection of killed, cut-off and failed nodes. See docs/rendezvous.md.
#pragma once

#include "ctorch/control/control_plane.hpp"

#include "ctorch/launcher/rendezvous.hpp"

#include "ctorch/rdzv/c10d/settings.hpp"

#include <chrono>
#include <memory>
#include <optional>
#include <string>

namespace ctorch::launcher {

// Grace period (capped by --shutdown-timeout) for workers stopped because a peer was lost: their
// collectives are broken, so waiting long for a clean snapshot is pointless.
inline constexpr std::chrono::milliseconds kLostPeerGrace{5000};

struct C10dRendezvousOptions {
  rdzv::c10d::Settings settings;         // run id, MIN/MAX, timeouts (validated)
  std::string endpointHost = "localhost";
  int endpointPort = rdzv::c10d::kDefaultRendezvousPort;
  std::optional<bool> isHost;            // is_host in --rdzv-conf
  std::string localAddr;                 // --local-addr: how the others reach this node
  std::optional<int> requestedRank;      // --node-rank or SLURM_NODEID
  std::string hostname;
  // The agent's heartbeat tick (the event loop reads the state this often): a quarter of the
  // keep-alive interval, 50 ms to 500 ms.
  std::chrono::milliseconds tick{250};
  // Bound on one store request (min of read_timeout, heartbeat_timeout, keep_alive_interval): an
  // unreachable store blocks the event loop for at most this long per tick.
  std::chrono::milliseconds operationTimeout{1000};
  // --store-failover: every agent keeps a standby rendezvous store; when the store's host is lost,
  // the survivors move to the standby of the next node (by node rank) and re-form there.
  bool storeFailover = false;
  // The key that signs and checks loss marks (LaunchConfig::failoverKey); empty: unsigned.
  std::string failoverKey;
  // --recovery in-place: the control plane each workers' store of node rank 0 hosts (null: none).
  control::ControlPlaneFactory controlPlane;
};

// From the validated command line (c10d backend): its typed --rdzv-conf with ctorchrun's
// heartbeat defaults (rdzv::c10d::ctorchrunSettings); throws UsageError naming a bad setting.
C10dRendezvousOptions c10dOptionsFrom(const LaunchConfig& config);

class C10dRendezvous : public RendezvousHandler {
 public:
  // Creates the event fds only; the store is set up by the first next().
  explicit C10dRendezvous(C10dRendezvousOptions options);
  ~C10dRendezvous() override;
  C10dRendezvous(const C10dRendezvous&) = delete;
  C10dRendezvous& operator=(const C10dRendezvous&) = delete;

  std::string backend() const override { return "c10d"; }
  RendezvousInfo next(const RendezvousRequest& request) override;
  int eventFd() const override;
  std::optional<RendezvousEvent> takeEvent() override;
  void reportFailure(const std::string& reason) override;
  std::optional<RendezvousEvent> exitBarrier(std::chrono::milliseconds timeout) override;
  void shutdown(AgentOutcome outcome) override;

  // After the first next(): whether this agent hosts the rendezvous store.
  bool hostsStore() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace ctorch::launcher
