// ctorch::SharedMemoryAllreduce between real processes of one host (real TCPStore and Gloo for the
// set-up): exact sums and means in rank order for every dtype and size (across chunk boundaries),
// asynchronous calls in order, nothing left in /dev/shm, a dead peer noticed long before the
// timeout, a stopped peer turned into DistributedTimeout naming it, and a rank that cannot map the
// segment (its own /dev/shm) making every rank fall back.
#include "ctorch_catch.hpp"

#include "ddp_test_util.hpp"
#include "multiproc.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/errors.hpp"
#include "ddp/shared_memory_allreduce.hpp"

#include <torch/torch.h>

#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <regex>
#include <thread>

using ctorch::SharedMemoryAllreduce;
using ctorch::test::runWorkerGroup;
using ddptest::arg;
using ddptest::argInt;
namespace fs = std::filesystem;

namespace {

int shmInitGroup(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(timeout));
  return ctorch::getRank();
}

void shmFinishGroup() {
  ctorch::barrier();
  ctorch::destroyProcessGroup();
}

// Rank r's tensor: a function of (dtype, size, r) only, so every rank can compute every other's.
torch::Tensor shmInput(torch::ScalarType dtype, std::int64_t n, int r) {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(1000 * r + n);
  if (at::isFloatingType(dtype)) return torch::randn({n}, g, torch::TensorOptions().dtype(torch::kFloat64)).to(dtype);
  return torch::randint(-1000, 1000, {n}, g, torch::TensorOptions().dtype(dtype));
}

// What the segment owes: the sum in rank order (as the allreduce adds: slot 0 + slot 1, then the
// rest), then one division for the mean.
torch::Tensor shmExpected(torch::ScalarType dtype, std::int64_t n, int world, bool average) {
  auto sum = shmInput(dtype, n, 0) + shmInput(dtype, n, 1);
  for (int r = 2; r < world; ++r) sum.add_(shmInput(dtype, n, r));
  return average ? sum / world : sum;
}

// Polls `done` every millisecond for up to a minute (a bound against a hang, not a measure).
bool waitFor(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

bool waitForFile(const fs::path& file) {
  return waitFor([&] { return fs::exists(file); });
}

int shmEntriesOf(pid_t pid) {
  int count = 0;
  const std::string prefix = "ctorch-allreduce-" + std::to_string(pid) + "-";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec))
    if (e.path().filename().string().rfind(prefix, 0) == 0) ++count;
  return count;
}

} // namespace

CTORCH_TEST_WORKER(shm_exact) {
  const int rank = shmInitGroup(), world = ctorch::getWorldSize();
  const auto chunk = argInt(args, "chunk", 1 << 20);
  auto shm = SharedMemoryAllreduce::create(ctorch::getDefaultGroup(),
                                           ctorch::SharedMemoryAllreduceOptions().chunkBytes(chunk));
  if (!shm) {
    std::cout << "no segment" << std::endl;
    return 1;
  }
  std::cout << "segment entries left in /dev/shm " << shmEntriesOf(::getpid()) << std::endl;
  int failures = 0, checks = 0;
  for (auto dtype : {torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kInt64, torch::kInt32})
    for (std::int64_t n : {0L, 1L, 7L, 1025L, 262144L, 300001L})
      for (bool average : {false, true}) {
        if (average && !at::isFloatingType(dtype)) continue;
        auto t = shmInput(dtype, n, rank);
        shm->allreduce(t, average ? SharedMemoryAllreduce::Op::kAverage : SharedMemoryAllreduce::Op::kSum);
        ++checks;
        if (!torch::equal(t, shmExpected(dtype, n, world, average))) {
          ++failures;
          std::cout << "FAIL " << c10::toString(dtype) << " n=" << n << " average=" << average << std::endl;
        }
      }
  // Several calls in flight at once complete in order, each with its own result.
  std::vector<torch::Tensor> tensors;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  for (std::int64_t n : {5000L, 70000L, 3L}) {
    tensors.push_back(shmInput(torch::kFloat32, n, rank));
    futures.push_back(shm->allreduceAsync(tensors.back()));
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    futures[i]->wait();
    ++checks;
    if (!torch::equal(futures[i]->value().toTensor(), shmExpected(torch::kFloat32, tensors[i].numel(), world, false)))
      ++failures, std::cout << "FAIL async " << i << std::endl;
  }
  // A synchronous call made while calls are still queued runs after them, on the calling thread.
  {
    std::vector<torch::Tensor> queued{shmInput(torch::kFloat32, 90000, rank), shmInput(torch::kFloat32, 17, rank)};
    auto first = shm->allreduceAsync(queued[0]);
    auto second = shm->allreduceAsync(queued[1]);
    auto now = shmInput(torch::kFloat64, 4099, rank);
    shm->allreduce(now);
    checks += 3;
    if (!second->completed() || !first->completed()) ++failures, std::cout << "FAIL queued calls not done first" << std::endl;
    first->wait();
    second->wait();
    if (!torch::equal(queued[0], shmExpected(torch::kFloat32, 90000, world, false)) ||
        !torch::equal(queued[1], shmExpected(torch::kFloat32, 17, world, false)) ||
        !torch::equal(now, shmExpected(torch::kFloat64, 4099, world, false)))
      ++failures, std::cout << "FAIL queued then synchronous" << std::endl;
  }
  // The statistics, by the order of arrival, not by durations: rank r enters the call only once rank
  // r - 1 is known to wait at its first barrier (its own counter says so, read while its worker
  // thread is in the call), so the last rank arrives last there and every other rank waits for it.
  // At each of the call's two barriers exactly one rank arrives last (the parent sums them).
  {
    const fs::path dir = arg(args, "dir");
    const auto before = shm->stats();
    if (rank > 0 && !waitForFile(dir / ("waiting-" + std::to_string(rank - 1))))
      ++failures, std::cout << "FAIL rank " << rank - 1 << " never said it waited" << std::endl;
    auto t = shmInput(torch::kFloat32, 1000, rank);
    bool sawWait = true;
    if (rank + 1 < world) {
      auto done = shm->allreduceAsync(t);
      sawWait = waitFor([&] { return shm->stats().waits > before.waits || done->completed(); }) &&
                shm->stats().waits > before.waits;
      if (sawWait) std::ofstream(dir / ("waiting-" + std::to_string(rank))) << "x";
      done->wait();
    } else {
      shm->allreduce(t);
    }
    const auto after = shm->stats();
    const auto waits = after.waits - before.waits, lasts = after.lastArrivals - before.lastArrivals;
    const bool last = rank + 1 == world;
    ++checks;
    const bool ok = after.calls == before.calls + 1 && after.waiting <= after.total && waits + lasts == 2 &&
                    (last ? lasts >= 1 : sawWait && waits >= 1 && after.waiting > before.waiting) &&
                    torch::equal(t, shmExpected(torch::kFloat32, 1000, world, false));
    if (!ok) ++failures;
    std::cout << (ok ? "" : "FAIL ") << "stats: calls " << after.calls << ", waits +" << waits << ", last arrivals +"
              << lasts << std::endl;
  }
  // Bad input is refused in one line, before anything is shared (so the ranks stay in step).
  try {
    auto strided = torch::ones({4, 4}).t();
    shm->allreduce(strided);
    ++failures;
  } catch (const ctorch::ConfigError& e) {
    std::cout << "refused: " << e.what() << std::endl;
  }
  std::cout << "checks " << checks << " failures " << failures << std::endl;
  shm.reset();
  shmFinishGroup();
  return failures == 0 ? 0 : 1;
}

// Rank `victim` exits without a word after the set-up; the others are inside an allreduce with a
// 60 s timeout and must learn of it from the process table at once.
CTORCH_TEST_WORKER(shm_dead_peer) {
  const int rank = shmInitGroup(), world = ctorch::getWorldSize();
  auto shm = SharedMemoryAllreduce::create(ctorch::getDefaultGroup());
  if (!shm) return 1;
  if (rank == world - 1) {
    std::cout << "rank " << rank << " leaves" << std::endl;
    std::_Exit(3);
  }
  auto t = torch::ones({100000});
  const auto start = std::chrono::steady_clock::now();
  try {
    shm->allreduce(t);
    std::cout << "no error" << std::endl;
    return 1;
  } catch (const ctorch::DistributedTimeout& e) {
    std::cout << "timeout instead: " << e.what() << std::endl;
    return 1;
  } catch (const ctorch::DistributedError& e) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cout << "caught: " << e.what() << " (after " << seconds << " s)" << std::endl;
  }
  // Later calls fail at once.
  try {
    shm->allreduce(t);
  } catch (const ctorch::DistributedError& e) {
    std::cout << "again: " << e.what() << std::endl;
  }
  std::_Exit(0);  // the group cannot be finished without the dead rank
}

// Rank 1 stops answering (it sleeps, as a SIGSTOPped process would) until rank 0 has given up.
CTORCH_TEST_WORKER(shm_stopped_peer) {
  const int rank = shmInitGroup();
  auto shm = SharedMemoryAllreduce::create(ctorch::getDefaultGroup(),
                                           ctorch::SharedMemoryAllreduceOptions().timeout(std::chrono::seconds(1)));
  if (!shm) return 1;
  const fs::path done = arg(args, "dir") + "/rank0-done";
  if (rank == 1) {
    for (int i = 0; i < 600 && !fs::exists(done); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::_Exit(0);
  }
  auto t = torch::ones({1000});
  int code = 1;
  try {
    shm->allreduce(t);
    std::cout << "no error" << std::endl;
  } catch (const ctorch::DistributedTimeout& e) {
    std::cout << "caught timeout: " << e.what() << std::endl;
    code = 0;
  } catch (const std::exception& e) {
    std::cout << "other error: " << e.what() << std::endl;
  }
  std::ofstream(done) << "x";
  std::_Exit(code);
}

// The last rank sees another /dev/shm (its own mount namespace): nobody may use the segment.
CTORCH_TEST_WORKER(shm_fallback) {
  const int rank = shmInitGroup(), world = ctorch::getWorldSize();
  bool isolated = true;
  if (rank == world - 1) {
    // Mounts stay private to the new namespace: "/" where it is a mount point, else (a chroot, as
    // the modern lane's) /dev/shm itself.
    isolated = ::unshare(CLONE_NEWNS) == 0 &&
               (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 ||
                ::mount("none", "/dev/shm", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0) &&
               ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=16m") == 0;
    if (!isolated) std::cout << "cannot isolate /dev/shm: " << std::strerror(errno) << std::endl;
  }
  // Every rank learns whether the isolation worked (an unprivileged run skips the test).
  auto flag = torch::tensor({isolated ? 1 : 0});
  std::vector<torch::Tensor> t{flag};
  c10d::AllreduceOptions min;
  min.reduceOp = c10d::ReduceOp::MIN;
  ctorch::getDefaultGroup()->allreduce(t, min)->wait();
  if (flag.item<int>() == 0) {
    std::cout << "SKIP isolation" << std::endl;
    shmFinishGroup();
    return 0;
  }
  auto shm = SharedMemoryAllreduce::create(ctorch::getDefaultGroup());
  std::cout << (shm ? "segment shared" : "fallback") << std::endl;
  // No name is left behind by the attempt either.
  if (rank == 0) std::cout << "segment entries left in /dev/shm " << shmEntriesOf(::getpid()) << std::endl;
  shmFinishGroup();
  return shm ? 1 : 0;
}

TEST_CASE("shared-memory allreduce: exact rank-order sums and means for every dtype and size, on 2 and 3 ranks",
          "[ddp][shm]") {
  for (int world : {2, 3})
    for (const char* chunk : {"chunk=4096", "chunk=1048576"}) {
      ctorch::test::TempDir dir("shm-exact");
      auto results = runWorkerGroup({.worker = "shm_exact", .worldSize = world, .args = {chunk, "dir=" + dir.path().string()}});
      INFO("world " << world << " " << chunk);
      ctorch::test::requireAllOk(results);
      long lastArrivals = 0;
      for (const auto& r : results) {
        CHECK_THAT(r.output, Catch::Contains("failures 0"));
        CHECK_THAT(r.output, Catch::Contains("refused: SharedMemoryAllreduce::allreduce takes a dense, contiguous"));
        std::smatch m;
        if (std::regex_search(r.output, m, std::regex(R"(last arrivals \+(\d+))"))) lastArrivals += std::stol(m[1]);
      }
      CHECK(lastArrivals == 2);  // one rank arrives last at each of the call's two barriers
      CHECK_THAT(results[0].output, Catch::Contains("segment entries left in /dev/shm 0"));
    }
}

TEST_CASE("shared-memory allreduce: a peer that exits is noticed at once, by every rank left, without the timeout",
          "[ddp][shm][errors]") {
  for (int world : {2, 3}) {
    ctorch::test::WorkerGroupOptions o;
    o.worker = "shm_dead_peer";
    o.worldSize = world;
    o.expectedExitCodes = {3};  // the leaver's: the others still have to notice it
    auto results = runWorkerGroup(o);
    for (int r = 0; r + 1 < world; ++r) {
      INFO("world " << world << " rank " << r << ": " << results[r].output);
      CHECK(results[r].ok());
      // Rank r either saw the process gone or the other survivor's abort word: both name a rank.
      const bool sawExit = results[r].output.find("(pid ") != std::string::npos &&
                           results[r].output.find("exited while rank " + std::to_string(r) + " waited for it") !=
                               std::string::npos;
      const bool sawAbort = results[r].output.find("failed, so rank " + std::to_string(r) + " cannot go on") !=
                            std::string::npos;
      CHECK((sawExit || sawAbort));
      CHECK_THAT(results[r].output, Catch::Contains("again: shared-memory allreduce:"));
      CHECK_THAT(results[r].output, Catch::Contains("(an earlier call failed)"));
    }
    CHECK(results[world - 1].exitCode == 3);
  }
}

TEST_CASE("shared-memory allreduce: a peer that stops answering becomes DistributedTimeout naming it", "[ddp][shm][errors]") {
  ctorch::test::TempDir dir("shm-stopped");
  auto results = runWorkerGroup({.worker = "shm_stopped_peer", .worldSize = 2, .args = {"dir=" + dir.path().string()}});
  ctorch::test::requireAllOk(results);
  CHECK_THAT(results[0].output,
             Catch::Contains("caught timeout: shared-memory allreduce: timed out after 1 s: rank 0 waited for rank(s) 1"));
}

TEST_CASE("shared-memory allreduce: a rank that cannot map the segment makes every rank fall back", "[ddp][shm]") {
  auto results = runWorkerGroup({.worker = "shm_fallback", .worldSize = 3});
  ctorch::test::requireAllOk(results);
  if (results[2].output.find("SKIP isolation") != std::string::npos)
    CTORCH_SKIP("cannot give a process its own /dev/shm here (needs root): " + results[2].output);
  for (const auto& r : results) CHECK_THAT(r.output, Catch::Contains("fallback"));
  CHECK_THAT(results[0].output, Catch::Contains("segment entries left in /dev/shm 0"));
}
