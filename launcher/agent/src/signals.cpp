#include "ctorch/launcher/signals.hpp"

#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace ctorch::launcher {

sigset_t blockSignals(const std::vector<int>& signals) {
  sigset_t set, old;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  if (int rc = ::pthread_sigmask(SIG_BLOCK, &set, &old); rc != 0)
    throw std::system_error(rc, std::generic_category(), "pthread_sigmask");
  return old;
}

SignalWatcher::SignalWatcher(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (int s : signals) sigaddset(&set, s);
  fd_ = ::signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "signalfd");
}

SignalWatcher::~SignalWatcher() {
  if (fd_ >= 0) ::close(fd_);
}

std::optional<int> SignalWatcher::take() {
  signalfd_siginfo info;
  for (;;) {
    ssize_t n = ::read(fd_, &info, sizeof info);
    if (n == static_cast<ssize_t>(sizeof info)) return static_cast<int>(info.ssi_signo);
    if (n < 0 && errno == EINTR) continue;
    return std::nullopt;
  }
}

} // namespace ctorch::launcher
