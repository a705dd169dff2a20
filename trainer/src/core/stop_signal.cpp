#include "ctorch/stop_signal.hpp"

#include <ctorch/contract/worker_contract.hpp>

#include <atomic>
#include <cstdint>
#include <ctime>
#include <csignal>
#include <system_error>

#include <cerrno>
#include <signal.h>

namespace ctorch {

namespace {

std::atomic<int> gStopSignal{0};
std::atomic<std::int64_t> gFirstStopMs{0};  // CLOCK_MONOTONIC ms of the first stop signal
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free flag");
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "the signal handler needs a lock-free clock");

std::int64_t monotonicMs() {  // clock_gettime is async-signal-safe
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

extern "C" void onStopSignal(int signo) {
  const std::int64_t now = monotonicMs();
  std::int64_t first = 0;
  gFirstStopMs.compare_exchange_strong(first, now);  // keeps the first stop's time
  if (first != 0 && now - first < contract::kDuplicateStopWindowMs) return;  // a copy of the same stop
  const int previous = gStopSignal.exchange(signo);
  // Asked again, seconds later: the user (or a scheduler) means now. SIGUSR1 is only ever a warning.
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

void setStopSignal(int signo) {
  gStopSignal.store(signo);
  gFirstStopMs.store(signo == 0 ? 0 : monotonicMs());
}

}  // namespace ctorch
