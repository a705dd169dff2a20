// The c10d rendezvous executor's clock in the agent: real time, and sleeps that wake up for a stop
// request of the agent (and run a check first, which may end the wait by throwing).
#pragma once

#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"

#include <chrono>
#include <functional>

namespace ctorch::launcher {

class AgentClock final : public rdzv::c10d::Clock {
 public:
  rdzv::c10d::Timestamp now() override;
  std::chrono::steady_clock::time_point steadyNow() override { return std::chrono::steady_clock::now(); }
  void sleepFor(std::chrono::milliseconds d) override;
  void setRequest(const RendezvousRequest* r) { request_ = r; }
  // Runs before every wait of the executor (it may throw to end the wait).
  void setCheck(std::function<void()> check) { check_ = std::move(check); }

 private:
  const RendezvousRequest* request_ = nullptr;
  std::function<void()> check_;
};

} // namespace ctorch::launcher
