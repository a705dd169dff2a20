// Test main shared by every test binary: runs a registered worker when started as
// `<binary> --ctorch-worker NAME ...` (multi-process tests), else forks the fork server that starts
// such workers without exec (zygote.hpp) and runs the Catch2 session.
#define CATCH_CONFIG_RUNNER  // v2: this file supplies main()
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "zygote.hpp"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

namespace {

// A crash prints its stack to stderr (the GPU machine has no debugger): Catch reports the fatal
// signal first, then restores this handler and raises the signal again.
void printStackAndDie(int sig) {
  static const char head[] = "ctorch test: fatal signal; stack:\n";
  (void)!write(STDERR_FILENO, head, sizeof(head) - 1);
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  signal(sig, SIG_DFL);
  raise(sig);
}

void installCrashStack() {
  void* warm[1];
  backtrace(warm, 1);  // loads the unwinder now, not inside a signal handler
  for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT}) signal(sig, printStackAndDie);
}

} // namespace

int main(int argc, char** argv) {
  installCrashStack();
  if (auto rc = ctorch::test::maybeRunWorker(argc, argv)) return *rc;
  // Before Catch2 or a test starts a thread or runs a LibTorch operation: the zygote is a copy of
  // this process as it is now.
  if (auto rc = ctorch::test::zygote::start(argc, argv, installCrashStack)) return *rc;
  return Catch::Session().run(argc, argv);
}
