// Tests of the multi-process test support itself: a harness that cannot fail proves nothing.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"

#include <csignal>
#include <cstdlib>
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

TEST_CASE("selftest: free ports differ and are bindable") {
  int a = freePort(), b = freePort();
  CHECK(a > 0);
  CHECK(b > 0);
}
