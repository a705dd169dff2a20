// The per-worker supervisor: a forked (never exec'd) child of the agent that starts one worker in
// its own process group and guarantees that, whatever happens to the agent, nothing the worker
// started survives. It is a child subreaper, so every orphaned descendant of the worker is
// re-parented to it; it watches a socket to the agent, and when the agent goes away (even by
// SIGKILL: the kernel closes the socket) or asks for it, it SIGKILLs the worker's group and every
// descendant until none is left. The worker itself dies with the supervisor (PR_SET_PDEATHSIG).
//
// Internal. The code after fork() runs in a child of a multi-threaded process, so it uses system
// calls only: no allocation, no locks, no C++ library calls.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <cstdint>

namespace ctorch::launcher::supervisor {

// Messages on the SOCK_SEQPACKET socket between the agent and a supervisor.
enum MessageType : std::int32_t {
  kStarted = 1,     // supervisor -> agent: value = worker pid
  kExecFailed = 2,  // worker -> agent (before exec): value = errno
  kExited = 3,      // supervisor -> agent: value = wait status, extra = CLOCK_REALTIME ns
  kSignal = 10,     // agent -> supervisor: value = signal for the worker's process group
  kKill = 11,       // agent -> supervisor: SIGKILL the whole tree now and exit
};

struct Message {
  std::int32_t type = 0;
  std::int32_t value = 0;
  std::int64_t extra = 0;
};

// Everything the supervisor needs, prepared before fork().
struct Plan {
  const char* executable = nullptr;
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  int controlFd = -1;  // the supervisor's end of the socket pair
  int stdoutFd = -1;   // -1: inherit the agent's
  int stderrFd = -1;
  sigset_t workerMask;  // signal mask the worker starts with (the agent's original)
  long long leftoverGraceMs = 0;  // after the worker exits: SIGTERM to leftovers, then SIGKILL
  pid_t agentPid = 0;
};

// Runs the supervisor in the freshly forked child; never returns.
[[noreturn]] void run(const Plan& plan);

} // namespace ctorch::launcher::supervisor
