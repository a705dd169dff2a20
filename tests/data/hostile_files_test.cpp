// Hostile data files (issue 12): FIFOs and devices in place of a batch, gzip bombs, IDX headers
// that lie or overflow, unreadable directories. Reads that could hang or eat memory without the fix
// run in a child process with a deadline and an address-space limit.
#include "ctorch_catch.hpp"

#include <torch/torch.h>

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <functional>

#include <ctorch/data/cifar.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/data/idx.hpp>

#include "multiproc.hpp"
#include "test_files.hpp"

using namespace ctorch::data;
using namespace ctorch::test;
namespace fs = std::filesystem;

namespace {

template <typename E>
std::string hostileErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("wrong exception type: " << e.what());
  }
  FAIL("no exception");
  return {};
}

// Runs `<self> --ctorch-worker read_data_file <reader> <path>` with a deadline: a reader blocked on
// a FIFO or reading /dev/zero without end fails the test instead of hanging it.
ProcessResult readInChild(const std::string& reader, const fs::path& path, bool asNobody = false) {
  SpawnOptions so;
  so.argv = {selfExe().string(), "--ctorch-worker", "read_data_file", reader, path.string(),
             asNobody ? "nobody" : "self"};
  so.timeout = std::chrono::seconds(90);  // a bound against the hang, far above a LibTorch child's start
  auto r = run(so);
  INFO(r.output);
  CHECK(!r.timedOut);
  CHECK(r.termSignal == 0);
  return r;
}

bool outputHas(const ProcessResult& r, const std::string& text) { return r.output.find(text) != std::string::npos; }

} // namespace

// Prints the reader's error (one line) and exits 0; exits 3 if the read succeeded.
CTORCH_TEST_WORKER(read_data_file) {
  // Without the fix /dev/zero is read until memory runs out: keep that bounded on a shared host.
  struct rlimit limit {};
  getrlimit(RLIMIT_AS, &limit);
  limit.rlim_cur = rlim_t{6} << 30;
  setrlimit(RLIMIT_AS, &limit);
  if (args.at(2) == "nobody" && ::geteuid() == 0) {
    // Root reads everything; permission errors need an ordinary user.
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) {
      std::printf("cannot drop to nobody\n");
      return 4;
    }
  }
  try {
    const std::string& reader = args.at(0);
    const fs::path path = args.at(1);
    if (reader == "cifar-batch") readCifar10Batch(path);
    else if (reader == "idx") readIdx(path);
    else if (reader == "mnist") readMnist(path, Split::Train, DatasetInfo{});
    else if (reader == "cifar") readCifar10(path, Split::Train, DatasetInfo{});
    std::printf("read succeeded\n");
    return 3;
  } catch (const std::exception& e) {
    std::printf("error: %s\n", e.what());
    return 0;
  }
}

TEST_CASE("a FIFO or /dev/zero as a data file is refused without blocking or reading",
          "[data][hostile]") {
  TempDir dir;
  const auto fifo = dir / "data_batch_1.bin";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto r = readInChild("cifar-batch", fifo);
  CHECK(r.exitCode == 0);
  CHECK(outputHas(r, fifo.string() + ": is a FIFO, expected a regular file"));
  r = readInChild("idx", fifo);
  CHECK(outputHas(r, "is a FIFO, expected a regular file"));

  const auto zero = dir / "zero.bin";
  fs::create_symlink("/dev/zero", zero);
  r = readInChild("cifar-batch", zero);
  CHECK(r.exitCode == 0);
  CHECK(outputHas(r, zero.string() + ": is a character device, expected a regular file"));
}

TEST_CASE("a CIFAR-10 gzip bomb is refused after one batch's worth of bytes", "[data][hostile]") {
  // 20,000 records of zeros (61 MB) in a ~60 kB gzip file; the same ratio reaches 3.1 GB from 1 MB.
  TempDir dir;
  const auto bomb = dir / "data_batch_1.bin";
  gzFile f = gzopen(bomb.c_str(), "wb9");
  REQUIRE(f != nullptr);
  const std::string zeros(kCifarRecordBytes * 1000, '\0');
  for (int i = 0; i < 20; ++i) REQUIRE(gzwrite(f, zeros.data(), static_cast<unsigned>(zeros.size())) > 0);
  gzclose(f);
  CHECK(fs::file_size(bomb) < 200 * 1024);
  const auto m = hostileErrorOf<DataFormatError>([&] { readCifar10Batch(bomb); });
  CHECK_THAT(m, Catch::Contains(bomb.string()) && Catch::Contains("more than 10000 records") &&
                    Catch::Contains("30730000 bytes"));
  // Exactly one batch still reads.
  gzFile g = gzopen((dir / "full.bin").c_str(), "wb");
  for (int i = 0; i < 10; ++i) gzwrite(g, zeros.data(), static_cast<unsigned>(zeros.size()));
  gzclose(g);
  CHECK(readCifar10Batch(dir / "full.bin").first.size(0) == 10000);
}

TEST_CASE("an IDX header whose size product wraps to 0 is refused", "[data][hostile][idx]") {
  TempDir dir;
  // 1-byte elements, 2^20 x 2^20 x 2^24: the product is 2^64, 0 in 64-bit arithmetic.
  writeFile(dir / "wrap", idxBytes(0x00000803, {1u << 20, 1u << 20, 1u << 24}, ""));
  auto m = hostileErrorOf<DataFormatError>([&] { readIdx(dir / "wrap"); });
  CHECK_THAT(m, Catch::Contains("header announces more than 1099511627776 bytes"));
}

TEST_CASE("an IDX header announcing more than the file can hold is refused before allocating",
          "[data][hostile][idx]") {
  TempDir dir;
  // 512 GB announced (under the 1 TB cap) in a 20-byte gzip file: at most ~20 kB can inflate.
  writeGzip(dir / "liar.gz", idxBytes(0x00000803, {1u << 19, 1u << 10, 1u << 10}, ""));
  auto m = hostileErrorOf<DataFormatError>([&] { readIdx(dir / "liar.gz"); });
  CHECK_THAT(m, Catch::Contains("needs 549755813888 bytes, found at most") &&
                    Catch::Contains("the most this gzip file can inflate to"));
  writeFile(dir / "liar", idxBytes(0x00000803, {1u << 19, 1u << 10, 1u << 10}, "abc"));
  m = hostileErrorOf<DataFormatError>([&] { readIdx(dir / "liar"); });
  CHECK_THAT(m, Catch::Contains("needs 549755813888 bytes, found 3"));
}

TEST_CASE("an unreadable data directory says permission denied, not missing file",
          "[data][hostile][errors]") {
  TempDir dir;
  fs::permissions(dir.path(), fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  const auto data = dir / "data";
  fs::create_directories(data);
  writeFile(data / "train-images-idx3-ubyte", idxBytes(2051, {1, 4, 3}, imagePixels(1, 4, 3)));
  writeFile(data / "train-labels-idx1-ubyte", idxBytes(2049, {1}, labelBytes(1)));
  writeFile(data / "data_batch_1.bin", cifarRecords(1));
  fs::permissions(data, fs::perms::none);  // EACCES for anyone but root (the child drops root)
  auto r = readInChild("mnist", data, /*asNobody=*/true);
  CHECK(r.exitCode == 0);
  CHECK(outputHas(r, "Permission denied"));
  CHECK(!outputHas(r, "missing"));
  r = readInChild("cifar", data, true);
  CHECK(r.exitCode == 0);
  CHECK(outputHas(r, (data / "data_batch_1.bin").string() + ": cannot open: Permission denied"));
  fs::permissions(data, fs::perms::owner_all);
}
