#include "ctorch/launcher/supervised_process_context.hpp"

#include "ctorch/launcher/errors.hpp"
#include "supervisor.hpp"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace ctorch::launcher {

namespace {

constexpr std::uint64_t kCtlTag = 0;
constexpr std::uint64_t kOutTag = 1;
constexpr std::uint64_t kErrTag = 2;

std::uint64_t tag(std::size_t index, std::uint64_t kind) { return index * 4 + kind; }

int openOutputFile(const std::filesystem::path& p, bool append) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | (append ? 0 : O_TRUNC) | O_CLOEXEC | O_APPEND, 0644);
  if (fd < 0) throwErrno("cannot open log file " + p.string());
  return fd;
}

} // namespace

struct SupervisedProcessContext::Worker {
  int localRank = 0;
  pid_t supervisor = -1;
  pid_t pid = 0;
  int ctl = -1;
  int outPipe = -1;
  int errPipe = -1;
  bool exitReported = false;
  bool supervisorAlive = false;
  int execErrno = 0;
};

SupervisedProcessContext::SupervisedProcessContext(SupervisedProcessContextOptions options)
    : options_(std::move(options)) {
  epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_ < 0) throwErrno("epoll_create1");
  if (!options_.workerMask) {
    sigset_t current;
    ::pthread_sigmask(SIG_SETMASK, nullptr, &current);
    options_.workerMask = current;
  }
}

SupervisedProcessContext::~SupervisedProcessContext() {
  killAll();
  for (auto& w : workers_) {
    if (w->supervisorAlive) {
      int status = 0;
      while (::waitpid(w->supervisor, &status, 0) < 0 && errno == EINTR) {
      }
    }
    closeWorker(*w);
  }
  ::close(epoll_);
}

int SupervisedProcessContext::fd() const { return epoll_; }

void SupervisedProcessContext::closeWorker(Worker& w) {
  for (int* fd : {&w.ctl, &w.outPipe, &w.errPipe}) {
    if (*fd >= 0) {
      ::epoll_ctl(epoll_, EPOLL_CTL_DEL, *fd, nullptr);
      ::close(*fd);
      *fd = -1;
    }
  }
}

void SupervisedProcessContext::start(const std::vector<WorkerLaunch>& launches) {
  if (!finished()) throw std::logic_error("ProcessContext::start: the previous group still runs");
  for (auto& w : workers_) closeWorker(*w);
  workers_.clear();
  for (const auto& l : launches) launch(l, false);
}

void SupervisedProcessContext::add(const WorkerLaunch& worker) { launch(worker, true); }

void SupervisedProcessContext::kill(pid_t pid) {
  for (auto& w : workers_)
    if (w->pid == pid && !w->exitReported) send(*w, supervisor::kKill, 0);
}

void SupervisedProcessContext::killRank(int localRank) {
  for (auto& w : workers_)
    if (w->localRank == localRank && !w->exitReported) send(*w, supervisor::kKill, 0);
}

void SupervisedProcessContext::relabel(int fromLocalRank, int toLocalRank) {
  for (auto& w : workers_)
    if (w->localRank == fromLocalRank && !w->exitReported) w->localRank = toLocalRank;
}

void SupervisedProcessContext::launch(const WorkerLaunch& launch, bool appendLogs) {
  {
    auto w = std::make_unique<Worker>();
    w->localRank = launch.localRank;

    // Everything the supervisor needs must exist before fork(): it may not allocate.
    std::vector<std::string> argvStore = launch.argv;
    std::vector<std::string> envStore = launch.env;
    std::vector<char*> argv, envp;
    for (auto& a : argvStore) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : envStore) envp.push_back(e.data());
    envp.push_back(nullptr);

    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) throwErrno("socketpair");
    int childOut = -1, childErr = -1;
    auto prepare = [&](const OutputSpec& spec, int& parentEnd, int& childEnd) {
      if (spec.toAgent) {
        int p[2];
        if (::pipe2(p, O_CLOEXEC) != 0) throwErrno("pipe2");
        parentEnd = p[0];
        childEnd = p[1];
        // Tee: the agent copies the stream into the file itself.
      } else if (spec.file) {
        childEnd = openOutputFile(*spec.file, appendLogs);
      } else {
        childEnd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (childEnd < 0) throwErrno("open /dev/null");
      }
    };
    prepare(launch.out, w->outPipe, childOut);
    prepare(launch.err, w->errPipe, childErr);

    supervisor::Plan plan;
    plan.executable = launch.executable.c_str();
    plan.argv = argv.data();
    plan.envp = envp.data();
    plan.controlFd = sv[1];
    plan.stdoutFd = childOut;
    plan.stderrFd = childErr;
    plan.workerMask = *options_.workerMask;
    plan.leftoverGraceMs = options_.leftoverGrace.count();
    plan.agentPid = ::getpid();

    pid_t pid = ::fork();
    if (pid < 0) {
      int e = errno;
      for (int fd : {sv[0], sv[1], childOut, childErr, w->outPipe, w->errPipe})
        if (fd >= 0) ::close(fd);
      errno = e;
      throwErrno("fork");
    }
    if (pid == 0) supervisor::run(plan);

    ::close(sv[1]);
    ::close(childOut);
    ::close(childErr);
    w->supervisor = pid;
    w->supervisorAlive = true;
    w->ctl = sv[0];
    std::size_t index = workers_.size();
    auto add = [&](int fd, std::uint64_t kind) {
      if (fd < 0) return;
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.u64 = tag(index, kind);
      if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &ev) != 0) throwErrno("epoll_ctl");
    };
    add(w->ctl, kCtlTag);
    add(w->outPipe, kOutTag);
    add(w->errPipe, kErrTag);
    workers_.push_back(std::move(w));
  }
}

void SupervisedProcessContext::onPipe(std::size_t index, Stream stream, bool drainToEof) {
  Worker& w = *workers_[index];
  int& fd = stream == Stream::Stdout ? w.outPipe : w.errPipe;
  if (fd < 0) return;
  char buf[65536];
  for (int rounds = 0;; ++rounds) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      if (options_.sink) options_.sink->onOutput(w.localRank, stream, std::string_view(buf, static_cast<std::size_t>(n)));
      // Bounded per wakeup so that one chatty worker cannot starve the others.
      if (!drainToEof && rounds >= 16) return;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !drainToEof) return;
    // EOF, an error, or (draining after the supervisor is gone) nothing more will come.
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
    ::close(fd);
    fd = -1;
    if (options_.sink) options_.sink->onClosed(w.localRank, stream);
    return;
  }
}

void SupervisedProcessContext::supervisorGone(std::size_t index, std::vector<WorkerExit>& exits) {
  Worker& w = *workers_[index];
  int status = 0;
  pid_t r;
  do {
    r = ::waitpid(w.supervisor, &status, 0);
  } while (r < 0 && errno == EINTR);
  w.supervisorAlive = false;
  ::epoll_ctl(epoll_, EPOLL_CTL_DEL, w.ctl, nullptr);
  ::close(w.ctl);
  w.ctl = -1;
  if (!w.exitReported) {
    // The supervisor died without reporting (someone killed it): its worker died with it.
    WorkerExit e;
    e.localRank = w.localRank;
    e.pid = w.pid;
    if (w.execErrno) {
      e.status.execErrno = w.execErrno;
    } else if (r == w.supervisor && WIFSIGNALED(status)) {
      e.status = ExitStatus::killed(WTERMSIG(status));
    } else {
      e.status = ExitStatus::killed(SIGKILL);
    }
    e.time = std::chrono::system_clock::now();
    w.exitReported = true;
    exits.push_back(e);
  }
  // Every writer is gone now: deliver what is left in the pipes.
  onPipe(index, Stream::Stdout, true);
  onPipe(index, Stream::Stderr, true);
}

void SupervisedProcessContext::onControl(std::size_t index, std::vector<WorkerExit>& exits) {
  Worker& w = *workers_[index];
  for (;;) {
    supervisor::Message m;
    ssize_t n = ::recv(w.ctl, &m, sizeof m, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (n <= 0) {
      supervisorGone(index, exits);
      return;
    }
    if (n != static_cast<ssize_t>(sizeof m)) continue;
    switch (m.type) {
      case supervisor::kStarted:
        w.pid = m.value;
        break;
      case supervisor::kExecFailed:
        w.execErrno = m.value;
        break;
      case supervisor::kExited: {
        WorkerExit e;
        e.localRank = w.localRank;
        e.pid = w.pid;
        e.status = w.execErrno ? ExitStatus{0, 0, w.execErrno} : ExitStatus::fromWaitStatus(m.value);
        e.time = std::chrono::system_clock::time_point(
            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                std::chrono::nanoseconds(m.extra)));
        w.exitReported = true;
        exits.push_back(e);
        break;
      }
      default:
        break;
    }
  }
}

std::vector<WorkerExit> SupervisedProcessContext::process() {
  std::vector<WorkerExit> exits;
  epoll_event events[64];
  for (;;) {
    int n = ::epoll_wait(epoll_, events, 64, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) {
      std::size_t index = events[i].data.u64 / 4;
      std::uint64_t kind = events[i].data.u64 % 4;
      if (index >= workers_.size()) continue;
      if (kind == kCtlTag && workers_[index]->ctl >= 0) onControl(index, exits);
      if (kind == kOutTag) onPipe(index, Stream::Stdout, false);
      if (kind == kErrTag) onPipe(index, Stream::Stderr, false);
    }
    if (n < 64) break;
  }
  return exits;
}

void SupervisedProcessContext::send(Worker& w, int type, int value) {
  if (!w.supervisorAlive || w.ctl < 0) return;
  supervisor::Message m;
  m.type = type;
  m.value = value;
  // A supervisor that is exiting may not read it; that is fine.
  while (::send(w.ctl, &m, sizeof m, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EINTR) {
  }
}

void SupervisedProcessContext::signalAll(int signo) {
  for (auto& w : workers_) send(*w, supervisor::kSignal, signo);
}

void SupervisedProcessContext::killAll() {
  for (auto& w : workers_) send(*w, supervisor::kKill, 0);
}

bool SupervisedProcessContext::finished() const {
  for (const auto& w : workers_)
    if (w->supervisorAlive || w->outPipe >= 0 || w->errPipe >= 0) return false;
  return true;
}

std::map<int, pid_t> SupervisedProcessContext::pids() const {
  std::map<int, pid_t> out;
  for (const auto& w : workers_)
    if (!w->exitReported || !out.count(w->localRank)) out[w->localRank] = w->pid;
  return out;
}

} // namespace ctorch::launcher
