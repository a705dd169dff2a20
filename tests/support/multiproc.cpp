#include "multiproc.hpp"

#include "ctorch_catch.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
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
  std::vector<std::string> envStrings;
  for (const auto& [k, v] : envMap) envStrings.push_back(k + "=" + v);
  std::vector<char*> envp, argvp;
  for (auto& s : envStrings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argvCopy = options.argv;
  for (auto& s : argvCopy) argvp.push_back(s.data());
  argvp.push_back(nullptr);
  std::string cwd = options.cwd ? options.cwd->string() : std::string();
  pid_t parent = ::getpid();

  start_ = std::chrono::steady_clock::now();
  deadline_ = start_ + options.timeout;
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
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  std::error_code ec;
  fs::remove(outputPath_, ec);
}

bool Process::running() {
  if (reaped_) return false;
  int status = 0;
  pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    result_.elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start_);
    if (WIFEXITED(status)) result_.exitCode = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) result_.termSignal = WTERMSIG(status);
    // Make sure nothing the child started in its group outlives it.
    ::kill(-pid_, SIGKILL);
    return false;
  }
  return true;
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
      int status = 0;
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
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
