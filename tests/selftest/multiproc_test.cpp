// Tests of the multi-process test support itself: a harness that cannot fail proves nothing.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"

#include "ctorch/store/tcp_store_client.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>

using namespace ctorch::test;

CTORCH_TEST_WORKER(echo_rank) {
  std::printf("rank=%s world=%s port=%s arg=%s\n", std::getenv("RANK"), std::getenv("WORLD_SIZE"),
              std::getenv("MASTER_PORT"), args.empty() ? "" : args[0].c_str());
  return std::atoi(std::getenv("RANK"));  // rank r exits with r
}

CTORCH_TEST_WORKER(sleep_forever) {
  std::this_thread::sleep_for(std::chrono::hours(1));
  return 0;
}

CTORCH_TEST_WORKER(crash) {
  std::raise(SIGSEGV);
  return 0;
}

TEST_CASE("selftest: workers get the torchrun environment and their own exit codes") {
  auto results = runWorkerGroup({.worker = "echo_rank", .worldSize = 3, .args = {"x"}});
  REQUIRE(results.size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(results[r].exitCode == r);
    CHECK_THAT(results[r].output, Catch::Contains("rank=" + std::to_string(r) + " world=3"));
    CHECK_THAT(results[r].output, Catch::Contains("arg=x"));
  }
}

TEST_CASE("selftest: a hanging worker is killed at the deadline and reported as timed out") {
  auto results = runWorkerGroup(
      {.worker = "sleep_forever", .worldSize = 1, .timeout = std::chrono::milliseconds(300)});
  CHECK(results[0].timedOut);
  CHECK_FALSE(results[0].ok());
}

TEST_CASE("selftest: a crash is reported with its signal and stops the group early") {
  WorkerGroupOptions o;
  o.worker = "crash";
  o.worldSize = 1;
  auto results = runWorkerGroup(o);
  CHECK(results[0].termSignal == SIGSEGV);
}

// Rank r writes key r into the store at MASTER_PORT and reads every other rank's: the harness's
// store serves them all (no LibTorch here: ctorchrun's own client).
CTORCH_TEST_WORKER(store_roundtrip) {
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = std::atoi(std::getenv("WORLD_SIZE"));
  std::printf("agent store=%s restart count=%s\n", std::getenv("TORCHELASTIC_USE_AGENT_STORE"),
              std::getenv("TORCHELASTIC_RESTART_COUNT"));
  ctorch::store::TcpStoreClientOptions o;
  o.timeout = std::chrono::seconds(60);
  ctorch::store::TcpStoreClient client(std::getenv("MASTER_ADDR"),
                                       static_cast<std::uint16_t>(std::atoi(std::getenv("MASTER_PORT"))), o);
  const auto text = std::to_string(rank * 10);
  client.set("rank" + std::to_string(rank), ctorch::store::Bytes(text.begin(), text.end()));
  for (int r = 0; r < world; ++r) {
    client.wait({"rank" + std::to_string(r)});
    const auto value = client.get("rank" + std::to_string(r));
    std::printf("rank %d read rank%d=%s\n", rank, r, std::string(value.begin(), value.end()).c_str());
  }
  return 0;
}

TEST_CASE("selftest: the harness hosts the store on a port it bound and every rank is its client") {
  auto results = runWorkerGroup({.worker = "store_roundtrip", .worldSize = 3});
  requireAllOk(results);
  for (int r = 0; r < 3; ++r) {
    CHECK_THAT(results[r].output, Catch::Contains("agent store=True restart count=0"));
    for (int other = 0; other < 3; ++other)
      CHECK_THAT(results[r].output, Catch::Contains("rank " + std::to_string(r) + " read rank" + std::to_string(other) +
                                                    "=" + std::to_string(other * 10)));
  }
}

TEST_CASE("selftest: fixed-port candidates lie below the ephemeral range and a taken one is retried") {
  int low = 0, high = 0;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  REQUIRE(low > 20000);
  std::vector<int> tried;
  const bool taken = withFreshPort([&](int port) {
    tried.push_back(port);
    return tried.size() < 3;  // the first two "were taken"
  });
  CHECK_FALSE(taken);
  REQUIRE(tried.size() == 3);
  for (int port : tried) {
    CHECK(port >= 20000);
    CHECK(port < low);
  }
  // A port that stays taken is given up after kFreshPortAttempts, with the last result.
  int calls = 0;
  CHECK(withFreshPort([&](int) { return ++calls > 0; }));
  CHECK(calls == kFreshPortAttempts);
}

TEST_CASE("selftest: what says a port was taken, and what does not") {
  CHECK(portTaken("ctorchrun: error: --master-port 29500: port already in use (another job's store?)"));
  CHECK(portTaken("The server socket has failed to bind to [::]:29500 (errno: 98 - Address already in use)."));
  CHECK(portTaken("OSError: [Errno 98] Address already in use"));
  CHECK_FALSE(portTaken("Connection refused"));
  CHECK_FALSE(portTaken(std::vector<ProcessResult>(2)));
}

TEST_CASE("selftest: a reserved port refuses connections and cannot be bound by anyone else") {
  ReservedPort reserved;
  REQUIRE(reserved.port() > 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<std::uint16_t>(reserved.port()));
  int c = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(c >= 0);
  CHECK(::connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0);
  CHECK(errno == ECONNREFUSED);
  ::close(c);
  int b = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(b, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as c10d's server sets it
  CHECK(::bind(b, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0);
  CHECK(errno == EADDRINUSE);
  ::close(b);
}
