// fake_worker: a stand-in training program for the launcher tests (no LibTorch). Its arguments are
// a small script run left to right:
//   print TEXT | eprint TEXT     a line on stdout / stderr ("{rank}" is replaced by RANK)
//   env                          the worker contract variables as "ENV KEY=VALUE" lines
//   exit CODE                    exit with CODE
//   signal NAME                  raise a signal (SEGV, ABRT, KILL, TERM, ... or a number)
//   sleep MS                     sleep
//   hang                         sleep until killed
//   ignore-term                  ignore SIGTERM from now on, saying "ignoring SIGTERM" each time
//                                one comes (from the handler: the test sees that it arrived)
//   trap-term CODE               on SIGTERM print "got SIGTERM" and exit CODE
//   spawn MARK [setsid]          start a grandchild that sleeps, tagged CTORCH_TEST_MARK=MARK
//                                (setsid: in its own session, out of the worker's process group)
//   spawn-tree MARK              a child that itself starts a setsid'd grandchild, then both sleep
//   error-file MESSAGE           write TORCHELASTIC_ERROR_FILE in torchrun's JSON schema
//   lines N WIDTH                N lines of WIDTH characters as fast as possible (rank-stamped)
//   stamp TAG                    print "STAMP TAG <CLOCK_REALTIME ns>" ("{restart}" expands too)
//   if-rank R                    run the next command only on RANK R
//   if-restart-below K           run the next command only while TORCHELASTIC_RESTART_COUNT < K
//                                (conditions chain: "if-rank 0 if-restart-below 1 exit 3")
//   if-world W                   run the next command only when WORLD_SIZE is W
//   store-set KEY                set KEY (no prefix) in the store at MASTER_ADDR:MASTER_PORT
//   store-has KEY                print "STORE KEY present" or "STORE KEY absent" for that store
//   train FILE STEPS MS          a resumable training loop: starts at the step saved in FILE
//                                (0 if none, prints "resumed at step S"), one step every MS ms,
//                                saves its step to FILE (write + rename) and exits 75
//                                (contract::kExitPreempted) on SIGUSR1 or SIGTERM ("preempted at
//                                step S by SIGUSR1"), or saves STEPS and exits 0 when done
//                                ("done at step STEPS"); rank 0 writes FILE, the others read it
//   save-delay MS                train's snapshot on a stop takes MS (a real save is not instant);
//                                it then also prints "stop signals received: N"
//   partial TEXT                 TEXT on stdout without a newline, flushed ("\r" becomes a CR)
//   wait-file PATH               wait until PATH exists (the test says when to go on)
//   hold-at STEP FILE            train stops counting at STEP ("holding at step STEP", once) until
//                                FILE exists; a stop signal still saves and exits 75 meanwhile
//   barrier N                    wait until N workers of this round (TORCHELASTIC_RESTART_COUNT)
//                                reached a barrier in the store at MASTER_ADDR:MASTER_PORT
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ctorch/store/tcp_store_client.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

const char* kContract[] = {"RANK",
                           "LOCAL_RANK",
                           "GROUP_RANK",
                           "ROLE_RANK",
                           "ROLE_NAME",
                           "LOCAL_WORLD_SIZE",
                           "WORLD_SIZE",
                           "ROLE_WORLD_SIZE",
                           "GROUP_WORLD_SIZE",
                           "MASTER_ADDR",
                           "MASTER_PORT",
                           "TORCHELASTIC_RESTART_COUNT",
                           "TORCHELASTIC_MAX_RESTARTS",
                           "TORCHELASTIC_RUN_ID",
                           "TORCHELASTIC_USE_AGENT_STORE",
                           "TORCHELASTIC_ERROR_FILE",
                           "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                           "NCCL_ASYNC_ERROR_HANDLING",
                           "OMP_NUM_THREADS"};

std::string envOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

std::string expand(std::string text) {
  for (auto [key, var] : {std::pair<std::string, const char*>{"{rank}", "RANK"},
                          std::pair<std::string, const char*>{"{restart}", "TORCHELASTIC_RESTART_COUNT"}}) {
    std::string value = envOr(var, "?");
    for (auto p = text.find(key); p != std::string::npos; p = text.find(key)) text.replace(p, key.size(), value);
  }
  return text;
}

int signalNumber(const std::string& name) {
  std::string n = name.rfind("SIG", 0) == 0 ? name.substr(3) : name;
  struct {
    const char* name;
    int number;
  } table[] = {{"SEGV", SIGSEGV}, {"ABRT", SIGABRT}, {"KILL", SIGKILL}, {"TERM", SIGTERM},
               {"INT", SIGINT},   {"HUP", SIGHUP},   {"USR1", SIGUSR1}, {"USR2", SIGUSR2},
               {"QUIT", SIGQUIT}, {"BUS", SIGBUS},   {"FPE", SIGFPE}};
  for (const auto& t : table)
    if (n == t.name) return t.number;
  return std::atoi(n.c_str());
}

int gTrapCode = 0;
void onTerm(int) {
  const char msg[] = "got SIGTERM\n";
  [[maybe_unused]] ssize_t n = ::write(STDOUT_FILENO, msg, sizeof msg - 1);
  _exit(gTrapCode);
}

long long nowNs() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void onTermIgnored(int) {
  const char msg[] = "ignoring SIGTERM\n";
  [[maybe_unused]] ssize_t n = ::write(STDOUT_FILENO, msg, sizeof msg - 1);
}

volatile sig_atomic_t gStopSignal = 0;
volatile sig_atomic_t gStopCount = 0;
int gSaveDelayMs = 0;
int gHoldStep = -1;
std::string gHoldFile;
void onStop(int signo) {
  if (!gStopSignal) gStopSignal = signo;
  gStopCount = gStopCount + 1;
}

void sleepMs(int ms) {
  timespec ts{ms / 1000, (ms % 1000) * 1000000L};
  while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

int readStep(const std::string& path) {
  std::ifstream f(path);
  int step = 0;
  if (f >> step) return step;
  return 0;
}

void writeStep(const std::string& path, int step) {
  if (envOr("RANK", "0") != "0") return;
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << step << "\n";
  }
  std::rename(tmp.c_str(), path.c_str());
}

// The loop a trainer runs, reduced to a counter: resume, step, snapshot on a stop signal.
int train(const std::string& path, int steps, int ms) {
  struct sigaction sa {};
  sa.sa_handler = onStop;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGUSR1, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  int step = readStep(path);
  std::printf("resumed at step %d\n", step);
  std::fflush(stdout);
  bool held = false;
  while (step < steps) {
    if (gStopSignal) {
      if (gSaveDelayMs > 0) sleepMs(gSaveDelayMs);
      writeStep(path, step);
      std::printf("preempted at step %d by %s\n", step, gStopSignal == SIGUSR1 ? "SIGUSR1" : "SIGTERM");
      if (gSaveDelayMs > 0) std::printf("stop signals received: %d\n", static_cast<int>(gStopCount));
      std::fflush(stdout);
      return 75;
    }
    if (step == gHoldStep && !exists(gHoldFile)) {
      if (!held) {
        std::printf("holding at step %d\n", step);
        std::fflush(stdout);
        held = true;
      }
      timespec tick{0, 10 * 1000000L};
      ::nanosleep(&tick, nullptr);  // a stop signal cuts it short
      continue;
    }
    timespec ts{ms / 1000, (ms % 1000) * 1000000L};
    while (::nanosleep(&ts, &ts) != 0 && errno == EINTR && !gStopSignal) {
    }
    if (!gStopSignal) ++step;
  }
  writeStep(path, step);
  std::printf("done at step %d\n", step);
  std::fflush(stdout);
  return 0;
}

[[noreturn]] void sleepForever() {
  for (;;) ::pause();
}

// A tagged process that just sleeps; the tag is in its environment so tests can find it in /proc.
void spawnSleeper(const std::string& mark, bool newSession) {
  pid_t p = ::fork();
  if (p == 0) {
    if (newSession) ::setsid();
    ::setenv("CTORCH_TEST_MARK", mark.c_str(), 1);
    ::execlp("sleep", "sleep", "3600", static_cast<char*>(nullptr));
    _exit(127);
  }
}

} // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  bool skipNext = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& cmd = args[i];
    auto arg = [&]() -> std::string {
      if (i + 1 >= args.size()) {
        std::fprintf(stderr, "fake_worker: '%s' needs an argument\n", cmd.c_str());
        std::exit(2);
      }
      return args[++i];
    };
    bool skip = skipNext;
    skipNext = false;
    // Conditions chain: "if-rank 0 if-restart-below 1 exit 3" needs both.
    if (cmd == "if-rank") {
      std::string rank = arg();
      skipNext = skip || envOr("RANK", "-1") != rank;
      continue;
    }
    if (cmd == "if-restart-below") {
      int below = std::atoi(arg().c_str());
      skipNext = skip || std::atoi(envOr("TORCHELASTIC_RESTART_COUNT", "0").c_str()) >= below;
      continue;
    }
    if (cmd == "if-world") {
      std::string world = arg();
      skipNext = skip || envOr("WORLD_SIZE", "-1") != world;
      continue;
    }
    if (cmd == "train") {
      std::string path = arg();
      int steps = std::atoi(arg().c_str());
      int ms = std::atoi(arg().c_str());
      if (!skip) return train(path, steps, ms);
      continue;
    }
    if (cmd == "save-delay") {
      int ms = std::atoi(arg().c_str());
      if (!skip) gSaveDelayMs = ms;
    } else if (cmd == "hold-at") {
      int step = std::atoi(arg().c_str());
      std::string file = arg();
      if (!skip) {
        gHoldStep = step;
        gHoldFile = file;
      }
    } else if (cmd == "wait-file") {
      std::string file = arg();
      if (!skip) {
        std::fflush(nullptr);
        while (!exists(file)) sleepMs(10);
      }
    } else if (cmd == "partial") {
      std::string t = arg();
      if (!skip) {
        for (auto p = t.find("\\r"); p != std::string::npos; p = t.find("\\r")) t.replace(p, 2, "\r");
        std::fputs(expand(t).c_str(), stdout);
        std::fflush(stdout);
      }
    } else if (cmd == "print") {
      std::string t = arg();
      if (!skip) std::printf("%s\n", expand(t).c_str());
    } else if (cmd == "eprint") {
      std::string t = arg();
      if (!skip) std::fprintf(stderr, "%s\n", expand(t).c_str());
    } else if (cmd == "env") {
      if (!skip)
        for (const char* k : kContract) {
          const char* v = std::getenv(k);
          std::printf("ENV %s=%s\n", k, v ? v : "<unset>");
        }
    } else if (cmd == "exit") {
      int code = std::atoi(arg().c_str());
      if (!skip) {
        std::fflush(nullptr);
        std::exit(code);
      }
    } else if (cmd == "signal") {
      int s = signalNumber(arg());
      if (!skip) {
        std::fflush(nullptr);
        ::signal(s, SIG_DFL);
        ::raise(s);
        ::pause();
      }
    } else if (cmd == "sleep") {
      int ms = std::atoi(arg().c_str());
      if (!skip) {
        std::fflush(nullptr);
        ::usleep(static_cast<useconds_t>(ms) * 1000);
      }
    } else if (cmd == "hang") {
      if (!skip) {
        std::fflush(nullptr);
        sleepForever();
      }
    } else if (cmd == "ignore-term") {
      if (!skip) {
        std::fflush(nullptr);  // the handler writes to the fd directly
        struct sigaction sa {};
        sa.sa_handler = onTermIgnored;
        ::sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESTART;
        ::sigaction(SIGTERM, &sa, nullptr);
      }
    } else if (cmd == "trap-term") {
      int code = std::atoi(arg().c_str());
      if (!skip) {
        gTrapCode = code;
        ::signal(SIGTERM, onTerm);
      }
    } else if (cmd == "spawn") {
      std::string mark = arg();
      bool setsid = i + 1 < args.size() && args[i + 1] == "setsid";
      if (setsid) ++i;
      if (!skip) spawnSleeper(mark, setsid);
    } else if (cmd == "spawn-tree") {
      std::string mark = arg();
      if (!skip) {
        pid_t p = ::fork();
        if (p == 0) {
          ::setenv("CTORCH_TEST_MARK", mark.c_str(), 1);
          spawnSleeper(mark, true);
          sleepForever();
        }
      }
    } else if (cmd == "error-file") {
      std::string msg = arg();
      if (!skip) {
        std::string path = envOr("TORCHELASTIC_ERROR_FILE", "");
        std::ofstream f(path);
        f << "{\"message\": {\"message\": \"" << msg << "\", \"extraInfo\": {\"py_callstack\": "
          << "\"fake_worker: frame 1\\nfake_worker: frame 2\", \"timestamp\": \"" << nowNs() / 1000000000LL
          << "\"}}}";
      }
    } else if (cmd == "lines") {
      int n = std::atoi(arg().c_str());
      int width = std::atoi(arg().c_str());
      if (!skip) {
        std::string rank = envOr("RANK", "?");
        for (int k = 0; k < n; ++k) {
          std::string head = "L r" + rank + " n" + std::to_string(k) + " ";
          std::string line = head + std::string(width > static_cast<int>(head.size() + 4) ? width - head.size() - 4 : 1, static_cast<char>('a' + std::atoi(rank.c_str()) % 26)) + " END";
          // Written with several small writes on purpose: the launcher must still not split it.
          std::fwrite(line.data(), 1, line.size() / 2, stdout);
          std::fflush(stdout);
          std::fwrite(line.data() + line.size() / 2, 1, line.size() - line.size() / 2, stdout);
          std::fputc('\n', stdout);
        }
        std::fflush(stdout);
      }
    } else if (cmd == "barrier") {
      const int n = std::atoi(arg().c_str());
      if (!skip) {
        std::fflush(nullptr);  // what came before is out, even if the worker is stopped while it waits
        const char* addr = std::getenv("MASTER_ADDR");
        const char* port = std::getenv("MASTER_PORT");
        // FAKE_WORKER_STORE_TIMEOUT_MS: the bound a training program's own store timeout puts on
        // each request (c10d's 300 s default otherwise).
        ctorch::store::TcpStoreClientOptions co;
        if (const char* t = std::getenv("FAKE_WORKER_STORE_TIMEOUT_MS")) co.timeout = std::chrono::milliseconds(std::atoi(t));
        ctorch::store::TcpStoreClient client(addr ? addr : "127.0.0.1",
                                             static_cast<std::uint16_t>(std::atoi(port ? port : "0")), co);
        const std::string key = "fake_worker.barrier." + envOr("TORCHELASTIC_RESTART_COUNT", "0");
        if (client.add(key, 1) == n) client.set(key + ".done", ctorch::store::toBytes("1"));
        client.wait({key + ".done"});  // the client's timeout (300 s) bounds it
      }
    } else if (cmd == "store-set" || cmd == "store-has") {
      std::string key = arg();
      if (!skip) {
        const char* addr = std::getenv("MASTER_ADDR");
        const char* port = std::getenv("MASTER_PORT");
        ctorch::store::TcpStoreClient client(addr ? addr : "127.0.0.1",
                                             static_cast<std::uint16_t>(std::atoi(port ? port : "0")));
        if (cmd == "store-set") client.set(key, ctorch::store::toBytes("1"));
        else std::printf("STORE %s %s\n", key.c_str(), client.check({key}) ? "present" : "absent");
        std::fflush(stdout);
      }
    } else if (cmd == "stamp") {
      std::string tag = arg();
      if (!skip) {
        std::printf("STAMP %s %lld\n", expand(tag).c_str(), nowNs());
        std::fflush(stdout);
      }
    } else {
      std::fprintf(stderr, "fake_worker: unknown command '%s'\n", cmd.c_str());
      return 2;
    }
  }
  std::fflush(nullptr);
  return 0;
}
