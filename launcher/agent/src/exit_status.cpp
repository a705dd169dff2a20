#include "ctorch/launcher/exit_status.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/text/text.hpp"

#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <csignal>
#include <cstring>

namespace ctorch::launcher {

namespace {

struct NamedSignal {
  int number;
  const char* name;
};

constexpr NamedSignal kSignals[] = {
    {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},     {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
    {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"},   {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
    {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"},   {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
    {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"},   {SIGTERM, "SIGTERM"}, {SIGCHLD, "SIGCHLD"},
    {SIGCONT, "SIGCONT"}, {SIGSTOP, "SIGSTOP"},   {SIGTSTP, "SIGTSTP"}, {SIGTTIN, "SIGTTIN"},
    {SIGTTOU, "SIGTTOU"}, {SIGURG, "SIGURG"},     {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"},
    {SIGVTALRM, "SIGVTALRM"}, {SIGPROF, "SIGPROF"}, {SIGWINCH, "SIGWINCH"}, {SIGIO, "SIGIO"},
    {SIGPWR, "SIGPWR"},   {SIGSYS, "SIGSYS"},
};

} // namespace

ExitStatus ExitStatus::fromWaitStatus(int wstatus) {
  if (WIFSIGNALED(wstatus)) return killed(WTERMSIG(wstatus));
  if (WIFEXITED(wstatus)) return exited(WEXITSTATUS(wstatus));
  return exited(contract::kExitFailure);
}

int ExitStatus::asExitCode() const {
  if (signal) return contract::exitCodeForSignal(signal);
  if (execErrno) return execErrno == ENOENT ? contract::kExitNotFound : contract::kExitCannotExecute;
  return exitCode;
}

std::string ExitStatus::describe() const {
  if (execErrno) return std::string("exec failed: ") + std::strerror(execErrno);
  if (signal) return "signal " + std::to_string(signal) + " (" + signalName(signal) + ")";
  return "exit " + std::to_string(exitCode);
}

std::string signalName(int signo) {
  for (const auto& s : kSignals)
    if (s.number == signo) return s.name;
  return "SIG" + std::to_string(signo);
}

int parseSignal(const std::string& text) {
  std::string s(ctorch::text::trim(text));
  if (s.empty()) return -1;
  if (std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); })) {
    if (s.size() > 3) return -1;
    int n = std::stoi(s);
    return n >= 1 && n < NSIG ? n : -1;
  }
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::toupper(c); });
  if (s.rfind("SIG", 0) != 0) s = "SIG" + s;
  for (const auto& sig : kSignals)
    if (s == sig.name) return sig.number;
  return -1;
}

} // namespace ctorch::launcher
