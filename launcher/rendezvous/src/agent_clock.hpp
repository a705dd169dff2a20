// Time in the agent's c10d rendezvous: the executor's clock (real time, and sleeps that wake up
// for a stop request of the agent), the time since a moment, and a measured time for the log.
#pragma once

#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"

#include <chrono>
#include <functional>
#include <string>

namespace ctorch::launcher {

// The executor's clock; a check set by the handler runs before every wait (it may end the wait by
// throwing).
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

// Milliseconds on the steady clock since `t`.
std::chrono::milliseconds since(std::chrono::steady_clock::time_point t);
// A measured time for the log, to three significant digits ("1.23 s").
std::string measuredSeconds(std::chrono::milliseconds ms);

} // namespace ctorch::launcher
