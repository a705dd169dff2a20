// How a worker ended: an exit code or a signal, plus the exec failures the launcher sees itself.
#pragma once

#include <string>

namespace ctorch::launcher {

struct ExitStatus {
  int exitCode = 0;    // valid when signal == 0
  int signal = 0;      // the signal that killed the process, else 0
  int execErrno = 0;   // the program could not be executed (errno of execve), else 0

  static ExitStatus fromWaitStatus(int wstatus);
  static ExitStatus exited(int code) { return ExitStatus{code, 0, 0}; }
  static ExitStatus killed(int signo) { return ExitStatus{0, signo, 0}; }

  bool success() const { return signal == 0 && exitCode == 0 && execErrno == 0; }
  // The conventional shell exit code: the code itself, or 128 + signal.
  int asExitCode() const;
  // "exit 3", "signal 11 (SIGSEGV)", "exec failed: Permission denied".
  std::string describe() const;
};

// "SIGSEGV" for 11; "SIG42" for unnamed signals.
std::string signalName(int signo);
// Parses "SIGTERM", "TERM", "15" (case-insensitive); -1 when unknown.
int parseSignal(const std::string& name);

} // namespace ctorch::launcher
