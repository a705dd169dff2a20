// Time in the agent's c10d rendezvous (agent_clock.hpp): the executor's clock whose sleeps wake
// for a stop request, the time since a moment, and a measured time for the log.
#include "agent_clock.hpp"

#include "ctorch/launcher/errors.hpp"
#include "ctorch/text/text.hpp"

#include <poll.h>

#include <cerrno>
#include <thread>

namespace ctorch::launcher {

using std::chrono::milliseconds;

milliseconds since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - t);
}

std::string measuredSeconds(milliseconds ms) { return text::secondsText(ms, 3); }

rdzv::c10d::Timestamp AgentClock::now() {
  return std::chrono::time_point_cast<milliseconds>(std::chrono::system_clock::now());
}

void AgentClock::sleepFor(milliseconds d) {
  if (check_) check_();
  if (!request_ || request_->cancelFd < 0) {
    std::this_thread::sleep_for(d);
    return;
  }
  auto until = std::chrono::steady_clock::now() + d;
  for (;;) {
    auto left = std::chrono::duration_cast<milliseconds>(until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    pollfd p{request_->cancelFd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r > 0 && request_->stopNow()) throw RendezvousInterrupted("interrupted while waiting for the rendezvous");
    if (r < 0 && errno != EINTR) throwErrno("poll");
  }
}

} // namespace ctorch::launcher
