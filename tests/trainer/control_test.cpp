// Nobody outside the job steers it through the workers' store (ctorchrun --recovery in-place): a
// forged eviction leaves the worker alone, a forged spare assignment is ignored (and never chooses a
// file), a control variable inherited from the shell is dropped with a warning, a waiting spare
// answers SIGTERM, a spare started by hand is refused at once, and --standalone's stores listen on
// the loopback only. Each attack is what an outsider who reaches MASTER_ADDR:MASTER_PORT can do.
#include "trainer_test_util.hpp"

#include <ctorch/compat.hpp>
#include <ctorch/contract/worker_contract.hpp>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fstream>
#include <sstream>

using namespace traintest;
using ctorch::test::TempDir;

namespace {

const std::vector<std::string> kSlowToy = {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                           "512", "--batch-size", "16", "--test-limit", "64", "--log-interval", "4",
                                           "--lr", "0.05", "--epochs", "8", "--step-delay-ms", "40"};

std::map<std::string, std::string> environOf(int pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::map<std::string, std::string> out;
  std::stringstream s(all);
  std::string entry;
  while (std::getline(s, entry, '\0')) {
    const auto eq = entry.find('=');
    if (eq != std::string::npos) out[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return out;
}

// The pid of a ctorch-train process in `cwd` whose environment has `name` (any value), or -1.
int findProcessWith(const fs::path& cwd, const std::string& name) {
  std::error_code ec;
  const fs::path wanted = fs::canonical(cwd, ec);
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const int pid = std::atoi(e.path().filename().c_str());
    if (pid <= 0 || fs::read_symlink(e.path() / "cwd", ec) != wanted) continue;
    std::ifstream cmd(e.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    if (cmdline.find("ctorch-train") == std::string::npos || cmdline.find("ctorchrun") != std::string::npos) continue;
    if (environOf(pid).count(name)) return pid;
  }
  return -1;
}

int waitForPid(const std::function<int()>& find) {
  for (int i = 0; i < 1500; ++i) {
    const int pid = find();
    if (pid > 0) return pid;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// A client of the workers' store, as anyone on the network could open one.
c10::intrusive_ptr<c10d::TCPStore> outsider(const std::map<std::string, std::string>& workerEnv) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(std::stoi(workerEnv.at("MASTER_PORT")));
  o.isServer = false;
  o.timeout = std::chrono::seconds(10);
  const char* uv = std::getenv("USE_LIBUV");
  ctorch::compat::setUseLibUV(o, uv && std::string(uv) == "1");
  return c10::make_intrusive<c10d::TCPStore>(workerEnv.at("MASTER_ADDR"), o);
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

bool alive(int pid) { return ::kill(pid, 0) == 0; }

}  // namespace

TEST_CASE("control channel: CTORCH_SPARE left in the shell is dropped with a warning, a spare started by hand "
          "is refused at once", "[trainer][process][control]") {
  TempDir dir("control-inherit");
  auto o = trainUnderLauncher(dir.path(), 2, {"--model", "linear", "--dataset", "synthetic-regression",
                                              "--synthetic-size", "128", "--batch-size", "16", "--epochs", "1"},
                              {}, std::chrono::seconds(60));
  o.setEnv["CTORCH_SPARE"] = "0-0-1";
  o.setEnv["CTORCH_REPLACEMENT"] = "1";
  const auto r = ctorch::test::run(o);
  INFO(show(r));
  REQUIRE(r.ok());
  CHECK_THAT(r.output, Catch::Contains("ignoring CTORCH_REPLACEMENT, CTORCH_SPARE from the environment"));

  auto alone = trainAlone(dir.path(), {"--model", "linear", "--dataset", "synthetic-regression", "--epochs", "1"},
                          std::chrono::seconds(20));
  alone.setEnv["CTORCH_SPARE"] = "x";
  const auto a = ctorch::test::run(alone);
  INFO(show(a));
  CHECK(a.exitCode == ctorch::contract::kExitUsage);
  CHECK(a.elapsed < std::chrono::seconds(15));
  CHECK_THAT(a.output, Catch::Contains("not started as a spare by ctorchrun"));
}

TEST_CASE("control channel: a waiting spare answers SIGTERM at once", "[trainer][process][control]") {
  TempDir dir("control-spare-term");
  Process p(trainUnderLauncher(dir.path(), 2, kSlowToy,
                               {"--recovery", "in-place", "--max-restarts", "3", "--spare-workers", "1"}));
  const int spare = waitForPid([&] { return findProcessWith(dir.path(), ctorch::contract::env::kSpare); });
  REQUIRE(spare > 0);
  REQUIRE(waitForOutput(p, std::regex("epoch 1/8"), std::chrono::seconds(60)));
  const auto sent = std::chrono::steady_clock::now();
  REQUIRE(::kill(spare, SIGTERM) == 0);
  while (alive(spare) && std::chrono::steady_clock::now() - sent < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // Gone (a zombie until the agent reaps it counts as gone: kill(0) still succeeds on a zombie, so
  // look at its state).
  std::ifstream stat("/proc/" + std::to_string(spare) + "/stat");
  std::string statLine;
  std::getline(stat, statLine);
  const bool gone = statLine.empty() || statLine.find(") Z") != std::string::npos;
  CHECK(gone);
  CHECK(std::chrono::steady_clock::now() - sent < std::chrono::seconds(5));
  const auto r = p.wait();
  INFO(show(r));
  REQUIRE(r.ok());
}

TEST_CASE("control channel: --standalone's stores listen on the loopback only", "[trainer][process][control]") {
  TempDir dir("control-loopback");
  Process p(trainUnderLauncher(dir.path(), 1, kSlowToy, {"--recovery", "in-place"}));
  const int worker = waitForPid([&] { return findWorkerPid(dir.path(), 0); });
  REQUIRE(worker > 0);
  const int port = std::stoi(environOf(worker).at("MASTER_PORT"));
  // Every listening TCP socket on that port (IPv4 and IPv6 tables), with its local address.
  std::vector<std::string> listening;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A: LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) listening.push_back(local.substr(0, colon));
    }
  }
  p.signalGroup(SIGKILL);
  p.wait();
  INFO("listening addresses: " << listening.size());
  REQUIRE_FALSE(listening.empty());
  for (const auto& address : listening) CHECK(address == "0100007F");  // 127.0.0.1, nothing else
}
