// Tests of the multi-node lab itself (label `lab`): namespace hosts really are separate hosts,
// failures really happen, teardown really leaves nothing, and the Slurm cluster behaves like one.
// TCP checks run this binary's own workers inside the hosts (no ping here, no Python needed).
#include "ctorch_catch.hpp"

#include "lab.hpp"
#include "multiproc.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

using namespace ctorch::test;
using namespace ctorch::test::lab;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// ---- TCP workers, run inside lab hosts ----------------------------------------------------------------
constexpr int kProbeOk = 0, kProbeRefused = 1, kProbeTimeout = 2, kProbeError = 3;

std::string hostName() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

} // namespace

// tcp_serve ADDR [PORT]: listens on ADDR, port PORT (0: any, the default); prints "port N"; answers
// each connection with its hostname.
CTORCH_TEST_WORKER(tcp_serve) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (args.size() > 1) a.sin_port = htons(static_cast<uint16_t>(std::stoi(args[1])));
  if (::inet_pton(AF_INET, args.at(0).c_str(), &a.sin_addr) != 1) return 3;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) return 4;
  if (::listen(fd, 16) != 0) return 5;
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  std::printf("port %d\n", ntohs(a.sin_port));
  std::fflush(stdout);
  std::string reply = hostName() + "\n";
  for (;;) {
    int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) continue;
    [[maybe_unused]] auto n = ::write(c, reply.data(), reply.size());
    ::close(c);
  }
}

// tcp_probe ADDR PORT TIMEOUT_MS: connects and prints the peer's reply. Exit codes: kProbe*.
CTORCH_TEST_WORKER(tcp_probe) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(args.at(1))));
  if (::inet_pton(AF_INET, args.at(0).c_str(), &a.sin_addr) != 1) return kProbeError;
  int timeoutMs = std::stoi(args.at(2));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    std::printf("connect: %s\n", std::strerror(errno));
    return errno == ECONNREFUSED ? kProbeRefused : kProbeError;
  }
  pollfd p{fd, POLLOUT, 0};
  if (::poll(&p, 1, timeoutMs) == 0) {
    std::printf("connect: timed out\n");
    return kProbeTimeout;
  }
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    std::printf("connect: %s\n", std::strerror(err));
    return err == ECONNREFUSED ? kProbeRefused : kProbeError;
  }
  p = {fd, POLLIN, 0};
  if (::poll(&p, 1, timeoutMs) == 0) {
    std::printf("read: timed out\n");
    return kProbeTimeout;
  }
  char buf[256] = {};
  auto n = ::read(fd, buf, sizeof(buf) - 1);
  std::printf("reply %s", n > 0 ? buf : "(none)\n");
  return n > 0 ? kProbeOk : kProbeError;
}

CTORCH_TEST_WORKER(sleep_long) {
  std::this_thread::sleep_for(std::chrono::minutes(5));
  return 0;
}

namespace {

std::vector<std::string> self(const std::string& worker, std::vector<std::string> args) {
  std::vector<std::string> argv{selfExe().string(), "--ctorch-worker", worker};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

// Bounds against a hang only: nothing here is expected to take long.
constexpr auto kBound = 60s;

// Starts tcp_serve inside `host` on `addr` (and `port`, 0: any); returns the process and its port.
std::pair<std::unique_ptr<Process>, int> serve(const NetnsLab& lab, int host, const std::string& addr, int port = 0) {
  SpawnOptions o;
  o.argv = self("tcp_serve", {addr, std::to_string(port)});
  o.timeout = 180s;
  auto p = std::make_unique<Process>(lab.spawnIn(host, o));
  auto deadline = std::chrono::steady_clock::now() + kBound;
  std::smatch m;
  const std::regex re("port (\\d+)");
  while (std::chrono::steady_clock::now() < deadline) {
    std::string out = p->outputSoFar();
    if (std::regex_search(out, m, re)) return {std::move(p), std::stoi(m[1])};
    if (!p->running()) FAIL("tcp_serve in host " << host << " died: " << p->wait().output);
    std::this_thread::sleep_for(20ms);
  }
  FAIL("tcp_serve in host " << host << " did not start: " << p->outputSoFar());
  return {};
}

// A probe that is to connect (or be refused) gets all the time a busy machine may need: only a
// probe that is to time out (a dropped packet) is given a short timeout, and its timing out is
// what it shows.
constexpr int kProbeAnswerMs = 30000;
constexpr int kProbeDropMs = 700;

ProcessResult probe(const NetnsLab& lab, int fromHost, const std::string& addr, int port,
                    int timeoutMs = kProbeAnswerMs) {
  SpawnOptions o;
  o.argv = self("tcp_probe", {addr, std::to_string(port), std::to_string(timeoutMs)});
  o.timeout = std::chrono::milliseconds(timeoutMs) * 2 + kBound;
  return run(fromHost > 0 ? lab.spawnIn(fromHost, o) : o);  // host 0: this machine itself
}

// Probes until the result has `code` (links take a moment to come back), bounded.
ProcessResult probeUntil(const NetnsLab& lab, int fromHost, const std::string& addr, int port, int code) {
  ProcessResult r;
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  do {
    r = probe(lab, fromHost, addr, port, 1000);
  } while (r.exitCode != code && std::chrono::steady_clock::now() < deadline);
  return r;
}

std::string sh(const std::string& cmd) {
  auto r = run({.argv = {"bash", "-c", cmd}, .timeout = kBound});
  return r.output;
}

bool processGone(int pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  return close != std::string::npos && line.size() > close + 2 && line[close + 2] == 'Z';
}

bool labPresent(const std::string& prefix) {
  return sh("ip netns list; ip -o link show").find(prefix + "-") != std::string::npos ||
         fs::exists("/run/ctorch-lab/" + prefix);
}

} // namespace

// ---- network namespaces ---------------------------------------------------------------------------------
TEST_CASE("netns lab: two hosts talk TCP through their own addresses only", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  NetnsLab lab(2);
  // Host 1 listens on a port that this machine holds bound and unserved: on this machine's own
  // loopback nobody can answer on it, whatever else runs here.
  ReservedPort reserved;
  auto [server, port] = serve(lab, 1, "0.0.0.0", reserved.port());
  REQUIRE(port == reserved.port());

  auto r = probe(lab, 2, lab.addr(1), port);
  INFO(r.output);
  CHECK(r.exitCode == kProbeOk);
  CHECK_THAT(r.output, Catch::Contains("reply n1"));  // the server's own hostname

  // Each host has its own loopback: host 2's 127.0.0.1 is not host 1, and neither is this machine's.
  CHECK(probe(lab, 2, "127.0.0.1", port).exitCode == kProbeRefused);
  CHECK(probe(lab, 0, "127.0.0.1", port).exitCode == kProbeRefused);
  CHECK(probe(lab, 1, "127.0.0.1", port).exitCode == kProbeOk);  // control: it is listening
  // This machine reaches the hosts through the bridge.
  CHECK(probe(lab, 0, lab.addr(1), port).exitCode == kProbeOk);

  // A server bound to host 1's loopback cannot be reached from host 2 at all.
  auto [local, localPort] = serve(lab, 1, "127.0.0.1");
  CHECK(probe(lab, 1, "127.0.0.1", localPort).exitCode == kProbeOk);
  CHECK(probe(lab, 2, lab.addr(1), localPort).exitCode == kProbeRefused);
}

TEST_CASE("netns lab: a cut link stops traffic and restore brings it back", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  NetnsLab lab(3);
  auto [server, port] = serve(lab, 1, "0.0.0.0");
  REQUIRE(probe(lab, 2, lab.addr(1), port).exitCode == kProbeOk);

  lab.cut(1);
  // A partition: no refusal, no reset, just silence until the caller's own timeout.
  auto cut = probe(lab, 2, lab.addr(1), port, kProbeDropMs);
  INFO(cut.output);
  CHECK(cut.exitCode == kProbeTimeout);
  // The other hosts still talk to each other.
  auto [other, otherPort] = serve(lab, 3, "0.0.0.0");
  CHECK(probe(lab, 2, lab.addr(3), otherPort).exitCode == kProbeOk);

  lab.restore(1);
  auto back = probeUntil(lab, 2, lab.addr(1), port, kProbeOk);
  INFO(back.output);
  CHECK(back.exitCode == kProbeOk);
}

TEST_CASE("netns lab: a blocked port drops only that port", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  NetnsLab lab(2);
  auto [a, portA] = serve(lab, 1, "0.0.0.0");
  auto [b, portB] = serve(lab, 1, "0.0.0.0");
  lab.block(1, portA);
  CHECK(probe(lab, 2, lab.addr(1), portA, kProbeDropMs).exitCode == kProbeTimeout);
  CHECK(probe(lab, 2, lab.addr(1), portB).exitCode == kProbeOk);
  lab.unblock(1, portA);
  CHECK(probe(lab, 2, lab.addr(1), portA).exitCode == kProbeOk);
}

TEST_CASE("netns lab: killing a host kills every process in it and nothing else", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  NetnsLab lab(2);
  SpawnOptions o;
  o.argv = self("sleep_long", {});
  o.timeout = 120s;
  Process a(lab.spawnIn(1, o)), b(lab.spawnIn(1, o)), c(lab.spawnIn(2, o));
  // Wait until all three are inside their namespaces.
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  while ((lab.pids(1).size() < 2 || lab.pids(2).empty()) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(20ms);
  REQUIRE(lab.pids(1).size() >= 2);
  REQUIRE(!lab.pids(2).empty());

  lab.killHost(1);
  CHECK(lab.pids(1).empty());
  CHECK(a.wait().termSignal == SIGKILL);
  CHECK(b.wait().termSignal == SIGKILL);
  CHECK(c.running());
  CHECK(!lab.pids(2).empty());
}

TEST_CASE("netns lab: teardown leaves no namespace process link or state", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  auto lab = std::make_unique<NetnsLab>(2);
  const std::string prefix = lab->prefix();
  // Started detached from this test (setsid, no Process owning it): only teardown can stop it.
  sh("setsid " + netnsScript() + " exec " + prefix +
     " 2 sleep 300 </dev/null >/dev/null 2>&1 & pid=$!; "
     "while [ \"$(ps -o sid= -p $pid | tr -d ' ')\" != $pid ]; do sleep 0.01; done");
  std::vector<int> pids;
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  while (pids.empty() && std::chrono::steady_clock::now() < deadline) {
    pids = lab->pids(2);
    if (pids.empty()) std::this_thread::sleep_for(20ms);
  }
  REQUIRE(!pids.empty());
  REQUIRE(labPresent(prefix));  // control: the checks below can see a lab

  lab->down();
  CHECK_FALSE(labPresent(prefix));
  for (int pid : pids) CHECK(processGone(pid));
  lab->down();  // idempotent
}

TEST_CASE("netns lab: a lab goes away when the process that made it is killed", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  // The owner is a shell that makes a lab and then waits; SIGKILL gives it no chance to clean up.
  Process owner({.argv = {"bash", "-c", netnsScript() + " up 2 --owner $$ && sleep 300"}, .timeout = 120s});
  std::string prefix;
  const auto deadline = std::chrono::steady_clock::now() + kBound;
  while (prefix.empty() && std::chrono::steady_clock::now() < deadline) {
    auto vars = parseVars(owner.outputSoFar());
    if (vars.count("LAB_PREFIX")) prefix = vars["LAB_PREFIX"];
    else std::this_thread::sleep_for(20ms);
  }
  REQUIRE(!prefix.empty());
  REQUIRE(labPresent(prefix));
  owner.signalGroup(SIGKILL);
  owner.wait();
  bool gone = false;
  const auto goneBy = std::chrono::steady_clock::now() + kBound;  // the watcher polls every 0.2 s
  while (!gone && std::chrono::steady_clock::now() < goneBy) {
    gone = !labPresent(prefix);
    if (!gone) std::this_thread::sleep_for(20ms);
  }
  CHECK(gone);
}

TEST_CASE("netns lab: labs made at the same time get distinct names and subnets", "[lab][netns]") {
  CTORCH_REQUIRE_NETNS();
  std::vector<std::unique_ptr<NetnsLab>> labs(4);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(labs.size());
  for (size_t i = 0; i < labs.size(); ++i)
    threads.emplace_back([&, i] {
      try {
        labs[i] = std::make_unique<NetnsLab>(1);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  std::set<std::string> prefixes, subnets;
  for (size_t i = 0; i < labs.size(); ++i) {
    INFO(errors[i]);
    REQUIRE(labs[i]);
    prefixes.insert(labs[i]->prefix());
    subnets.insert(labs[i]->vars().at("LAB_SUBNET"));
  }
  CHECK(prefixes.size() == labs.size());
  CHECK(subnets.size() == labs.size());
}

// ---- Slurm ----------------------------------------------------------------------------------------------
namespace {

// Lines "KEY=VALUE" of task outputs prefixed by srun -l ("0: KEY=VALUE") → per task maps.
std::map<int, std::map<std::string, std::string>> perTask(const std::string& output) {
  std::map<int, std::map<std::string, std::string>> tasks;
  std::istringstream in(output);
  std::string line;
  const std::regex re("^\\s*(\\d+): ([A-Z_]+)=(.*)$");
  std::smatch m;
  while (std::getline(in, line))
    if (std::regex_match(line, m, re)) tasks[std::stoi(m[1])][m[2]] = m[3];
  return tasks;
}

std::set<std::string> lines(const std::string& text) {
  std::set<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.insert(line);
  return out;
}

} // namespace

TEST_CASE("slurm lab: srun -N2 hostname runs on the two nodes", "[lab][slurm]") {
  CTORCH_REQUIRE_SLURM();
  SlurmLab slurm({.nodes = 2});
  auto r = slurm.run({"srun", "-N2", "hostname"});
  INFO(r.output);
  REQUIRE(r.ok());
  CHECK(lines(r.output) == std::set<std::string>{"n1", "n2"});
}

TEST_CASE("slurm lab: srun -N2 env shows SLURM_NODEID and the step node list per node", "[lab][slurm]") {
  CTORCH_REQUIRE_SLURM();
  SlurmLab slurm({.nodes = 2});
  auto r = slurm.run({"srun", "-N2", "-l", "bash", "-c", "env; echo HOST_NAME=$(hostname)"});
  INFO(r.output);
  REQUIRE(r.ok());
  auto tasks = perTask(r.output);
  REQUIRE(tasks.size() == 2);
  for (int t = 0; t < 2; ++t) {
    auto& env = tasks[t];
    CHECK(env["SLURM_NODEID"] == std::to_string(t));
    CHECK(env["SLURM_PROCID"] == std::to_string(t));
    CHECK(env["SLURM_NNODES"] == "2");
    CHECK(env["SLURM_STEP_NODELIST"] == "n[1-2]");
    CHECK(env["HOST_NAME"] == "n" + std::to_string(t + 1));
    CHECK(env["SLURMD_NODENAME"] == "n" + std::to_string(t + 1));
    CHECK(!env["SLURM_JOB_ID"].empty());
  }
}

TEST_CASE("slurm lab: a step on n2 and n3 of a 3-node allocation lists n[2-3]", "[lab][slurm]") {
  CTORCH_REQUIRE_SLURM();
  SlurmLab slurm({.nodes = 3});
  auto r = slurm.run({"salloc", "-N3", "srun", "-N2", "-w", "n2,n3", "-l", "bash", "-c",
                      "env; echo HOST_NAME=$(hostname)"});
  INFO(r.output);
  REQUIRE(r.ok());
  auto tasks = perTask(r.output);
  REQUIRE(tasks.size() == 2);
  for (int t = 0; t < 2; ++t) {
    auto& env = tasks[t];
    CHECK(env["SLURM_STEP_NODELIST"] == "n[2-3]");
    CHECK(env["SLURM_JOB_NODELIST"] == "n[1-3]");
    CHECK(env["SLURM_NNODES"] == "2");  // the step's, not the allocation's 3
    CHECK(env["SLURM_NODEID"] == std::to_string(t));
    CHECK(env["HOST_NAME"] == "n" + std::to_string(t + 2));
  }
}

TEST_CASE("slurm lab: sbatch runs a batch script whose srun spans the allocation", "[lab][slurm]") {
  CTORCH_REQUIRE_SLURM();
  SlurmLab slurm({.nodes = 2});
  TempDir dir("ctorch-lab-sbatch");
  writeFile(dir / "job.sh",
            "#!/bin/bash\n"
            "#SBATCH -N 2\n"
            "#SBATCH -o out-%j.txt\n"
            "echo batch host $(hostname)\n"
            "srun -l hostname\n");
  auto r = slurm.run({"sbatch", "--wait", "job.sh"}, 60s, {}, dir.path().string());
  INFO(r.output);
  REQUIRE(r.ok());
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex("Submitted batch job (\\d+)")));
  auto out = readFile(dir / ("out-" + m[1].str() + ".txt"));
  INFO(out);
  CHECK_THAT(out, Catch::Contains("batch host n1"));
  CHECK_THAT(out, Catch::Contains("0: n1"));
  CHECK_THAT(out, Catch::Contains("1: n2"));
}

TEST_CASE("slurm lab: fake GPUs set SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES", "[lab][slurm]") {
  CTORCH_REQUIRE_SLURM();
  SlurmLab slurm({.nodes = 2, .gpusPerNode = 2});
  auto r = slurm.run({"srun", "-N2", "--gpus-per-node=2", "-l", "env"});
  INFO(r.output);
  REQUIRE(r.ok());
  auto tasks = perTask(r.output);
  REQUIRE(tasks.size() == 2);
  for (auto& [t, env] : tasks) {
    CHECK(env["SLURM_GPUS_ON_NODE"] == "2");
    CHECK(env["CUDA_VISIBLE_DEVICES"] == "0,1");
  }
  auto one = slurm.run({"srun", "-N1", "--gpus-per-node=1", "-l", "env"});
  REQUIRE(one.ok());
  CHECK(perTask(one.output)[0]["CUDA_VISIBLE_DEVICES"] == "0");
  // Control: without a GPU request no GPU is visible.
  auto none = slurm.run({"srun", "-N1", "-l", "env"});
  REQUIRE(none.ok());
  CHECK(perTask(none.output)[0].count("SLURM_GPUS_ON_NODE") == 0);
}

TEST_CASE("slurm lab: teardown stops every daemon and removes the cluster", "[lab][slurm]") {
  CTORCH_REQUIRE_SLURM();
  auto slurm = std::make_unique<SlurmLab>(SlurmLabOptions{.nodes = 2});
  const std::string dir = slurm->dir(), prefix = slurm->prefix();
  // Every daemon of this cluster carries its directory on its command line or in its pid files.
  std::vector<int> daemons;
  for (const auto& entry : fs::directory_iterator(dir + "/run")) {
    std::ifstream f(entry.path());
    int pid = 0;
    if (f >> pid) daemons.push_back(pid);
  }
  std::ifstream munge(dir + "/munge/munged.pid");
  int mungePid = 0;
  REQUIRE(munge >> mungePid);
  daemons.push_back(mungePid);
  REQUIRE(daemons.size() >= 4);  // slurmctld (+ its launcher record), 2 slurmd, munged
  for (int pid : daemons) REQUIRE_FALSE(processGone(pid));  // control

  slurm->down();
  for (int pid : daemons) CHECK(processGone(pid));
  CHECK_FALSE(fs::exists(dir));
  CHECK_FALSE(labPresent(prefix));
}
