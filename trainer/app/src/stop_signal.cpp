#include "ctorch/train/stop_signal.hpp"

#include <atomic>
#include <csignal>
#include <system_error>

#include <cerrno>
#include <signal.h>

namespace ctorch::train {

namespace {

std::atomic<int> gStopSignal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void onStopSignal(int signo) {
  const int previous = gStopSignal.exchange(signo);
  // Asked twice: the user (or a scheduler) means now. SIGUSR1 is only ever a warning.
  if (previous != 0 && signo != SIGUSR1) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(signo, &dfl, nullptr);
    raise(signo);
  }
}

}  // namespace

void installStopHandlers() {
  struct sigaction action {};
  action.sa_handler = onStopSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int signo : {SIGTERM, SIGUSR1, SIGINT})
    if (sigaction(signo, &action, nullptr) != 0)
      throw std::system_error(errno, std::generic_category(), "sigaction");
}

int stopSignal() { return gStopSignal.load(); }

void setStopSignal(int signo) { gStopSignal.store(signo); }

}  // namespace ctorch::train
