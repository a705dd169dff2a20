#include "multiproc.hpp"

#include "ctorch_catch.hpp"
#include "zygote.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <system_error>
#include <thread>

#ifdef CTORCH_TEST_HAS_STORE
#include "ctorch/store/tcp_store_server.hpp"
#endif

extern char** environ;

namespace ctorch::test {

namespace fs = std::filesystem;

namespace {

std::map<std::string, WorkerFn>& registry() {
  static std::map<std::string, WorkerFn> workers;
  return workers;
}

[[noreturn]] void throwErrno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

fs::path tempRoot() {
  const char* t = std::getenv("TMPDIR");
  return fs::path(t && *t ? t : "/tmp");
}

} // namespace

WorkerRegistrar::WorkerRegistrar(const char* name, WorkerFn fn) {
  registry().emplace(name, std::move(fn));
}

std::optional<int> maybeRunWorker(int argc, char** argv) {
  if (argc < 3 || std::string(argv[1]) != "--ctorch-worker") return std::nullopt;
  auto it = registry().find(argv[2]);
  if (it == registry().end()) {
    std::cerr << "no test worker named '" << argv[2] << "'\n";
    return 2;
  }
  // The harness reads stdout and stderr from one file, and tests parse its lines. Both streams are
  // line-buffered with room for the longest line a worker prints (a "final <hex>" line is ~13 kB),
  // and stderr is not tied to stdout: a line is written whole when it ends, so a library message
  // from another thread (a background snapshot write's "snapshot written ...") lands between two
  // lines, never inside one - with the default tie, writing to std::cerr flushed a half-written
  // std::cout line.
  static char outBuffer[1 << 20];
  static char errBuffer[1 << 16];
  std::setvbuf(stdout, outBuffer, _IOLBF, sizeof outBuffer);
  std::setvbuf(stderr, errBuffer, _IOLBF, sizeof errBuffer);
  std::cerr.tie(nullptr);
  std::vector<std::string> args(argv + 3, argv + argc);
  try {
    return it->second(args);
  } catch (const std::exception& e) {
    std::cerr << "worker '" << argv[2] << "' failed: " << e.what() << "\n";
    return 1;
  }
}

std::string ProcessResult::describe() const {
  std::ostringstream os;
  if (timedOut) os << "timed out after " << elapsed.count() << " ms";
  else if (termSignal) os << "signal " << termSignal << " (" << strsignal(termSignal) << ")";
  else os << "exit " << exitCode;
  return os.str();
}

Process::Process(const SpawnOptions& options) {
  if (options.argv.empty()) throw std::invalid_argument("Process: empty argv");
  static std::atomic<int> counter{0};
  outputPath_ = tempRoot() / ("ctorch-test-out-" + std::to_string(::getpid()) + "-" +
                              std::to_string(counter++) + ".log");
  int outFd = ::open(outputPath_.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0600);
  if (outFd < 0) throwErrno("open " + outputPath_.string());

  // Build the environment before fork (no allocation in the child).
  std::map<std::string, std::string> envMap;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) envMap[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& k : options.unsetEnv) envMap.erase(k);
  for (const auto& [k, v] : options.setEnv) envMap[k] = v;
  std::string cwd = options.cwd ? options.cwd->string() : std::string();

  start_ = std::chrono::steady_clock::now();
  deadline_ = start_ + options.timeout;
  // A worker of this binary is forked by the fork server where it would not differ from an exec'd
  // one (zygote.hpp): no exec, no LibTorch start-up.
  if (auto pid = zygote::spawn({options.argv, envMap, cwd, outFd})) {
    pid_ = *pid;
    viaZygote_ = true;
    ::close(outFd);
    return;
  }

  std::vector<std::string> envStrings;
  for (const auto& [k, v] : envMap) envStrings.push_back(k + "=" + v);
  std::vector<char*> envp, argvp;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argvCopy = options.argv;
  for (auto& s : argvCopy) argvp.push_back(s.data());
  argvp.push_back(nullptr);
  pid_t parent = ::getpid();

  pid_ = ::fork();
  if (pid_ < 0) {
    ::close(outFd);
    throwErrno("fork");
  }
  if (pid_ == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(outFd, STDOUT_FILENO);
    ::dup2(outFd, STDERR_FILENO);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    if (devnull > STDERR_FILENO) ::close(devnull);
    if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) ::_exit(127);
    // Restore default signal dispositions that a test framework may have changed.
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execvpe(argvp[0], argvp.data(), envp.data());
    const char msg[] = "exec failed\n";
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::setpgid(pid_, pid_);  // also from the parent, to avoid the race with signalGroup()
  ::close(outFd);
}

Process::~Process() {
  if (!reaped_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    reapKilled();
  }
  std::error_code ec;
  fs::remove(outputPath_, ec);
}

// After SIGKILL: our child is reaped here, the fork server's reports its end (bounded) and reaps it.
void Process::reapKilled() {
  if (viaZygote_) {
    zygote::awaitExit(pid_, std::chrono::seconds(30));
    zygote::release(pid_);
    return;
  }
  int status = 0;
  while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

bool Process::running() {
  if (reaped_) return false;
  int status = 0;
  if (viaZygote_) {
    const auto reported = zygote::exitStatus(pid_);
    if (!reported) return true;
    status = *reported;
  } else if (::waitpid(pid_, &status, WNOHANG) != pid_) {
    return true;
  }
  reaped_ = true;
  result_.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start_);
  if (WIFEXITED(status)) result_.exitCode = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result_.termSignal = WTERMSIG(status);
  // Make sure nothing the child started in its group outlives it.
  ::kill(-pid_, SIGKILL);
  if (viaZygote_) zygote::release(pid_);  // its pid stayed taken until now
  return false;
}

void Process::signalGroup(int signo) {
  if (!reaped_) ::kill(-pid_, signo);
}

ProcessResult Process::wait() {
  while (running()) {
    if (std::chrono::steady_clock::now() >= deadline_) {
      result_.timedOut = true;
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      reapKilled();
      reaped_ = true;
      result_.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - start_);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  result_.output = outputSoFar();
  return result_;
}

std::string Process::outputSoFar() const {
  return readFile(outputPath_);
}

ProcessResult run(const SpawnOptions& options) {
  Process p(options);
  return p.wait();
}

namespace {

// One run of the group with MASTER_PORT = port (0: not set) and `storeEnv` under the test's env.
std::vector<ProcessResult> runGroupOnce(const WorkerGroupOptions& options, int port,
                                        const std::map<std::string, std::string>& storeEnv) {
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  std::vector<std::unique_ptr<Process>> procs;
  for (int rank = 0; rank < options.worldSize; ++rank) {
    SpawnOptions so;
    so.argv = {selfExe().string(), "--ctorch-worker", options.worker};
    so.argv.insert(so.argv.end(), options.args.begin(), options.args.end());
    so.timeout = options.timeout;
    // Start from a clean slate: the test itself may run under a launcher or Slurm.
    so.unsetEnv = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE",
                   "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
                   "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID",
                   "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODEID", "SLURM_NNODES"};
    if (options.torchrunEnv) {
      so.setEnv = {{"RANK", std::to_string(rank)},
                   {"LOCAL_RANK", std::to_string(rank)},
                   {"WORLD_SIZE", std::to_string(options.worldSize)},
                   {"LOCAL_WORLD_SIZE", std::to_string(options.worldSize)},
                   {"GROUP_RANK", "0"},
                   {"MASTER_ADDR", options.masterAddr}};
      if (port) so.setEnv["MASTER_PORT"] = std::to_string(port);
      for (const auto& [k, v] : storeEnv) so.setEnv[k] = v;
    }
    so.setEnv["OMP_NUM_THREADS"] = "1";
    for (const auto& [k, v] : options.env) so.setEnv[k] = v;
    if (auto it = options.rankEnv.find(rank); it != options.rankEnv.end())
      for (const auto& [k, v] : it->second) so.setEnv[k] = v;
    procs.push_back(std::make_unique<Process>(so));
  }
  // Wait for all; if any rank fails, give the others a short grace (they may be blocked in a
  // collective with it) and then kill them, so a failing test never waits for the full timeout.
  std::vector<ProcessResult> results(procs.size());
  std::vector<bool> done(procs.size(), false);
  std::optional<std::chrono::steady_clock::time_point> failDeadline;
  size_t remaining = procs.size();
  while (remaining > 0) {
    auto now = std::chrono::steady_clock::now();
    for (size_t i = 0; i < procs.size(); ++i) {
      if (done[i]) continue;
      bool expired = now >= deadline || (failDeadline && now >= *failDeadline);
      if (!procs[i]->running() || expired) {
        if (expired && procs[i]->running()) procs[i]->signalGroup(SIGKILL);
        results[i] = procs[i]->wait();
        if (expired && results[i].termSignal == SIGKILL) results[i].timedOut = true;
        done[i] = true;
        --remaining;
        const bool expectedExit = !results[i].timedOut && results[i].termSignal == 0 &&
                                  options.expectedExitCodes.count(results[i].exitCode) > 0;
        if (!results[i].ok() && !expectedExit && !failDeadline)
          failDeadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return results;
}

} // namespace

std::vector<ProcessResult> runWorkerGroup(const WorkerGroupOptions& options) {
  if (!options.torchrunEnv || options.masterPort != 0) return runGroupOnce(options, options.masterPort, {});
  if (options.store == StoreHost::kHarness && HostedStore::available()) {
    HostedStore store;  // outlives every rank: runGroupOnce reaps them all
    return runGroupOnce(options, store.port(),
                        {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "0"}});
  }
  return withFreshPort([&](int port) { return runGroupOnce(options, port, {}); });
}

void requireAllOk(const std::vector<ProcessResult>& results) {
  bool allOk = true;
  std::ostringstream os;
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].ok()) allOk = false;
    os << "---- rank " << r << ": " << results[r].describe() << " ----\n" << results[r].output << "\n";
  }
  INFO(os.str());
  REQUIRE(allOk);
}

fs::path selfExe() {
  return fs::read_symlink("/proc/self/exe");
}

int fixedPortCandidate() {
  // The ephemeral range's low end (Linux's default 32768); ports from 20000 up to it. Below 20000
  // lie the lab's Slurm controllers (scripts/lab/slurm.sh: 10000-19999).
  int low = 32768, high = 60999;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  if (!(range >> low >> high)) low = 32768;
  constexpr int kFirst = 20000;
  if (low <= kFirst + 100)
    throw std::runtime_error("the ephemeral port range starts at " + std::to_string(low) +
                             " (/proc/sys/net/ipv4/ip_local_port_range): no room below it for a fixed test port");
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
  return std::uniform_int_distribution<int>(kFirst, low - 1)(rng);
}

bool portTaken(const std::string& output) {
  for (const char* says : {"port already in use", "Address already in use", "address already in use",
                           "EADDRINUSE", "errno: 98", "Errno 98"})
    if (output.find(says) != std::string::npos) return true;
  return false;
}

bool portTaken(const ProcessResult& result) { return portTaken(result.output); }

bool portTaken(const std::vector<ProcessResult>& results) {
  for (const auto& r : results)
    if (portTaken(r)) return true;
  return false;
}

ReservedPort::ReservedPort() {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throwErrno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;  // no SO_REUSEADDR and no listen(): refused to connectors, unbindable to others
  socklen_t len = sizeof(addr);
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int e = errno;
    ::close(fd_);
    errno = e;
    throwErrno("bind 127.0.0.1:0");
  }
  port_ = ntohs(addr.sin_port);
}

ReservedPort::~ReservedPort() {
  if (fd_ >= 0) ::close(fd_);
}

#ifdef CTORCH_TEST_HAS_STORE
struct HostedStore::Impl {
  explicit Impl(store::TcpStoreServerOptions o) : server(std::move(o)) {}
  store::TcpStoreServer server;
};

namespace {
store::TcpStoreServerOptions loopbackStore() {
  store::TcpStoreServerOptions o;
  o.host = "127.0.0.1";  // port 0: the server binds any and says which
  return o;
}
} // namespace

HostedStore::HostedStore() : HostedStore(std::make_unique<Impl>(loopbackStore())) {}

HostedStore HostedStore::rendezvous() {
  auto o = loopbackStore();
  o.ephemeralKeyPrefix = "/ctorchrun.alive/";  // what a hosting agent sets (c10d_rendezvous_impl.hpp)
  return HostedStore(std::make_unique<Impl>(std::move(o)));
}

int HostedStore::port() const { return impl_->server.port(); }
bool HostedStore::available() { return true; }
#else
struct HostedStore::Impl {};
HostedStore::HostedStore() { throw std::logic_error("HostedStore: built without ctorchrun's store (CTORCH_BUILD_LAUNCHER=OFF)"); }
HostedStore HostedStore::rendezvous() { return HostedStore(); }
int HostedStore::port() const { return 0; }
bool HostedStore::available() { return false; }
#endif

HostedStore::HostedStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HostedStore::~HostedStore() = default;
HostedStore::HostedStore(HostedStore&&) noexcept = default;
HostedStore& HostedStore::operator=(HostedStore&&) noexcept = default;

TempDir::TempDir(const std::string& tag) {
  std::string templ = (tempRoot() / (tag + "-XXXXXX")).string();
  if (!::mkdtemp(templ.data())) throwErrno("mkdtemp " + templ);
  path_ = templ;
}

namespace {
int removeEntry(const char* path, const struct stat*, int type, struct FTW*) {
  if (type == FTW_DP) ::rmdir(path);
  else ::unlink(path);
  return 0;  // keep going: remove what can be removed
}
} // namespace

// Not std::filesystem::remove_all: pip's LibTorch wheels export their own statically linked copies of
// libstdc++'s directory iterators (pytorch/pytorch#133437), which interpose on the system's inside
// remove_all; on the GPU machine (torch 2.11) that crashed the test binary here.
TempDir::~TempDir() { ::nftw(path_.c_str(), removeEntry, 16, FTW_DEPTH | FTW_PHYS); }

std::string readFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

std::vector<Listener> listenersOf(int pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  for (const auto& fd : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    const std::string target = fs::read_symlink(fd.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<Listener> out;
  for (const bool v6 : {false, true}) {
    std::ifstream in(v6 ? "/proc/net/tcp6" : "/proc/net/tcp");
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos || !inodes.count(inode)) continue;  // 0A: LISTEN
      out.push_back({local.substr(0, colon), std::stoi(local.substr(colon + 1), nullptr, 16), v6});
    }
  }
  return out;
}

void writeFile(const fs::path& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw std::runtime_error("cannot write " + path.string());
  out << content;
}

} // namespace ctorch::test

// ==== The fork server (zygote.hpp) ==================================================================
// The zygote is forked at the start of main(), when the test process has run nothing but static
// initializers. A worker forked from it is what an exec'd worker is at that point, given what
// chooseRoute checks: the same load-time environment, the same inherited process attributes. The
// test process and the zygote talk over a SOCK_SEQPACKET socketpair, one request or report per
// message: spawn (with the output file's descriptor), spawned, exited, release, adopt, ready.
namespace ctorch::test::zygote {

namespace {

constexpr char kZygoteFlag[] = "--ctorch-zygote";
constexpr std::size_t kMaxMessage = 192 * 1024;  // under the socket's default send buffer

enum : std::uint32_t { kSpawn = 1, kSpawned, kExited, kRelease, kAdopt, kReady };

struct Header {
  std::uint32_t type = 0;
  std::int32_t pid = 0;       // kSpawned: the worker (or -errno); kExited, kRelease: whose
  std::int32_t a = 0;         // kSpawn: argc; kExited: wait status; kReady: threads at start (or -errno)
  std::int32_t b = 0;         // kSpawn, kAdopt: variables; kReady: threads after a fork
  std::uint64_t ignored = 0;  // kSpawn: the signals the requester ignores (bit n-1: signal n)
};

struct Message {
  Header header;
  std::vector<std::string> strings;  // the payload: NUL-terminated strings
  int fd = -1;                       // passed with it (SCM_RIGHTS); the receiver closes it
};

std::string encode(const Header& header, const std::vector<std::string>& strings) {
  std::string out(reinterpret_cast<const char*>(&header), sizeof header);
  for (const auto& s : strings) {
    out += s;
    out.push_back('\0');
  }
  return out;
}

// One message, with `fd` when >= 0; false when the peer is gone or the message does not fit.
bool sendMessage(int sock, const std::string& bytes, int fd = -1) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  for (;;) {
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return static_cast<std::size_t>(n) == bytes.size();
    if (errno != EINTR) return false;
  }
}

bool sendHeader(int sock, const Header& header) { return sendMessage(sock, encode(header, {})); }

enum class Received { kMessage, kNone, kClosed };

// One message if one is there (never blocks: callers poll); kClosed at EOF or on a broken message.
Received receiveMessage(int sock, Message& out) {
  static std::vector<char> buffer(kMaxMessage + 1);
  iovec iov{buffer.data(), buffer.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  while ((n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT)) < 0 && errno == EINTR) {
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Received::kNone;
  out = Message{};
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
      std::memcpy(&out.fd, CMSG_DATA(c), sizeof(int));
  if (n < static_cast<ssize_t>(sizeof(Header)) || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
    if (out.fd >= 0) ::close(out.fd);
    out.fd = -1;
    return Received::kClosed;
  }
  std::memcpy(&out.header, buffer.data(), sizeof(Header));
  for (std::size_t at = sizeof(Header); at < static_cast<std::size_t>(n);) {
    const char* s = buffer.data() + at;
    const std::size_t len = ::strnlen(s, static_cast<std::size_t>(n) - at);
    out.strings.emplace_back(s, len);
    at += len + 1;
  }
  return Received::kMessage;
}

int countThreads() {
  int n = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator("/proc/self/task", ec); !ec && it != fs::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

// The threads left after a fork of this process: pools that shut down in a fork handler (OpenBLAS's)
// do not count, as they do not exist in the child.
int threadsAfterAFork() {
  const pid_t probe = ::fork();
  if (probe == 0) ::_exit(0);
  if (probe > 0)
    while (::waitpid(probe, nullptr, 0) < 0 && errno == EINTR) {
    }
  return countThreads();
}

Environment currentEnvironment() {
  Environment env;
  for (char** e = environ; *e; ++e) {
    const std::string_view kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string_view::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

std::vector<std::string> environmentStrings(const Environment& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::uint64_t ignoredSignals() {
  std::uint64_t mask = 0;
  for (int sig = 1; sig < NSIG && sig <= 64; ++sig) {
    struct sigaction a {};
    if (::sigaction(sig, nullptr, &a) == 0 && a.sa_handler == SIG_IGN) mask |= std::uint64_t{1} << (sig - 1);
  }
  return mask;
}

// What a child inherits from the thread that forks it, besides the environment, the working
// directory and the signal dispositions (which a spawn request carries).
struct Inherited {
  std::string umask;
  std::vector<std::pair<rlim_t, rlim_t>> limits;
  int nice = 0;
  cpu_set_t affinity{};
  uid_t euid = 0;
  gid_t egid = 0;
  std::set<std::array<unsigned long long, 3>> descriptors;  // (fd, device, inode) without FD_CLOEXEC, above 2
};

Inherited inheritedNow() {
  Inherited in;
  {
    std::ifstream status("/proc/self/status");  // closed before the descriptors are listed
    for (std::string line; std::getline(status, line);)
      if (line.rfind("Umask:", 0) == 0) in.umask = line;
  }
  for (int r = 0; r < RLIM_NLIMITS; ++r) {
    rlimit rl{};
    ::getrlimit(static_cast<__rlimit_resource_t>(r), &rl);
    in.limits.emplace_back(rl.rlim_cur, rl.rlim_max);
  }
  errno = 0;
  in.nice = ::getpriority(PRIO_PROCESS, 0);  // the calling thread's, which its children get
  CPU_ZERO(&in.affinity);
  ::sched_getaffinity(0, sizeof in.affinity, &in.affinity);
  in.euid = ::geteuid();
  in.egid = ::getegid();
  std::error_code ec;
  for (auto it = fs::directory_iterator("/proc/self/fd", ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const int fd = std::atoi(it->path().filename().c_str());
    const int flags = ::fcntl(fd, F_GETFD);
    struct stat st {};
    if (fd <= 2 || flags < 0 || (flags & FD_CLOEXEC) || ::fstat(fd, &st) != 0) continue;
    in.descriptors.insert({static_cast<unsigned long long>(fd), static_cast<unsigned long long>(st.st_dev),
                           static_cast<unsigned long long>(st.st_ino)});
  }
  return in;
}

// What differs, in a few words ("" when nothing does).
std::string inheritedDifference(const Inherited& then, const Inherited& now) {
  if (then.umask != now.umask) return "umask changed";
  for (std::size_t r = 0; r < then.limits.size() && r < now.limits.size(); ++r)
    if (then.limits[r] != now.limits[r]) return "resource limit " + std::to_string(r) + " changed";
  if (then.nice != now.nice) return "nice value changed";
  if (!CPU_EQUAL(&then.affinity, &now.affinity)) return "CPU affinity changed";
  if (then.euid != now.euid || then.egid != now.egid) return "credentials changed";
  if (then.descriptors != now.descriptors) {
    std::vector<std::array<unsigned long long, 3>> changed;
    std::set_symmetric_difference(then.descriptors.begin(), then.descriptors.end(), now.descriptors.begin(),
                                  now.descriptors.end(), std::back_inserter(changed));
    const std::string fd = std::to_string(changed.front()[0]);
    std::error_code ec;
    return "inheritable descriptor " + fd + " (" + fs::read_symlink("/proc/self/fd/" + fd, ec).string() +
           ") opened or closed since main() began";
  }
  return "";
}

// ---- The server ----------------------------------------------------------------------------------

struct Server {
  int sock = -1;
  int sigchld = -1;  // signalfd
  pid_t self = 0;
  pid_t client = 0;
  void (*onWorkerStart)() = nullptr;
  std::set<pid_t> running;     // forked, end not reported
  std::set<pid_t> unreleased;  // end reported: a zombie until the client releases it
  std::set<pid_t> reapOnExit;  // released while running
};

// In the forked child: what exec and the test main give a worker, then the worker.
[[noreturn]] void becomeWorker(Server& s, const Message& m) {
  ::close(s.sock);
  ::close(s.sigchld);
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != s.self) ::_exit(127);
  const int argc = m.header.a, envc = m.header.b;
  const std::string& requesterCwd = m.strings[0];
  const std::string& cwd = m.strings[1];
  ::dup2(m.fd, STDOUT_FILENO);
  ::dup2(m.fd, STDERR_FILENO);
  if (m.fd > STDERR_FILENO) ::close(m.fd);
  const int devnull = ::open("/dev/null", O_RDONLY);
  if (devnull >= 0 && devnull != STDIN_FILENO) {
    ::dup2(devnull, STDIN_FILENO);
    ::close(devnull);
  }
  if (::chdir(requesterCwd.c_str()) != 0) ::_exit(127);
  if (!cwd.empty() && ::chdir(cwd.c_str()) != 0) ::_exit(127);
  // exec's signal state: handlers back to the default, what the requester ignores stays ignored;
  // the mask empty, as Process gives an exec'd child.
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    struct sigaction a {};
    a.sa_handler = sig <= 64 && (m.header.ignored >> (sig - 1) & 1) ? SIG_IGN : SIG_DFL;
    sigemptyset(&a.sa_mask);
    ::sigaction(sig, &a, nullptr);  // the C library's own signals refuse: nothing to do there
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  ::clearenv();
  for (int i = 0; i < envc; ++i) {
    const std::string& kv = m.strings[2 + argc + i];
    const auto eq = kv.find('=');
    if (eq != std::string::npos) ::setenv(kv.substr(0, eq).c_str(), kv.c_str() + eq + 1, 1);
  }
  s.onWorkerStart();  // what the test main does first
  std::vector<std::string> args(m.strings.begin() + 2, m.strings.begin() + 2 + argc);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const auto rc = maybeRunWorker(argc, argv.data());
  std::exit(rc ? *rc : 2);  // as main returning: stdio flushed, static objects destroyed
}

void forkWorker(Server& s, Message& m) {
  const bool wellFormed = m.fd >= 0 && m.header.a >= 3 && m.header.b >= 0 &&
                          m.strings.size() == static_cast<std::size_t>(2 + m.header.a + m.header.b);
  Header reply;
  reply.type = kSpawned;
  if (!wellFormed) {
    reply.pid = -EINVAL;
  } else if (const pid_t pid = ::fork(); pid == 0) {
    becomeWorker(s, m);
  } else if (pid < 0) {
    reply.pid = -errno;
  } else {
    ::setpgid(pid, pid);  // its group exists before the requester hears of it
    s.running.insert(pid);
    reply.pid = pid;
  }
  if (m.fd >= 0) ::close(m.fd);
  sendHeader(s.sock, reply);
}

// Reports every child that ended; it stays a zombie until released (kRelease).
void reportEnds(Server& s) {
  for (auto it = s.running.begin(); it != s.running.end();) {
    const pid_t pid = *it;
    const bool released = s.reapOnExit.count(pid) > 0;
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | (released ? 0 : WNOWAIT)) != 0 ||
        info.si_pid != pid) {
      ++it;
      continue;
    }
    it = s.running.erase(it);
    if (released) {
      s.reapOnExit.erase(pid);
      continue;
    }
    Header h;
    h.type = kExited;
    h.pid = pid;
    h.a = info.si_code == CLD_EXITED ? (info.si_status & 0xff) << 8
                                     : (info.si_status & 0x7f) | (info.si_code == CLD_DUMPED ? 0x80 : 0);
    s.unreleased.insert(pid);
    sendHeader(s.sock, h);
  }
}

void releaseChild(Server& s, pid_t pid) {
  if (s.unreleased.erase(pid)) {
    while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  } else if (s.running.count(pid)) {
    s.reapOnExit.insert(pid);
  }
}

// Kills what is left (its test process has ended or closed the socket) and reaps it, bounded.
[[noreturn]] void stopServing(Server& s) {
  std::set<pid_t> all = s.running;
  all.insert(s.unreleased.begin(), s.unreleased.end());
  for (pid_t pid : all) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!all.empty() && std::chrono::steady_clock::now() < until) {
    for (auto it = all.begin(); it != all.end();) {
      const pid_t r = ::waitpid(*it, nullptr, WNOHANG);
      it = r == *it || (r < 0 && errno != EINTR) ? all.erase(it) : std::next(it);
    }
    if (!all.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::_exit(0);
}

// Re-executes this binary as the zygote with `env`: what a worker with that environment loads.
// Only while it has no child. Answers kReady from the new image, or with -errno here.
void adopt(Server& s, const Message& m) {
  Header refused;
  refused.type = kReady;
  if (!s.running.empty() || !s.unreleased.empty()) {
    refused.a = -EBUSY;
    sendHeader(s.sock, refused);
    return;
  }
  std::vector<char*> envp;
  std::vector<std::string> strings = m.strings;
  for (auto& kv : strings) envp.push_back(kv.data());
  envp.push_back(nullptr);
  std::string exe = selfExe().string(), flag = kZygoteFlag, sock = std::to_string(s.sock),
              client = std::to_string(s.client);
  char* argv[] = {exe.data(), flag.data(), sock.data(), client.data(), nullptr};
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);  // as an exec'd worker starts
  ::fcntl(s.sock, F_SETFD, 0);
  ::execve(exe.c_str(), argv, envp.data());
  refused.a = -errno;
  sendHeader(s.sock, refused);
  ::_exit(127);
}

[[noreturn]] void serve(Server& s) {
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &chld, nullptr);
  s.sigchld = ::signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
  if (s.sigchld < 0) ::_exit(1);  // the client reads EOF and execs from then on
  for (;;) {
    pollfd fds[2] = {{s.sock, POLLIN, 0}, {s.sigchld, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      stopServing(s);
    }
    if (fds[1].revents) {
      signalfd_siginfo info;
      while (::read(s.sigchld, &info, sizeof info) > 0) {
      }
      reportEnds(s);
    }
    if (!fds[0].revents) continue;
    Message m;
    const Received r = receiveMessage(s.sock, m);
    if (r == Received::kNone) continue;
    if (r == Received::kClosed) stopServing(s);
    switch (m.header.type) {
      case kSpawn: forkWorker(s, m); break;
      case kRelease: releaseChild(s, m.header.pid); break;
      case kAdopt: adopt(s, m); break;
      default:
        if (m.fd >= 0) ::close(m.fd);
    }
  }
}

// ---- The client ------------------------------------------------------------------------------------

struct Client {
  std::mutex mutex;
  int fd = -1;
  pid_t zygote = -1;
  pid_t owner = -1;             // the process that forked the zygote (not a fork of it)
  std::string trace;
  Environment image;            // the environment the zygote's image loaded with
  Inherited inheritedAtStart;   // this process's attributes when the zygote was forked
  std::map<pid_t, int> ended;   // wait statuses reported and not yet collected
  std::set<pid_t> live;         // spawned, end not yet reported
  Status status;

  ~Client() {
    std::lock_guard<std::mutex> lock(mutex);
    stop("");
  }

  // CTORCH_TEST_ZYGOTE_TRACE=1: to stderr; another value: appended to that file (one write a line).
  void say(const std::string& line) const {
    if (trace.empty()) return;
    const std::string text = "ctorch test zygote: [" + std::to_string(::getpid()) + "] " + line + "\n";
    if (trace == "1") {
      std::fputs(text.c_str(), stderr);
      return;
    }
    const int fd = ::open(trace.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return;
    [[maybe_unused]] auto n = ::write(fd, text.data(), text.size());
    ::close(fd);
  }

  // Closes the socket (the zygote then kills and reaps what is left, and exits) and reaps the zygote.
  void stop(const std::string& why) {
    if (fd < 0 || owner != ::getpid()) return;
    ::close(fd);
    fd = -1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    while (::waitpid(zygote, nullptr, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= until) {
        ::kill(zygote, SIGKILL);
        while (::waitpid(zygote, nullptr, 0) < 0 && errno == EINTR) {
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    // Its children died with it (PR_SET_PDEATHSIG) or by its hand.
    for (pid_t pid : live) ended[pid] = SIGKILL;
    live.clear();
    status.running = false;
    if (!why.empty()) {
      status.unavailable = why;
      say("unavailable: " + why);
    }
  }

  void take(const Message& m) {
    if (m.fd >= 0) ::close(m.fd);
    if (m.header.type == kExited && live.erase(m.header.pid)) ended[m.header.pid] = m.header.a;
  }

  // Takes every report waiting (never blocks).
  void drain() {
    while (fd >= 0) {
      Message m;
      const Received r = receiveMessage(fd, m);
      if (r == Received::kNone) return;
      if (r == Received::kClosed) return stop("the zygote ended");
      take(m);
    }
  }

  // Waits (bounded) for the answer of type `type`, taking reports meanwhile.
  std::optional<Message> await(std::uint32_t type, std::chrono::milliseconds bound) {
    const auto until = std::chrono::steady_clock::now() + bound;
    while (fd >= 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        ::kill(zygote, SIGKILL);
        stop("the zygote did not answer within " + std::to_string(bound.count()) + " ms");
        return std::nullopt;
      }
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000))) <= 0) continue;
      Message m;
      const Received r = receiveMessage(fd, m);
      if (r == Received::kNone) continue;
      if (r == Received::kClosed) {
        stop("the zygote ended");
        return std::nullopt;
      }
      if (m.header.type == type) return m;
      take(m);
    }
    return std::nullopt;
  }

  bool adoptEnvironment(const Environment& env) {
    if (!sendMessage(fd, encode({kAdopt, 0, 0, static_cast<std::int32_t>(env.size()), 0}, environmentStrings(env)))) {
      stop(std::string("cannot reach the zygote: ") + std::strerror(errno));
      return false;
    }
    // The new image starts as a worker does (LibTorch's start-up, under whatever load there is).
    const auto ready = await(kReady, std::chrono::seconds(120));
    if (!ready) return false;
    if (ready->header.a == -EBUSY) return false;  // a child not yet released: exec this one
    if (ready->header.a < 0) {
      stop(std::string("re-executing the zygote failed: ") + std::strerror(-ready->header.a));
      return false;
    }
    status.zygoteThreads = ready->header.a;
    if (ready->header.b != 1) {
      stop("the re-executed zygote has " + std::to_string(ready->header.a) + " threads (" +
           std::to_string(ready->header.b) + " after a fork): forking it is not safe");
      return false;
    }
    ++status.reexecuted;
    image = env;
    say("re-executed with the workers' environment: " + std::to_string(ready->header.a) + " thread(s) at start");
    return true;
  }
};

Client& client() {
  static Client c;
  return c;
}

std::string describe(const std::vector<std::string>& argv) {
  return argv.size() >= 3 ? argv[1] + " " + argv[2] : argv.empty() ? std::string() : argv[0];
}

bool noZygoteRequested() {
  const char* v = std::getenv("CTORCH_TEST_NO_ZYGOTE");
  return v && std::string(v) == "1";
}

} // namespace

bool readOnlyAtRuntime(std::string_view name) {
  static const std::set<std::string_view> exact = {
      "RANK",           "LOCAL_RANK",      "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
      "GROUP_WORLD_SIZE", "ROLE_RANK",     "ROLE_WORLD_SIZE", "ROLE_NAME",   "MASTER_ADDR",
      "MASTER_PORT"};
  if (exact.count(name)) return true;
  for (std::string_view prefix : {"TORCHELASTIC_", "CTORCH_", "SLURM_", "PET_"})
    if (name.substr(0, prefix.size()) == prefix) return true;
  return false;
}

std::optional<std::string> loadTimeDifference(const Environment& image, const Environment& requested) {
  auto i = image.begin();
  auto r = requested.begin();
  while (i != image.end() || r != requested.end()) {
    std::string_view name;
    if (r == requested.end() || (i != image.end() && i->first < r->first)) {
      name = (i++)->first;
    } else if (i == image.end() || r->first < i->first) {
      name = (r++)->first;
    } else {
      const bool same = i->second == r->second;
      name = i->first;
      ++i, ++r;
      if (same) continue;
    }
    if (!readOnlyAtRuntime(name)) return std::string(name);
  }
  return std::nullopt;
}

RouteChoice chooseRoute(const RouteFacts& facts) {
  if (facts.disabled) return {Route::kExec, "no zygote"};
  if (!facts.selfWorker) return {Route::kExec, "not a worker of this binary"};
  if (!facts.processDifference.empty()) return {Route::kExec, facts.processDifference};
  if (facts.envDifference) {
    const std::string why = *facts.envDifference + " differs from the zygote's";
    return facts.adoptable ? RouteChoice{Route::kAdopt, why} : RouteChoice{Route::kExec, why};
  }
  return {Route::kFork, ""};
}

std::optional<int> start(int argc, char** argv, void (*onWorkerStart)()) {
  if (argc >= 4 && std::string(argv[1]) == kZygoteFlag) {
    // Re-executed by adopt(): serve if forking this image is safe.
    Server s;
    s.sock = std::atoi(argv[2]);
    s.client = static_cast<pid_t>(std::atoi(argv[3]));
    s.self = ::getpid();
    s.onWorkerStart = onWorkerStart;
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != s.client) return 1;
    ::fcntl(s.sock, F_SETFD, FD_CLOEXEC);
    Header ready;
    ready.type = kReady;
    ready.a = countThreads();
    ready.b = ready.a == 1 ? 1 : threadsAfterAFork();
    sendHeader(s.sock, ready);
    if (ready.b != 1) return 0;
    serve(s);
  }
  if (argc >= 2 && std::string(argv[1]) == "--ctorch-worker") return std::nullopt;  // workers exec theirs
  Client& c = client();
  if (const char* trace = std::getenv("CTORCH_TEST_ZYGOTE_TRACE")) c.trace = trace;
  if (noZygoteRequested()) {
    c.status.unavailable = "CTORCH_TEST_NO_ZYGOTE=1";
    return std::nullopt;
  }
  c.status.threadsBeforeFork = countThreads();
  c.image = currentEnvironment();
  c.inheritedAtStart = inheritedNow();
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) {
    c.status.unavailable = std::string("socketpair: ") + std::strerror(errno);
    return std::nullopt;
  }
  std::fflush(nullptr);  // nothing buffered is written twice
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(0);
    Server s;
    s.sock = fds[1];
    s.self = ::getpid();
    s.client = parent;
    s.onWorkerStart = onWorkerStart;
    serve(s);
  }
  ::close(fds[1]);
  if (pid < 0) {
    ::close(fds[0]);
    c.status.unavailable = std::string("fork: ") + std::strerror(errno);
    return std::nullopt;
  }
  c.fd = fds[0];
  c.zygote = pid;
  c.owner = parent;
  c.status.running = true;
  // The zygote is a copy of this process at the fork: sound only if no other thread was running then
  // (a fork handler may have ended one: OpenBLAS joins its pool).
  c.status.threadsAfterFork = countThreads();
  if (c.status.threadsAfterFork != 1) {
    std::lock_guard<std::mutex> lock(c.mutex);
    c.stop(std::to_string(c.status.threadsAfterFork) + " threads at the start of main(): forking is not safe");
  } else {
    c.say("pid " + std::to_string(pid) + " serves this process (" + std::to_string(c.status.threadsBeforeFork) +
          " thread(s) at the start of main(), 1 after the fork)");
  }
  return std::nullopt;
}

std::optional<int> spawn(const SpawnRequest& request) {
  Client& c = client();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.drain();
  RouteFacts facts;
  facts.disabled = c.fd < 0 || c.owner != ::getpid() || noZygoteRequested();
  facts.selfWorker = request.argv.size() >= 3 && request.argv[1] == "--ctorch-worker" &&
                     request.argv[0] == selfExe().string();
  if (!facts.disabled && facts.selfWorker) {
    facts.processDifference = inheritedDifference(c.inheritedAtStart, inheritedNow());
    facts.envDifference = loadTimeDifference(c.image, request.env);
    facts.adoptable = c.live.empty() && c.ended.empty();
  }
  RouteChoice choice = chooseRoute(facts);
  std::error_code ec;
  const fs::path here = fs::current_path(ec);
  if (choice.route != Route::kExec && ec) choice = {Route::kExec, "no working directory"};
  if (choice.route == Route::kAdopt) {
    c.say("re-executing: " + choice.reason);
    if (!c.adoptEnvironment(request.env)) choice = {Route::kExec, choice.reason + ", and re-executing failed"};
  }
  if (choice.route == Route::kExec) {
    ++c.status.execed;
    if (facts.selfWorker) c.say("exec " + describe(request.argv) + ": " + choice.reason);
    return std::nullopt;
  }
  std::vector<std::string> strings = {here.string(), request.cwd};
  strings.insert(strings.end(), request.argv.begin(), request.argv.end());
  for (auto& kv : environmentStrings(request.env)) strings.push_back(std::move(kv));
  const std::string bytes = encode({kSpawn, 0, static_cast<std::int32_t>(request.argv.size()),
                                    static_cast<std::int32_t>(request.env.size()), ignoredSignals()},
                                   strings);
  if (bytes.size() > kMaxMessage || !sendMessage(c.fd, bytes, request.outputFd)) {
    ++c.status.execed;
    c.say("exec " + describe(request.argv) + ": the request (" + std::to_string(bytes.size()) +
          " bytes) did not reach the zygote");
    return std::nullopt;
  }
  const auto reply = c.await(kSpawned, std::chrono::seconds(60));
  if (!reply || reply->header.pid <= 0) {
    ++c.status.execed;
    c.say("exec " + describe(request.argv) + ": the zygote could not fork" +
          (reply ? std::string(": ") + std::strerror(-reply->header.pid) : std::string()));
    return std::nullopt;
  }
  ++c.status.forked;
  c.live.insert(reply->header.pid);
  c.say("forked pid " + std::to_string(reply->header.pid) + ": " + describe(request.argv));
  return reply->header.pid;
}

std::optional<int> exitStatus(int pid) {
  Client& c = client();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.drain();
  const auto it = c.ended.find(pid);
  if (it == c.ended.end()) return std::nullopt;
  const int status = it->second;
  c.ended.erase(it);
  return status;
}

int awaitExit(int pid, std::chrono::milliseconds bound) {
  const auto until = std::chrono::steady_clock::now() + bound;
  for (;;) {
    if (const auto status = exitStatus(pid)) return *status;
    if (std::chrono::steady_clock::now() >= until) return SIGKILL;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void release(int pid) {
  Client& c = client();
  std::lock_guard<std::mutex> lock(c.mutex);
  c.ended.erase(pid);
  c.live.erase(pid);
  if (c.fd >= 0) sendHeader(c.fd, {kRelease, pid, 0, 0, 0});
}

Status status() {
  Client& c = client();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.status;
}

} // namespace ctorch::test::zygote
