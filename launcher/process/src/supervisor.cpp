#include "supervisor.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>

// Everything below runs between fork() and _exit() in a child of a multi-threaded process:
// system calls and plain loops only.

namespace ctorch::launcher::supervisor {

namespace {

constexpr int kCtl = 3;  // the control socket
constexpr int kOut = 4;  // the worker's stdout
constexpr int kErr = 5;  // the worker's stderr
constexpr int kMaxChildren = 4096;

void closeFrom(int lowest) {
#ifdef SYS_close_range
  if (::syscall(SYS_close_range, static_cast<unsigned>(lowest), ~0U, 0U) == 0) return;
#endif
  rlimit rl{};
  long max = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                 ? static_cast<long>(rl.rlim_cur)
                 : 65536;
  for (long fd = lowest; fd < max; ++fd) ::close(static_cast<int>(fd));
}

long long nowNs(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

void sendMessage(std::int32_t type, std::int32_t value, std::int64_t extra) {
  Message m;
  m.type = type;
  m.value = value;
  m.extra = extra;
  while (::send(kCtl, &m, sizeof m, MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

// Decimal text of a non-negative number into buf; returns the length.
int formatNumber(long long v, char* buf) {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v > 0);
  for (int i = 0; i < n; ++i) buf[i] = tmp[n - 1 - i];
  return n;
}

char gReadBuf[8192];

// Parses a whitespace-separated list of pids from /proc/self/task/<tid>/children.
int childrenFromProcChildren(pid_t self, pid_t* out, int max) {
  char path[64] = "/proc/self/task/";
  int len = 16;
  len += formatNumber(self, path + len);
  const char suffix[] = "/children";
  for (int i = 0; suffix[i]; ++i) path[len++] = suffix[i];
  path[len] = '\0';
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  int count = 0;
  long long cur = -1;
  for (;;) {
    ssize_t n = ::read(fd, gReadBuf, sizeof gReadBuf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (ssize_t i = 0; i < n; ++i) {
      char c = gReadBuf[i];
      if (c >= '0' && c <= '9') {
        cur = (cur < 0 ? 0 : cur * 10) + (c - '0');
      } else if (cur >= 0) {
        if (count < max) out[count++] = static_cast<pid_t>(cur);
        cur = -1;
      }
    }
  }
  if (cur >= 0 && count < max) out[count++] = static_cast<pid_t>(cur);
  ::close(fd);
  return count;
}

// Slow path when CONFIG_PROC_CHILDREN is off: every /proc/<pid>/stat whose ppid is us.
int childrenFromProcScan(pid_t self, pid_t* out, int max) {
  int dfd = ::open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return 0;
  alignas(8) char dents[8192];
  int count = 0;
  for (;;) {
    long n = ::syscall(SYS_getdents64, dfd, dents, sizeof dents);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      auto* d = reinterpret_cast<dirent64*>(dents + off);
      off += d->d_reclen;
      const char* name = d->d_name;
      long long pid = 0;
      bool numeric = name[0] != '\0';
      for (const char* p = name; *p; ++p) {
        if (*p < '0' || *p > '9') {
          numeric = false;
          break;
        }
        pid = pid * 10 + (*p - '0');
      }
      if (!numeric) continue;
      char path[64] = "/proc/";
      int len = 6;
      len += formatNumber(pid, path + len);
      const char suffix[] = "/stat";
      for (int i = 0; suffix[i]; ++i) path[len++] = suffix[i];
      path[len] = '\0';
      int fd = ::openat(AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      ssize_t r = ::read(fd, gReadBuf, sizeof gReadBuf - 1);
      ::close(fd);
      if (r <= 0) continue;
      // "pid (comm) S ppid ...": comm may hold anything, so start after the last ')'.
      ssize_t close = -1;
      for (ssize_t i = 0; i < r; ++i)
        if (gReadBuf[i] == ')') close = i;
      if (close < 0) continue;
      ssize_t i = close + 1;
      while (i < r && gReadBuf[i] == ' ') ++i;
      while (i < r && gReadBuf[i] != ' ') ++i;  // state
      while (i < r && gReadBuf[i] == ' ') ++i;
      long long ppid = 0;
      while (i < r && gReadBuf[i] >= '0' && gReadBuf[i] <= '9') ppid = ppid * 10 + (gReadBuf[i++] - '0');
      if (ppid == self && count < max) out[count++] = static_cast<pid_t>(pid);
    }
  }
  ::close(dfd);
  return count;
}

int listChildren(pid_t self, pid_t* out, int max) {
  int n = childrenFromProcChildren(self, out, max);
  return n >= 0 ? n : childrenFromProcScan(self, out, max);
}

bool hasChildren() {
  siginfo_t info{};
  return ::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) == 0;  // ECHILD: none at all
}

struct State {
  pid_t self = 0;
  pid_t worker = 0;
  bool workerAlive = true;
  int sfd = -1;
};

// Reaps every exited child; reports the worker's own exit to the agent.
void reap(State& s) {
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(-1, &status, WNOHANG);
    if (r <= 0) {
      if (r < 0 && errno == EINTR) continue;
      return;
    }
    if (r == s.worker && s.workerAlive) {
      s.workerAlive = false;
      sendMessage(kExited, status, nowNs(CLOCK_REALTIME));
    }
  }
}

void drainSignals(int sfd) {
  signalfd_siginfo info;
  while (::read(sfd, &info, sizeof info) > 0) {
  }
}

// SIGKILLs the worker's process group and every descendant (orphans come to us: we are a
// subreaper) until nothing is left.
[[noreturn]] void killTreeAndExit(State& s) {
  static pid_t kids[kMaxChildren];
  for (;;) {
    ::kill(-s.worker, SIGKILL);
    int n = listChildren(s.self, kids, kMaxChildren);
    for (int i = 0; i < n; ++i) ::kill(kids[i], SIGKILL);
    reap(s);
    bool groupGone = ::kill(-s.worker, 0) != 0 && errno == ESRCH;
    if (groupGone && !hasChildren()) break;
    // Wait a little for the SIGCHLDs of what we just killed; newly orphaned grandchildren are
    // picked up in the next round.
    pollfd p{s.sfd, POLLIN, 0};
    ::poll(&p, 1, 20);
    drainSignals(s.sfd);
  }
  _exit(0);
}

} // namespace

void run(const Plan& plan) {
  State s;
  s.self = ::getpid();
  ::setpgid(0, 0);
  ::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  sigset_t all;
  ::sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, nullptr);

  // Move what we keep to 3, 4, 5 (via high numbers, so that sources and targets cannot collide)
  // and close everything else the agent had open: store sockets, other workers' pipes...
  int ctl = ::fcntl(plan.controlFd, F_DUPFD, 64);
  int out = ::fcntl(plan.stdoutFd >= 0 ? plan.stdoutFd : STDOUT_FILENO, F_DUPFD, 64);
  int err = ::fcntl(plan.stderrFd >= 0 ? plan.stderrFd : STDERR_FILENO, F_DUPFD, 64);
  if (ctl < 0 || out < 0 || err < 0) _exit(1);
  ::dup2(ctl, kCtl);
  ::dup2(out, kOut);
  ::dup2(err, kErr);
  closeFrom(kErr + 1);
  if (::getppid() != plan.agentPid) _exit(1);  // the agent died before we were ready

  sigset_t chld;
  ::sigemptyset(&chld);
  ::sigaddset(&chld, SIGCHLD);
  s.sfd = ::signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);

  pid_t w = ::fork();
  if (w == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (::getppid() != s.self) _exit(127);
    ::dup2(kOut, STDOUT_FILENO);
    ::dup2(kErr, STDERR_FILENO);
    ::fcntl(kCtl, F_SETFD, FD_CLOEXEC);  // kept only to report an exec failure
    closeFrom(kOut);
    ::sigprocmask(SIG_SETMASK, &plan.workerMask, nullptr);
    ::execve(plan.executable, plan.argv, plan.envp);
    int e = errno;
    sendMessage(kExecFailed, e, 0);
    _exit(e == ENOENT ? 127 : 126);
  }
  if (w < 0) {
    sendMessage(kExecFailed, errno, 0);
    _exit(1);
  }
  ::setpgid(w, w);  // also here, so that a group signal right after kStarted cannot miss
  ::close(kOut);    // only the worker writes its output: EOF when its tree is gone
  ::close(kErr);
  s.worker = w;
  sendMessage(kStarted, w, 0);

  long long leftoverDeadline = 0;
  for (;;) {
    pollfd fds[2] = {{kCtl, POLLIN, 0}, {s.sfd, POLLIN, 0}};
    int timeout = -1;
    if (!s.workerAlive) {
      long long left = (leftoverDeadline - nowNs(CLOCK_MONOTONIC)) / 1000000;
      timeout = left <= 0 ? 0 : (left > 1000000 ? 1000000 : static_cast<int>(left));
    }
    int r = ::poll(fds, 2, timeout);
    if (r < 0 && errno != EINTR) killTreeAndExit(s);
    if (r > 0 && fds[0].revents) {
      Message m;
      ssize_t n = ::recv(kCtl, &m, sizeof m, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) killTreeAndExit(s);  // agent gone
      if (n == static_cast<ssize_t>(sizeof m)) {
        if (m.type == kKill) killTreeAndExit(s);
        if (m.type == kSignal) ::kill(-s.worker, m.value);
      }
    }
    if (r > 0 && fds[1].revents) drainSignals(s.sfd);
    bool wasAlive = s.workerAlive;
    reap(s);
    if (wasAlive && !s.workerAlive) {
      // The worker is gone; whatever it left behind gets SIGTERM now and SIGKILL after the grace.
      ::kill(-s.worker, SIGTERM);
      leftoverDeadline = nowNs(CLOCK_MONOTONIC) + plan.leftoverGraceMs * 1000000LL;
    }
    if (!s.workerAlive) {
      reap(s);
      bool groupGone = ::kill(-s.worker, 0) != 0 && errno == ESRCH;
      if (groupGone && !hasChildren()) _exit(0);
      if (nowNs(CLOCK_MONOTONIC) >= leftoverDeadline) killTreeAndExit(s);
    }
  }
}

} // namespace ctorch::launcher::supervisor
