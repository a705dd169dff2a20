// Signals as events: the agent never runs code in a signal handler. The signals it handles are
// blocked (in main(), before any thread starts, so every thread inherits the mask) and read from a
// signalfd in the poll loop. SignalSource is the seam tests replace.
#pragma once

#include <signal.h>

#include <optional>
#include <vector>

namespace ctorch::launcher {

class SignalSource {
 public:
  virtual ~SignalSource() = default;
  virtual int fd() const = 0;               // readable when take() has a signal
  virtual std::optional<int> take() = 0;    // next pending signal, without blocking
};

// Blocks `signals` in the calling thread (call it before starting threads) and returns the mask
// that was in effect before, which workers must start with.
sigset_t blockSignals(const std::vector<int>& signals);

class SignalWatcher : public SignalSource {
 public:
  // The signals must already be blocked in every thread (see blockSignals).
  explicit SignalWatcher(const std::vector<int>& signals);
  ~SignalWatcher() override;
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;
  int fd() const override { return fd_; }
  std::optional<int> take() override;

 private:
  int fd_ = -1;
};

} // namespace ctorch::launcher
