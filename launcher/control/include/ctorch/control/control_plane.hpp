// The job's control plane on the workers' store port (store::SideProtocol): each connection that
// opens with the control magic gets a challenge-response on the job's key, then authenticated
// frames (contract/control_protocol.hpp), whose messages go to the Coordinator. Node rank 0's
// ctorchrun hosts it in every workers' store it serves under --recovery in-place, so a new launch
// and every restart round get a new launch id and a fresh coordinator. A connection that fails
// the handshake or sends one unauthenticated frame is closed; each kind of refusal is logged once
// and counted (stats()), never stored.
#pragma once

#include "ctorch/control/coordinator.hpp"
#include "ctorch/store/side_protocol.hpp"

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace ctorch::control {

struct ControlPlaneStats {
  std::uint64_t connections = 0;    // opened with the control magic
  std::uint64_t authenticated = 0;  // proved the key
  std::uint64_t refused = 0;        // closed for a bad handshake, frame or message
  std::uint64_t welcomed = 0;       // welcomes sent (a worker's once its agent registered its process)
  std::int64_t generation = 0;      // the group's generation now
  int killsOrdered = 0;
  int capability = -1;              // Coordinator::capability()
};

class ControlPlane : public store::SideProtocol {
 public:
  // `key`: the job's control key (raw bytes). `log`: one line per notable event.
  ControlPlane(std::string key, std::function<void(const std::string&)> log = {});

  std::string_view magic() const override;
  bool received(std::uint64_t conn, std::string_view bytes, std::vector<Output>& out) override;
  void closed(std::uint64_t conn, std::vector<Output>& out) override;

  ControlPlaneStats stats() const;

 private:
  struct Session {
    enum class Stage { kClientHello, kHello, kReady } stage = Stage::kClientHello;
    std::string in;
    contract::control::Channel channel;
  };
  void deliver(std::vector<Outgoing>& outgoing, std::vector<Output>& out);
  void refuseOnce(const std::string& why);

  std::string key_;
  std::function<void(const std::string&)> log_;
  contract::control::Nonce launch_{};
  Coordinator coordinator_;
  std::map<std::uint64_t, Session> sessions_;
  std::map<std::string, std::uint64_t> refusals_;  // kinds logged, with their counts
  mutable std::mutex statsMutex_;
  ControlPlaneStats stats_;
};

// The factory a rendezvous gives each workers' store it creates (null: no control plane).
using ControlPlaneFactory = std::function<std::shared_ptr<store::SideProtocol>()>;

} // namespace ctorch::control
