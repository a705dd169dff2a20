// The launcher's small exception tree. Every error carries the exit code ctorchrun ends with, and
// a one-line message that quotes the bad value and says what to do; only main() catches them.
#pragma once

#include "ctorch/contract/worker_contract.hpp"

#include <cerrno>
#include <stdexcept>
#include <string>
#include <system_error>

namespace ctorch::launcher {

class LauncherError : public std::runtime_error {
 public:
  LauncherError(const std::string& what, int exitCode = contract::kExitFailure)
      : std::runtime_error(what), exitCode_(exitCode) {}
  int exitCode() const { return exitCode_; }

 private:
  int exitCode_;
};

// Bad command line, bad PET_* variable, impossible combination.
class UsageError : public LauncherError {
 public:
  explicit UsageError(const std::string& what) : LauncherError(what, contract::kExitUsage) {}
};

// The training program is missing (127) or cannot be executed (126).
class ProgramError : public LauncherError {
 public:
  ProgramError(const std::string& what, int exitCode) : LauncherError(what, exitCode) {}
};

// The rendezvous failed: store unreachable, timed out, or the port is taken.
class RendezvousError : public LauncherError {
 public:
  explicit RendezvousError(const std::string& what)
      : LauncherError(what, contract::kExitRendezvousFailed) {}
};

class RendezvousTimeout : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

// A rendezvous gave up because the agent was asked to stop (a signal arrived while waiting).
class RendezvousInterrupted : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

// A spare node (it waited while the round was full) leaves because the job finished without
// needing it: not a failure, ctorchrun exits 0.
class RendezvousGracefulExit : public LauncherError {
 public:
  explicit RendezvousGracefulExit(const std::string& what) : LauncherError(what, contract::kExitSuccess) {}
};

// A failed system call: std::system_error carrying errno (STYLE: nothing is ignored silently).
[[noreturn]] inline void throwErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

} // namespace ctorch::launcher
