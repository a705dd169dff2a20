// The command line and its validation, without starting anything: parsers, PET_* variables, the
// program resolution, and every bad input the issue lists (one line naming the bad value).
#include "ctorch_catch.hpp"

#include "ctorch/contract/control_auth.hpp"
#include "ctorch/launcher/c10d_rendezvous.hpp"
#include "ctorch/launcher/cli.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/machine.hpp"
#include "ctorch/rdzv/c10d/failover.hpp"
#include "launcher_test_util.hpp"

#include <sys/stat.h>
#include <algorithm>

#include <csignal>
#include <set>

using namespace ctorch::launcher;
namespace lt = ctorch::launcher_test;

namespace {

MachineProbe fakeMachine(int gpus, int cpus = 8) {
  MachineProbe p;
  p.visibleGpus = [gpus] { return gpus; };
  p.cpuCount = [cpus] { return cpus; };
  p.hostname = [] { return std::string("testhost"); };
  return p;
}

EnvLookup envOf(std::map<std::string, std::string> vars) {
  return [vars](const std::string& k) -> std::optional<std::string> {
    auto it = vars.find(k);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

LaunchConfig configFor(const std::vector<std::string>& args, std::map<std::string, std::string> env = {},
                       int gpus = 0) {
  if (!env.count("PATH")) env["PATH"] = "/usr/bin:/bin";
  auto cl = parseCommandLine(args);
  REQUIRE_FALSE(cl.exitNow);
  return makeLaunchConfig(cl.options, envOf(env), fakeMachine(gpus));
}

// The message of the UsageError/ProgramError that `args` produce.
std::string errorFor(const std::vector<std::string>& args, std::map<std::string, std::string> env = {},
                     int gpus = 0) {
  if (!env.count("PATH")) env["PATH"] = "/usr/bin:/bin";
  auto cl = parseCommandLine(args);
  if (cl.exitNow) return cl.message;
  try {
    makeLaunchConfig(cl.options, envOf(env), fakeMachine(gpus));
  } catch (const LauncherError& e) {
    return e.what();
  }
  return "<no error>";
}

} // namespace

TEST_CASE("config: defaults match torchrun's") {
  auto c = configFor({"/bin/true"});
  CHECK(c.minNodes == 1);
  CHECK(c.maxNodes == 1);
  CHECK(c.nprocPerNode == 1);
  CHECK(c.rdzvBackend == "static");
  CHECK(c.rdzvEndpointHost == "127.0.0.1");
  CHECK(c.rdzvEndpointPort == 29500);
  CHECK(c.rdzvId == "none");
  CHECK(c.maxRestarts == 0);
  CHECK(c.role == "default");
  CHECK(c.shutdownTimeout == std::chrono::seconds(30));
  CHECK(c.signalsToHandle == std::vector<int>{SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2});
  CHECK(c.workerArgv == std::vector<std::string>{"/bin/true"});
  CHECK_FALSE(c.usesPython);
}

TEST_CASE("config: kebab-case / underscore spellings and PET_ variables are the same options") {
  CHECK(configFor({"--nproc-per-node", "3", "/bin/true"}).nprocPerNode == 3);
  CHECK(configFor({"--nproc_per_node", "3", "/bin/true"}).nprocPerNode == 3);
  CHECK(configFor({"--nproc_per_node=4", "/bin/true"}).nprocPerNode == 4);
  CHECK(configFor({"--max_restarts", "2", "--master_port", "1234", "/bin/true"}).maxRestarts == 2);
  // PET_ variables are read by the command-line parser from the real environment.
  ::setenv("PET_NPROC_PER_NODE", "5", 1);
  ::setenv("PET_MAX_RESTARTS", "7", 1);
  auto c = configFor({"/bin/true"});
  CHECK(c.nprocPerNode == 5);
  CHECK(c.maxRestarts == 7);
  CHECK(configFor({"--nproc-per-node", "2", "/bin/true"}).nprocPerNode == 2);  // flag beats PET_
  ::unsetenv("PET_NPROC_PER_NODE");
  ::unsetenv("PET_MAX_RESTARTS");
}

TEST_CASE("config: everything after the program goes to it untouched") {
  auto c = configFor({"--nproc-per-node", "2", "/bin/echo", "--nproc-per-node", "9", "-m", "--", "x"});
  CHECK(c.nprocPerNode == 2);
  CHECK(c.program == "/bin/echo");
  CHECK(c.programArgs == std::vector<std::string>{"--nproc-per-node", "9", "-m", "--", "x"});
  auto d = configFor({"--", "/bin/echo", "a"});
  CHECK(d.program == "/bin/echo");
}

TEST_CASE("config: .py and -m run under PYTHON_EXEC with -u - --no-python executes directly") {
  ctorch::test::TempDir dir;
  auto script = (dir / "train.py").string();
  ctorch::test::writeFile(script, "print(1)\n");
  auto py = configFor({script, "--lr", "1"}, {{"PYTHON_EXEC", "/usr/bin/python3"}});
  CHECK(py.usesPython);
  CHECK(py.executable == "/usr/bin/python3");
  CHECK(py.workerArgv == std::vector<std::string>{"/usr/bin/python3", "-u", script, "--lr", "1"});
  auto mod = configFor({"-m", "pkg.train", "x"}, {{"PYTHON_EXEC", "/usr/bin/python3"}});
  CHECK(mod.workerArgv == std::vector<std::string>{"/usr/bin/python3", "-u", "-m", "pkg.train", "x"});
  ::chmod(script.c_str(), 0755);
  auto direct = configFor({"--no-python", script});
  CHECK_FALSE(direct.usesPython);
  CHECK(direct.workerArgv == std::vector<std::string>{script});
}

TEST_CASE("config: --nproc-per-node gpu/cpu/auto") {
  CHECK(configFor({"--nproc-per-node", "gpu", "/bin/true"}, {}, 4).nprocPerNode == 4);
  CHECK(configFor({"--nproc-per-node", "auto", "/bin/true"}, {}, 2).nprocPerNode == 2);
  CHECK(configFor({"--nproc-per-node", "auto", "/bin/true"}, {}, 0).nprocPerNode == 8);  // CPUs
  CHECK(configFor({"--nproc-per-node", "cpu", "/bin/true"}, {}, 4).nprocPerNode == 8);
}

TEST_CASE("config: visible GPU counting follows CUDA_VISIBLE_DEVICES like CUDA") {
  CHECK(visibleGpuCount(4, std::nullopt) == 4);
  CHECK(visibleGpuCount(4, std::string("0,2")) == 2);
  CHECK(visibleGpuCount(4, std::string("")) == 0);
  CHECK(visibleGpuCount(4, std::string("1,7,2")) == 1);  // stops at the invalid 7
  CHECK(visibleGpuCount(4, std::string("-1")) == 0);
  CHECK(visibleGpuCount(2, std::string("GPU-1234,GPU-5678")) == 2);
  CHECK(visibleGpuCount(0, std::string("0,1")) == 0);
  ctorch::test::TempDir proc, dev;
  std::filesystem::create_directories(proc.path() / "driver/nvidia/gpus/0000:01:00.0");
  std::filesystem::create_directories(proc.path() / "driver/nvidia/gpus/0000:02:00.0");
  CHECK(countNvidiaDevices(proc.path(), dev.path()) == 2);
  ctorch::test::TempDir noProc;
  ctorch::test::writeFile(dev / "nvidia0", "");
  ctorch::test::writeFile(dev / "nvidiactl", "");
  CHECK(countNvidiaDevices(noProc.path(), dev.path()) == 1);
}

TEST_CASE("config: standalone picks a random run id and a free port") {
  auto a = configFor({"--standalone", "/bin/true"});
  auto b = configFor({"--standalone", "/bin/true"});
  CHECK(a.rdzvBackend == "standalone");
  CHECK(a.rdzvEndpointPort == 0);
  CHECK(a.rdzvId.size() == 36);
  CHECK(a.rdzvId != b.rdzvId);
}

TEST_CASE("config: --redirects/--tee values / --local-ranks-filter / --rdzv-conf") {
  auto c = configFor({"--nproc-per-node", "3", "-r", "0:3,1:1", "-t", "2", "--local-ranks-filter", "0,2",
                      "--rdzv-conf", "join_timeout=5, is_host=1", "/bin/true"});
  CHECK(c.redirects.forRank(0) == StdStreams::All);
  CHECK(c.redirects.forRank(1) == StdStreams::Out);
  CHECK(c.redirects.forRank(5) == StdStreams::None);
  CHECK(c.tee.forRank(3) == StdStreams::Err);
  CHECK(*c.localRanksFilter == std::set<int>{0, 2});
  CHECK(c.rdzvConf.entries == std::vector<std::pair<std::string, std::string>>{{"join_timeout", "5"}, {"is_host", "1"}});
}

TEST_CASE("config: --rdzv-conf is parsed once, typed for the c10d backend") {
  auto c = configFor({"--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-conf",
                      "join_timeout=5, is_host=1,heartbeat=0.5", "/bin/true"});
  CHECK(c.rdzvConf.joinTimeout == std::chrono::seconds(5));
  CHECK(c.rdzvConf.isHost == true);
  CHECK(c10dOptionsFrom(c).settings.keepAliveInterval == std::chrono::milliseconds(500));
  CHECK(c10dOptionsFrom(c).settings.keepAliveMaxAttempt == 3);  // ctorchrun's default
  // The static backend reads no key: any key=value is accepted (as torchrun).
  CHECK(configFor({"--rdzv-conf", "timeout=3", "/bin/true"}).rdzvConf.entries.size() == 1);
}

TEST_CASE("config: static multi-node ranks and endpoint") {
  auto c = configFor({"--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port",
                      "4000", "/bin/true"});
  CHECK(c.maxNodes == 2);
  CHECK(*c.nodeRank == 1);
  CHECK(c.rdzvEndpointHost == "10.0.0.1");
  CHECK(c.rdzvEndpointPort == 4000);
  auto e = configFor({"--rdzv-endpoint", "[::1]:4100", "/bin/true"});
  CHECK(e.rdzvEndpointHost == "::1");
  CHECK(e.rdzvEndpointPort == 4100);
  // A bare IPv6 address is a host without a port; anything else with colons splits at the last one.
  auto bare = configFor({"--rdzv-backend", "c10d", "--rdzv-endpoint", "fe80::1%eth0", "/bin/true"});
  CHECK(bare.rdzvEndpointHost == "fe80::1%eth0");
  CHECK(bare.rdzvEndpointPort == 29400);
}

// The one endpoint parser (the rendezvous library's unused copy is gone, its cases moved here).
TEST_CASE("config: --rdzv-endpoint is host, host:port or [IPv6]:port, as torchrun parses it") {
  using ctorch::launcher::parseEndpoint;
  CHECK(parseEndpoint("head:29500") == std::pair<std::string, std::optional<int>>{"head", 29500});
  CHECK(parseEndpoint("head") == std::pair<std::string, std::optional<int>>{"head", std::nullopt});
  CHECK(parseEndpoint("10.1.2.3:0").second == 0);
  CHECK(parseEndpoint(" node-01.cluster ").first == "node-01.cluster");
  CHECK(parseEndpoint("[fe80::1]:1234") == std::pair<std::string, std::optional<int>>{"fe80::1", 1234});
  CHECK(parseEndpoint("[::1]") == std::pair<std::string, std::optional<int>>{"::1", std::nullopt});
  CHECK(parseEndpoint("").first.empty());
  CHECK_THROWS_WITH(parseEndpoint("head:http"), Catch::Contains("'http': not a port number"));
  CHECK_THROWS_WITH(parseEndpoint("head:70000"), Catch::Contains("port out of range"));
  CHECK_THROWS_WITH(parseEndpoint("head:"), Catch::Contains("not a port number"));
  CHECK_THROWS_WITH(parseEndpoint("he ad:1"), Catch::Contains("host 'he ad' is not a host name or an IP address"));
  CHECK_THROWS_WITH(parseEndpoint("[::1"), Catch::Contains("unbalanced '['"));
  CHECK_THROWS_WITH(parseEndpoint("[::1]x"), Catch::Contains("expected HOST[:PORT]"));
  CHECK_THROWS_WITH(parseEndpoint(":29400"), Catch::Contains("missing host"));
}

// ---- Bad input: one line naming the bad value --------------------------------------------------

TEST_CASE("config bad input: each gives an error that quotes the bad value") {
  struct Case {
    std::vector<std::string> args;
    std::string mustContain;
  };
  std::vector<Case> cases = {
      {{"--nnodes", "3:1", "/bin/true"}, "'3:1'"},
      {{"--nnodes", "x", "/bin/true"}, "'x'"},
      {{"--nproc-per-node", "0", "/bin/true"}, "'0'"},
      {{"--nproc-per-node", "abc", "/bin/true"}, "'abc'"},
      {{"--nproc-per-node", "-2", "/bin/true"}, "'-2'"},
      {{"--nproc-per-node", "gpu", "/bin/true"}, "'gpu'"},
      {{"--master-port", "70000", "/bin/true"}, "'70000'"},
      {{"--master-port", "-1", "/bin/true"}, "'-1'"},
      {{"--master-port", "http", "/bin/true"}, "'http'"},
      {{"--rdzv-endpoint", "host:99999", "/bin/true"}, "'99999'"},
      // Refused at once, as torchrun does, not a wait for the join timeout (issue 29).
      {{"--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400:x", "/bin/true"}, "port 'x': not a port number"},
      {{"--rdzv-backend", "zookeeper", "/bin/true"}, "'zookeeper'"},
      {{"--rdzv-backend", "etcd", "/bin/true"}, "'etcd'"},
      {{"--rdzv-conf", "join_timeout", "/bin/true"}, "'join_timeout'"},
      {{"--rdzv-conf", "a=1,=2", "/bin/true"}, "'=2'"},
      {{"--redirects", "7", "/bin/true"}, "'7'"},
      {{"--tee", "0:x", "/bin/true"}, "'0:x'"},
      {{"--local-ranks-filter", "0,a", "/bin/true"}, "'a'"},
      {{"--signals-to-handle", "SIGFOO", "/bin/true"}, "'SIGFOO'"},
      {{"--signals-to-handle", "SIGKILL", "/bin/true"}, "SIGKILL"},
      {{"--shutdown-timeout", "soon", "/bin/true"}, "'soon'"},
      // Strict numbers: what strtod or Python's int() would take is refused (issue 42.10).
      {{"--shutdown-timeout", "0x10", "/bin/true"}, "'0x10'"},
      {{"--monitor-interval", "inf", "/bin/true"}, "'inf'"},
      {{"--preloaded-workers", " 2", "/bin/true"}, "' 2'"},
      {{"--nproc-per-node", " 2", "/bin/true"}, "' 2'"},
      {{"--nnodes", "2 ", "/bin/true"}, "'2 '"},
      {{"--master-port", "0x7530", "/bin/true"}, "'0x7530'"},
      {{"--rdzv-backend", "c10d", "--rdzv-id", "j", "--rdzv-conf", "join_timeout=0x10", "/bin/true"}, "0x10"},
      {{"--max-restarts", "-1", "/bin/true"}, "'-1'"},
      {{"--node-rank", "2", "--nnodes", "2", "/bin/true"}, "--node-rank 2"},
      {{"--nnodes", "1:2", "/bin/true"}, "'1:2'"},
      {{"--standalone", "--nnodes", "2", "/bin/true"}, "'2'"},
      {{"--bogus", "/bin/true"}, "'--bogus'"},
      {{"--nproc-per-node", "2"}, "missing the training program"},
      {{"/definitely/not/here"}, "'/definitely/not/here'"},
      {{"no-such-program-xyz"}, "'no-such-program-xyz'"},
      {{"-m", "--no-python", "mod"}, "--module and --no-python"},
      {{"--log-level", "loud", "/bin/true"}, "'loud'"},
  };
  for (const auto& c : cases) {
    std::string msg = errorFor(c.args);
    INFO("args: " << Catch::Detail::stringify(c.args) << "\nmessage: " << msg);
    CHECK(msg != "<no error>");
    CHECK(msg.find(c.mustContain) != std::string::npos);
    auto trimmed = msg;
    while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
    CHECK(trimmed.find('\n') == std::string::npos);  // one line
  }
}

TEST_CASE("config bad input: a program that is not executable is a ProgramError with 126") {
  ctorch::test::TempDir dir;
  auto p = (dir / "prog").string();
  ctorch::test::writeFile(p, "#!/bin/sh\n");
  ::chmod(p.c_str(), 0644);
  auto cl = parseCommandLine({p});
  try {
    makeLaunchConfig(cl.options, envOf({{"PATH", "/usr/bin"}}), fakeMachine(0));
    FAIL("no error");
  } catch (const ProgramError& e) {
    CHECK(e.exitCode() == 126);
    CHECK(std::string(e.what()).find("not executable") != std::string::npos);
  }
  auto missing = parseCommandLine({(dir / "nope").string()});
  try {
    makeLaunchConfig(missing.options, envOf({{"PATH", "/usr/bin"}}), fakeMachine(0));
    FAIL("no error");
  } catch (const ProgramError& e) {
    CHECK(e.exitCode() == 127);
  }
}

// Issue 28.7: `ctorchrun script.sh` for a file in the current directory (a shell would not run it
// either) says what to type; PET_LOG_LEVEL is --log-level, as every flag has its PET_ variable.
TEST_CASE("config: a bare name found only in the current directory suggests ./name, PET_LOG_LEVEL sets --log-level") {
  ctorch::test::TempDir dir;
  const auto script = dir / "train.sh";
  ctorch::test::writeFile(script, "#!/bin/sh\n");
  ::chmod(script.c_str(), 0755);
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  const std::string here = errorFor({"train.sh"});
  const std::string elsewhere = errorFor({"no-such-program"});
  std::filesystem::current_path(cwd);
  CHECK_THAT(here, Catch::Contains("training program 'train.sh' not found on PATH; did you mean ./train.sh?"));
  CHECK(elsewhere.find("did you mean") == std::string::npos);

  ::setenv("PET_LOG_LEVEL", "debug", 1);
  auto cl = parseCommandLine({"/bin/true"});
  ::unsetenv("PET_LOG_LEVEL");
  REQUIRE_FALSE(cl.exitNow);
  CHECK(cl.options.logLevel == "debug");
}

TEST_CASE("config: --help ends with the exit codes and the worker contract") {
  auto cl = parseCommandLine({"--help"});
  REQUIRE(cl.exitNow);
  CHECK(cl.exitCode == 0);
  CHECK(cl.message.find("root-cause worker") != std::string::npos);
  for (const auto& v : ctorch::contract::kWorkerVariables) CHECK(cl.message.find(v.name) != std::string::npos);
  auto contractAt = cl.message.find("Worker contract");
  REQUIRE(contractAt != std::string::npos);
  CHECK(cl.message.find("--nnodes") < contractAt);  // the contract comes last
}

// Issue 13.3: a venv's or /usr/local's python3 without torch first on PATH must not shadow one that
// has it; when none has torch, say what was tried and how to choose.
TEST_CASE("config: a .py program runs under an interpreter that can import torch, or says why none can") {
  ctorch::test::TempDir dir;
  auto fake = (dir / "python3").string();
  ctorch::test::writeFile(fake, "#!/bin/sh\nexec /usr/bin/python3 -S \"$@\"\n");
  ::chmod(fake.c_str(), 0755);
  auto script = (dir / "train.py").string();
  ctorch::test::writeFile(script, "print(1)\n");
  std::vector<std::string> probed;
  auto machine = [&](std::set<std::string> withTorch) {
    auto m = fakeMachine(0);
    m.pythonHasTorch = [&probed, withTorch](const std::string& p) {
      probed.push_back(p);
      return withTorch.count(p) > 0;
    };
    return m;
  };
  auto cfg = [&](std::set<std::string> withTorch, std::map<std::string, std::string> env) {
    env["PATH"] = dir.path().string() + ":/usr/bin:/bin";
    auto cl = parseCommandLine({script});
    return makeLaunchConfig(cl.options, envOf(env), machine(withTorch));
  };
  if (!std::filesystem::exists("/usr/bin/python3")) CTORCH_SKIP("/usr/bin/python3 is not installed");
  auto sys = cfg({"/usr/bin/python3"}, {});
  CHECK(sys.executable == "/usr/bin/python3");
  CHECK(sys.workerArgv.front() == "/usr/bin/python3");
  CHECK(sys.pythonChoice.find("/usr/bin/python3") != std::string::npos);
  CHECK(sys.pythonWarning.empty());
  CHECK(probed.front() == fake);  // PATH's python3 was asked first

  auto first = cfg({fake, "/usr/bin/python3"}, {});
  CHECK(first.executable == fake);

  auto none = cfg({}, {});
  CHECK(none.executable == fake);  // as before: python3 on PATH
  INFO(none.pythonWarning);
  CHECK(none.pythonWarning.find("PYTHON_EXEC=") != std::string::npos);
  CHECK(none.pythonWarning.find(fake + ": no torch") != std::string::npos);
  CHECK(none.pythonWarning.find("/usr/bin/python3") != std::string::npos);

  auto exec = cfg({}, {{"PYTHON_EXEC", fake}});
  CHECK(exec.executable == fake);  // PYTHON_EXEC wins, as in torchrun, with a warning
  CHECK(exec.pythonWarning.find("cannot import torch") != std::string::npos);
  try {
    cfg({}, {{"PYTHON_EXEC", "/no/such/python"}});
    FAIL("no error");
  } catch (const ProgramError& e) {
    CHECK(e.exitCode() == 127);
    CHECK(std::string(e.what()).find("'/no/such/python'") != std::string::npos);
  }
}

TEST_CASE("config: --help shows value types, backends, defaults and exit code 75") {
  auto cl = parseCommandLine({"--help"});
  REQUIRE(cl.exitNow);
  const std::string& h = cl.message;
  CHECK(h.find("TEXT") == std::string::npos);  // every option names what it takes
  for (const char* s : {"N|MIN:MAX", "N|gpu|cpu|auto", "PORT", "SECONDS", "c10d|static", "HOST[:PORT]",
                        "localhost:29400", "SLURM_NODEID", "default 0", "auto|on|off"})
    CHECK(h.find(s) != std::string::npos);
  CHECK(h.find("\n  75 ") != std::string::npos);
}

TEST_CASE("config: unambiguous prefixes of long options, as torchrun's argparse") {
  auto c = configFor({"--nproc", "2", "--max-re=3", "--shutdown_t", "5", "--stand", "/bin/true", "--nproc", "x"});
  CHECK(c.nprocPerNode == 2);
  CHECK(c.maxRestarts == 3);
  CHECK(c.shutdownTimeout == std::chrono::seconds(5));
  CHECK(c.standalone);
  // What follows the program is the program's own.
  CHECK(c.programArgs == std::vector<std::string>{"--nproc", "x"});
  // Ambiguous: an error naming the candidates.
  auto cl = parseCommandLine({"--n", "2", "/bin/true"});
  REQUIRE(cl.exitNow);
  CHECK(cl.exitCode == 2);
  CHECK(cl.message.find("'--n'") != std::string::npos);
  CHECK(cl.message.find("--nnodes") != std::string::npos);
  CHECK(cl.message.find("--nproc-per-node") != std::string::npos);
}

TEST_CASE("config: --local-ranks-filter naming a local rank that does not exist is refused") {
  std::string msg = errorFor({"--nproc-per-node", "2", "--local-ranks-filter", "5", "/bin/true"});
  CHECK(msg.find("'5'") != std::string::npos);
  CHECK(msg.find("--nproc-per-node 2") != std::string::npos);
  CHECK(configFor({"--nproc-per-node", "2", "--local-ranks-filter", "1", "/bin/true"}).localRanksFilter->count(1));
}

// ---- c10d and Slurm ---------------------------------------------------------------------------------
TEST_CASE("config c10d: elastic nnodes / endpoint defaults / node rank as a request") {
  auto c = configFor({"--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-id", "j", "--node-rank", "5", "/bin/true"});
  CHECK(c.rdzvBackend == "c10d");
  CHECK(c.minNodes == 2);
  CHECK(c.maxNodes == 4);
  CHECK(c.rdzvEndpointHost == "localhost");  // torch's default
  CHECK(c.rdzvEndpointPort == 29400);
  CHECK(c.nodeRank == 5);  // a request: not checked against --nnodes
  auto d = configFor({"--nnodes", "2", "--rdzv_backend=c10d", "--rdzv_endpoint=head:1234", "/bin/true"});
  CHECK(d.rdzvEndpointHost == "head");
  CHECK(d.rdzvEndpointPort == 1234);
}

TEST_CASE("config c10d bad input: rdzv-conf keys and values are checked before anything starts") {
  std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--rdzv-backend", "c10d", "--rdzv-conf", "joint_timeout=3", "/bin/true"}, "'joint_timeout' is unknown"},
      {{"--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=abc", "/bin/true"}, "'abc'"},
      {{"--rdzv-backend", "c10d", "--rdzv-conf", "is_host=maybe", "/bin/true"}, "'maybe'"},
      {{"--rdzv-backend", "c10d", "--rdzv-conf", "keep_alive_max_attempt=0", "/bin/true"}, "keep_alive_max_attempt"},
      {{"--rdzv-backend", "c10d", "--rdzv-endpoint", "head:0", "/bin/true"}, "port 0"},
      {{"--slurm", "sometimes", "/bin/true"}, "'sometimes'"},
  };
  for (const auto& [args, text] : cases) {
    std::string msg = errorFor(args);
    INFO(msg);
    CHECK(msg.find(text) != std::string::npos);
    auto trimmed = msg;
    while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
    CHECK(trimmed.find('\n') == std::string::npos);
  }
}

TEST_CASE("config slurm: under srun what the user left out comes from the step, and is logged") {
  std::map<std::string, std::string> step = {{"SLURM_JOB_ID", "4242"},        {"SLURM_STEP_ID", "0"},
                                             {"SLURM_NODEID", "1"},           {"SLURM_NNODES", "2"},
                                             {"SLURM_NTASKS", "2"},           {"SLURM_STEP_NODELIST", "gpu[07-08]"},
                                             {"SLURM_JOB_NODELIST", "gpu[06-08]"}, {"SLURM_GPUS_ON_NODE", "4"},
                                             {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"}};
  auto c = configFor({"/bin/true"}, step);
  CHECK(c.rdzvBackend == "c10d");
  CHECK(c.minNodes == 2);
  CHECK(c.maxNodes == 2);
  CHECK(c.nodeRank == 1);
  CHECK(c.rdzvEndpointHost == "gpu07");  // the step's first node, not the allocation's
  CHECK(c.rdzvEndpointPort == 20000 + 4242 % 12000);
  CHECK(c.rdzvId == "slurm-4242.0");
  CHECK(c.nprocPerNode == 4);
  CHECK(c.slurmLines.size() >= 5);
  CHECK(c.slurmWarnings.empty());
  // What the user gave wins.
  auto u = configFor({"--nproc-per-node", "2", "--rdzv-id", "mine", "--rdzv-endpoint", "other:5", "/bin/true"}, step);
  CHECK(u.nprocPerNode == 2);
  CHECK(u.rdzvId == "mine");
  CHECK(u.rdzvEndpointHost == "other");
  CHECK(u.minNodes == 2);
  // --slurm off: nothing derived (control).
  auto off = configFor({"--slurm", "off", "/bin/true"}, step);
  CHECK(off.rdzvBackend == "static");
  CHECK(off.maxNodes == 1);
  CHECK(off.slurmLines.empty());
  // Two ctorchrun on one node: a warning, every task its own node.
  auto two = step;
  two["SLURM_NTASKS"] = "4";
  two["SLURM_STEP_TASKS_PER_NODE"] = "2(x2)";
  two["SLURM_PROCID"] = "3";
  auto w = configFor({"/bin/true"}, two);
  REQUIRE(w.slurmWarnings.size() == 1);
  CHECK(w.slurmWarnings[0].find("srun started 4 ctorchrun tasks on 2 node(s)") != std::string::npos);
  CHECK(w.maxNodes == 4);
  CHECK(w.nodeRank == 3);
  // --slurm on outside a step is an error.
  CHECK(errorFor({"--slurm", "on", "/bin/true"}).find("--slurm") != std::string::npos);
}

TEST_CASE("config: --recovery restart (default) or in-place, in every spelling") {
  CHECK_FALSE(configFor({"/bin/true"}).inPlaceRecovery);
  CHECK_FALSE(configFor({"--recovery", "restart", "/bin/true"}).inPlaceRecovery);
  CHECK(configFor({"--recovery", "in-place", "/bin/true"}).inPlaceRecovery);
  CHECK(configFor({"--recovery=in_place", "/bin/true"}).inPlaceRecovery);
  ::setenv("PET_RECOVERY", "in-place", 1);  // read by the command-line parser from the real environment
  CHECK(configFor({"/bin/true"}).inPlaceRecovery);
  ::unsetenv("PET_RECOVERY");
  const std::string e = errorFor({"--recovery", "sideways", "/bin/true"});
  CHECK_THAT(e, Catch::Contains("--recovery 'sideways'"));
  CHECK_THAT(e, Catch::Contains("in-place"));
  CHECK_THAT(errorFor({"--recovery", "in-place", "-m", "pkg.train"}, {{"PYTHON_EXEC", "/usr/bin/python3"}}),
             Catch::Contains("use --recovery restart"));
  CHECK_THAT(errorFor({"--spare-workers", "1", "/bin/true"}), Catch::Contains("needs --recovery in-place"));
  CHECK(configFor({"--recovery", "in-place", "--spare-workers", "2", "/bin/true"}).spareWorkers == 2);
  // Preloaded workers: one by default with in-place recovery and no spare; none otherwise; set explicitly.
  CHECK(configFor({"--recovery", "in-place", "/bin/true"}).preloadedWorkers == 1);
  CHECK(configFor({"--recovery", "in-place", "--spare-workers", "1", "/bin/true"}).preloadedWorkers == 0);
  CHECK(configFor({"/bin/true"}).preloadedWorkers == 0);
  CHECK(configFor({"--recovery", "in-place", "--preloaded-workers", "0", "/bin/true"}).preloadedWorkers == 0);
  CHECK(configFor({"--recovery", "in-place", "--spare-workers", "1", "--preloaded-workers", "2", "/bin/true"})
            .preloadedWorkers == 2);
  CHECK_THAT(errorFor({"--preloaded-workers", "1", "/bin/true"}), Catch::Contains("needs --recovery in-place"));
  CHECK_THAT(errorFor({"--recovery", "in-place", "--preloaded-workers", "x", "/bin/true"}),
             Catch::Contains("--preloaded-workers"));
  CHECK_THAT(errorFor({"--recovery", "in-place", "--preloaded-workers", "65", "/bin/true"}),
             Catch::Contains("at most 64"));
}

TEST_CASE("config: in-place recovery's control key: random on one node, from CTORCH_JOB_SECRET across nodes, "
          "else in-place is turned off with the reason") {
  const auto one = configFor({"--standalone", "--recovery", "in-place", "/bin/true"});
  CHECK(one.inPlaceRecovery);
  CHECK(one.controlKey.size() == 32);
  CHECK(one.controlKey != configFor({"--standalone", "--recovery", "in-place", "/bin/true"}).controlKey);
  CHECK(configFor({"/bin/true"}).controlKey.empty());  // no in-place recovery: no key

  const std::vector<std::string> nodes = {"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400",
                                          "--rdzv-id", "job7", "--recovery", "in-place", "--spare-workers", "1",
                                          "/bin/true"};
  const auto unsigned_ = configFor(nodes);
  CHECK_FALSE(unsigned_.inPlaceRecovery);
  CHECK(unsigned_.spareWorkers == 0);
  CHECK(unsigned_.preloadedWorkers == 0);
  CHECK_THAT(unsigned_.recoveryWarning, Catch::Contains("CTORCH_JOB_SECRET") && Catch::Contains("restarts the group"));
  const std::map<std::string, std::string> secret{{"CTORCH_JOB_SECRET", "0123456789abcdef-shared"}};
  const auto a = configFor(nodes, secret), b = configFor(nodes, secret);
  CHECK(a.inPlaceRecovery);
  CHECK(a.controlKey.size() == 32);
  CHECK(a.controlKey == b.controlKey);  // every node derives the same key
  CHECK(a.controlKeySource == "CTORCH_JOB_SECRET");
  CHECK_THAT(errorFor(nodes, {{"CTORCH_JOB_SECRET", "short"}}),
             Catch::Contains("CTORCH_JOB_SECRET is 5 characters long: at least 16"));

  // ctorchrun's own worker variables inherited from the environment are named (and not passed on).
  const auto inherited = configFor({"--standalone", "/bin/true"}, {{"CTORCH_SPARE", "0-0-1"}, {"CTORCH_REPLACEMENT", "2"}});
  CHECK(inherited.inheritedLauncherVariables == std::vector<std::string>{"CTORCH_REPLACEMENT", "CTORCH_SPARE"});
}

TEST_CASE("config: --store-failover's mark key comes from CTORCH_JOB_SECRET (per run id, not the control key), "
          "without a secret, marks are unsigned") {
  const std::vector<std::string> nodes = {"--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400",
                                          "--rdzv-id", "job7", "--store-failover", "/bin/true"};
  CHECK(configFor(nodes).failoverKey.empty());
  const std::map<std::string, std::string> secret{{"CTORCH_JOB_SECRET", "0123456789abcdef-shared"}};
  const auto a = configFor(nodes, secret);
  CHECK(a.failoverKey.size() == 32);
  CHECK(a.failoverKey == ctorch::rdzv::c10d::deriveFailoverKey("0123456789abcdef-shared", "job7"));
  CHECK(a.failoverKey != ctorch::contract::auth::deriveControlKey("0123456789abcdef-shared", "job7"));
  CHECK_THAT(errorFor(nodes, {{"CTORCH_JOB_SECRET", "short"}}),
             Catch::Contains("CTORCH_JOB_SECRET is 5 characters long: at least 16"));
  std::vector<std::string> plain = nodes;
  plain.erase(std::find(plain.begin(), plain.end(), "--store-failover"));
  CHECK(configFor(plain, secret).failoverKey.empty());  // no failover: no key
}

TEST_CASE("config: --rdzv-id is checked before the rendezvous, and a long one is quoted short") {
  const std::string huge(100000, 'x');
  const std::string e = errorFor({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400",
                                  "--rdzv-id", huge, "/bin/true"});
  CHECK_THAT(e, Catch::Contains("at most 128 characters") && Catch::Contains("(100000 characters)"));
  CHECK(e.size() < 300);
  CHECK_THAT(errorFor({"--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-id", "a/b", "/bin/true"}),
             Catch::Contains("must not contain '/'"));
  CHECK(configFor({"--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-id", std::string(128, 'y'),
                   "/bin/true"}).rdzvId.size() == 128);
}

TEST_CASE("config: --store-failover needs the c10d rendezvous and reaches its options") {
  const std::vector<std::string> c10d = {"--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400"};
  auto with = [&](std::vector<std::string> extra) {
    auto a = c10d;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  CHECK_FALSE(configFor(with({"/bin/true"})).storeFailover);
  const LaunchConfig c = configFor(with({"--store-failover", "/bin/true"}));
  CHECK(c.storeFailover);
  CHECK(c10dOptionsFrom(c).storeFailover);
  CHECK_FALSE(c10dOptionsFrom(configFor(with({"/bin/true"}))).storeFailover);
  CHECK_THAT(describeConfig(c), Catch::Contains("store failover"));
  CHECK(configFor(with({"--store_failover", "/bin/true"})).storeFailover);
  ::setenv("PET_STORE_FAILOVER", "1", 1);  // read by the command-line parser from the real environment
  CHECK(configFor(with({"/bin/true"})).storeFailover);
  ::unsetenv("PET_STORE_FAILOVER");
  // Static and standalone rendezvous have no rendezvous store to fail over.
  CHECK_THAT(errorFor({"--store-failover", "/bin/true"}),
             Catch::Contains("--store-failover needs --rdzv-backend c10d") && Catch::Contains("static"));
  CHECK_THAT(errorFor({"--standalone", "--store-failover", "/bin/true"}),
             Catch::Contains("--store-failover needs --rdzv-backend c10d"));
}
