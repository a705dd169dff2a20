// Readers: IDX (plain and gzip), CIFAR-10 batches, real Fashion-MNIST, the registry, synthetic sets;
// every error kind on a corrupt file, each a one-line message naming the file.
#include "ctorch_catch.hpp"

#include <torch/torch.h>

#include <cstdio>
#include <functional>

#include <ctorch/data/cifar.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/data/idx.hpp>
#include <ctorch/data/registry.hpp>
#include <ctorch/data/synthetic.hpp>

#include "multiproc.hpp"
#include "test_files.hpp"

using namespace ctorch::data;
using namespace ctorch::test;
namespace fs = std::filesystem;

namespace {

// Runs fn, requires it to throw exactly E (or a subclass) and returns the message, which must be
// one line.
template <typename E>
std::string errorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    std::string message = e.what();
    INFO("message: " << message);
    CHECK(message.find('\n') == std::string::npos);
    return message;
  } catch (const std::exception& e) {
    FAIL("wrong exception type: " << e.what());
  }
  FAIL("no exception");
  return {};
}

DatasetInfo mnistInfo() {
  DatasetInfo info;
  info.name = "test-mnist";
  info.numClasses = 10;
  return info;
}

// A directory with MNIST-format train files (n images of 4x3) and test files (2 images).
void writeMnistDir(const fs::path& dir, uint32_t n, bool gz) {
  fs::create_directories(dir);
  auto put = [&](const std::string& name, const std::string& bytes) {
    if (gz) writeGzip(dir / (name + ".gz"), bytes);
    else writeFile(dir / name, bytes);
  };
  put("train-images-idx3-ubyte", idxBytes(2051, {n, 4, 3}, imagePixels(n, 4, 3)));
  put("train-labels-idx1-ubyte", idxBytes(2049, {n}, labelBytes(n)));
  put("t10k-images-idx3-ubyte", idxBytes(2051, {2, 4, 3}, imagePixels(2, 4, 3)));
  put("t10k-labels-idx1-ubyte", idxBytes(2049, {2}, labelBytes(2)));
}

void checkMnistContent(const InMemoryDataset& ds, uint32_t n) {
  REQUIRE(ds.inputs().sizes() == torch::IntArrayRef({n, 1, 4, 3}));
  REQUIRE(ds.inputs().scalar_type() == torch::kByte);
  REQUIRE(ds.targets().sizes() == torch::IntArrayRef({n}));
  REQUIRE(ds.targets().scalar_type() == torch::kLong);
  for (int64_t i = 0; i < n; ++i) {
    CHECK(ds.targets()[i].item<int64_t>() == (i * 3) % 10);
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 3; ++c)
        CHECK(ds.inputs()[i][0][r][c].item<int>() == (i * 31 + r * 7 + c) % 256);
  }
}

}  // namespace

TEST_CASE("idx: plain MNIST-format files read with the right shape and values", "[idx]") {
  TempDir dir;
  writeMnistDir(dir.path(), 5, false);
  auto ds = readMnist(dir.path(), Split::Train, mnistInfo());
  checkMnistContent(ds, 5);
  CHECK(readMnist(dir.path(), Split::Test, mnistInfo()).size() == 2);
}

TEST_CASE("idx: gzip files read identically and are recognised by content not name", "[idx]") {
  TempDir dir;
  writeMnistDir(dir.path() / "gz", 5, true);
  checkMnistContent(readMnist(dir.path() / "gz", Split::Train, mnistInfo()), 5);
  // A gzip stream without the .gz suffix, and a plain file with it, both still read.
  writeGzip(dir / "images-gz-without-suffix", idxBytes(2051, {5, 4, 3}, imagePixels(5, 4, 3)));
  writeFile(dir / "plain.gz", idxBytes(2051, {5, 4, 3}, imagePixels(5, 4, 3)));
  auto a = readIdxImages(dir / "images-gz-without-suffix");
  auto b = readIdxImages(dir / "plain.gz");
  CHECK(torch::equal(a, b));
}

TEST_CASE("idx: generic reader handles multi-byte big-endian types", "[idx]") {
  TempDir dir;
  std::string data;
  for (uint32_t v : {1u, 256u, 0xfffffffeu, 70000u, 5u, 6u}) appendBigEndian32(data, v);
  writeFile(dir / "ints", idxBytes(0x00000C02, {2, 3}, data));
  auto t = readIdx(dir / "ints");
  REQUIRE(t.scalar_type() == torch::kInt);
  REQUIRE(t.sizes() == torch::IntArrayRef({2, 3}));
  CHECK(t[0][0].item<int>() == 1);
  CHECK(t[0][1].item<int>() == 256);
  CHECK(t[0][2].item<int>() == -2);
  CHECK(t[1][0].item<int>() == 70000);

  std::string floats;
  float f = 1.5f;
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  appendBigEndian32(floats, bits);
  writeFile(dir / "floats", idxBytes(0x00000D01, {1}, floats));
  CHECK(readIdx(dir / "floats")[0].item<float>() == 1.5f);
}

TEST_CASE("idx: torchvision's raw/ layout and the dotted file names are found", "[idx]") {
  TempDir dir;
  writeMnistDir(dir.path() / "FashionMNIST" / "raw", 3, true);
  auto files = findMnistFiles(dir.path(), Split::Train);
  CHECK(files.images == dir.path() / "FashionMNIST" / "raw" / "train-images-idx3-ubyte.gz");
  fs::create_directories(dir / "dotted");
  writeFile(dir / "dotted" / "t10k-images.idx3-ubyte", idxBytes(2051, {1, 4, 3}, imagePixels(1, 4, 3)));
  writeFile(dir / "dotted" / "t10k-labels.idx1-ubyte", idxBytes(2049, {1}, labelBytes(1)));
  CHECK(readMnist(dir / "dotted", Split::Test, mnistInfo()).size() == 1);
}

TEST_CASE("idx: a missing file or directory is a one-line error naming it", "[idx][errors]") {
  TempDir dir;
  auto m = errorOf<DataFileError>([&] { readIdxImages(dir / "nope-images"); });
  CHECK_THAT(m, Catch::Contains((dir / "nope-images").string()) && Catch::Contains("missing file"));
  m = errorOf<DataFileError>([&] { readMnist(dir / "no-such-dir", Split::Train, mnistInfo()); });
  CHECK_THAT(m, Catch::Contains((dir / "no-such-dir").string()) && Catch::Contains("missing"));
  // Images present, labels missing: names the label file looked for.
  writeFile(dir / "train-images-idx3-ubyte", idxBytes(2051, {1, 4, 3}, imagePixels(1, 4, 3)));
  m = errorOf<DataFileError>([&] { readMnist(dir.path(), Split::Train, mnistInfo()); });
  CHECK_THAT(m, Catch::Contains("train-labels-idx1-ubyte"));
  m = errorOf<DataFileError>([&] { readIdx(dir.path()); });
  CHECK_THAT(m, Catch::Contains("is a directory"));
}

TEST_CASE("idx: wrong magic numbers say expected versus found", "[idx][errors]") {
  TempDir dir;
  writeFile(dir / "labels", idxBytes(2049, {3}, labelBytes(3)));
  writeFile(dir / "images", idxBytes(2051, {1, 4, 3}, imagePixels(1, 4, 3)));
  auto m = errorOf<DataFormatError>([&] { readIdxImages(dir / "labels"); });
  CHECK_THAT(m, Catch::Contains((dir / "labels").string()) &&
                    Catch::Contains("wrong magic number: expected 2051") && Catch::Contains("found 2049"));
  m = errorOf<DataFormatError>([&] { readIdxLabels(dir / "images"); });
  CHECK_THAT(m, Catch::Contains("expected 2049") && Catch::Contains("found 2051"));
  // Not an IDX file at all (e.g. a text file).
  writeFile(dir / "text", "hello world, not idx");
  m = errorOf<DataFormatError>([&] { readIdx(dir / "text"); });
  CHECK_THAT(m, Catch::Contains((dir / "text").string()) && Catch::Contains("not an IDX file"));
}

TEST_CASE("idx: truncated data or header and trailing bytes are errors with the sizes", "[idx][errors]") {
  TempDir dir;
  // Header says 5 images of 4x3 = 60 bytes; only 48 follow.
  writeFile(dir / "short", idxBytes(2051, {5, 4, 3}, imagePixels(4, 4, 3)));
  auto m = errorOf<DataFormatError>([&] { readIdxImages(dir / "short"); });
  CHECK_THAT(m, Catch::Contains((dir / "short").string()) && Catch::Contains("truncated") &&
                    Catch::Contains("needs 60 bytes") && Catch::Contains("found 48"));
  // The same, gzip-compressed (a complete gzip stream of too little data).
  writeGzip(dir / "short.gz", idxBytes(2051, {5, 4, 3}, imagePixels(4, 4, 3)));
  m = errorOf<DataFormatError>([&] { readIdxImages(dir / "short.gz"); });
  CHECK_THAT(m, Catch::Contains("needs 60 bytes") && Catch::Contains("found 48"));
  // Header cut inside the sizes.
  writeFile(dir / "header", idxBytes(2051, {5}, ""));
  m = errorOf<DataFormatError>([&] { readIdxImages(dir / "header"); });
  CHECK_THAT(m, Catch::Contains("truncated") && Catch::Contains("3 sizes"));
  // An empty file.
  writeFile(dir / "empty", "");
  m = errorOf<DataFormatError>([&] { readIdx(dir / "empty"); });
  CHECK_THAT(m, Catch::Contains("truncated") && Catch::Contains("magic"));
  // More data than announced.
  writeFile(dir / "long", idxBytes(2051, {1, 4, 3}, imagePixels(2, 4, 3)));
  m = errorOf<DataFormatError>([&] { readIdxImages(dir / "long"); });
  CHECK_THAT(m, Catch::Contains("unexpected data after the 12 bytes"));
}

TEST_CASE("idx: corrupt and truncated gzip streams are unreadable-gzip errors", "[idx][errors]") {
  TempDir dir;
  // Gzip magic, then garbage.
  writeFile(dir / "garbage.gz", std::string("\x1f\x8b\x08\x00", 4) + std::string(64, '\x55'));
  auto m = errorOf<DataFileError>([&] { readIdxImages(dir / "garbage.gz"); });
  CHECK_THAT(m, Catch::Contains((dir / "garbage.gz").string()) && Catch::Contains("unreadable gzip"));
  CHECK(m.find((dir / "garbage.gz").string()) == m.rfind((dir / "garbage.gz").string()));  // named once
  // A valid stream cut in half: zlib reports the early end.
  writeGzip(dir / "whole.gz", idxBytes(2051, {50, 28, 28}, imagePixels(50, 28, 28)));
  std::string whole = readFile(dir / "whole.gz");
  writeFile(dir / "half.gz", whole.substr(0, whole.size() / 2));
  m = errorOf<DataFileError>([&] { readIdxImages(dir / "half.gz"); });
  CHECK_THAT(m, Catch::Contains((dir / "half.gz").string()) && Catch::Contains("truncated or corrupt gzip"));
  CHECK(m.find((dir / "half.gz").string()) == m.rfind((dir / "half.gz").string()));
  // Control: the uncut file reads.
  CHECK(readIdxImages(dir / "whole.gz").size(0) == 50);
}

TEST_CASE("idx: image/label count mismatch and out-of-range labels name both files", "[idx][errors]") {
  TempDir dir;
  writeFile(dir / "train-images-idx3-ubyte", idxBytes(2051, {5, 4, 3}, imagePixels(5, 4, 3)));
  writeFile(dir / "train-labels-idx1-ubyte", idxBytes(2049, {4}, labelBytes(4)));
  auto m = errorOf<DataFormatError>([&] { readMnist(dir.path(), Split::Train, mnistInfo()); });
  CHECK_THAT(m, Catch::Contains("4 labels but") && Catch::Contains("has 5 images") &&
                    Catch::Contains("train-labels-idx1-ubyte") && Catch::Contains("train-images-idx3-ubyte"));
  writeFile(dir / "train-labels-idx1-ubyte", idxBytes(2049, {5}, std::string("\x01\x02\x0c\x03\x04", 5)));
  m = errorOf<DataFormatError>([&] { readMnist(dir.path(), Split::Train, mnistInfo()); });
  CHECK_THAT(m, Catch::Contains("label 12 at index 2 is out of range [0, 10)"));
}

TEST_CASE("cifar10: batches read in order with CHW layout", "[cifar]") {
  TempDir dir;
  const fs::path base = dir / "cifar-10-batches-bin";  // the archive's folder is found too
  fs::create_directories(base);
  for (int i = 1; i <= 5; ++i) {
    writeFile(base / ("data_batch_" + std::to_string(i) + ".bin"), cifarRecords(2, (i - 1) * 2));
  }
  writeFile(base / "test_batch.bin", cifarRecords(3, 100));
  DatasetInfo info;
  info.name = "cifar10";
  auto train = readCifar10(dir.path(), Split::Train, info);
  REQUIRE(train.inputs().sizes() == torch::IntArrayRef({10, 3, 32, 32}));
  REQUIRE(train.targets().sizes() == torch::IntArrayRef({10}));
  for (int64_t i = 0; i < 10; ++i) {
    CHECK(train.targets()[i].item<int64_t>() == i % 10);
    for (int64_t ch = 0; ch < 3; ++ch) {
      for (int64_t p : {0, 31, 32, 1023}) {
        CHECK(train.inputs()[i][ch][p / 32][p % 32].item<int>() == (i * 13 + ch * 101 + p) % 256);
      }
    }
  }
  auto test = readCifar10(base, Split::Test, info);
  REQUIRE(test.size() == 3);
  CHECK(test.targets()[0].item<int64_t>() == 0);  // record 100
  CHECK(test.inputs()[2][1][0][5].item<int>() == (102 * 13 + 101 + 5) % 256);
}

TEST_CASE("cifar10: truncated or missing batches and bad labels are one-line errors", "[cifar][errors]") {
  TempDir dir;
  for (int i = 1; i <= 5; ++i) {
    if (i != 3) writeFile(dir / ("data_batch_" + std::to_string(i) + ".bin"), cifarRecords(1));
  }
  DatasetInfo info;
  info.name = "cifar10";
  auto m = errorOf<DataFileError>([&] { readCifar10(dir.path(), Split::Train, info); });
  CHECK_THAT(m, Catch::Contains((dir / "data_batch_3.bin").string()) && Catch::Contains("missing file"));
  writeFile(dir / "short.bin", cifarRecords(2).substr(0, 3073 + 100));
  m = errorOf<DataFormatError>([&] { readCifar10Batch(dir / "short.bin"); });
  CHECK_THAT(m, Catch::Contains((dir / "short.bin").string()) && Catch::Contains("truncated") &&
                    Catch::Contains("3173 bytes") && Catch::Contains("3073"));
  writeFile(dir / "empty.bin", "");
  m = errorOf<DataFormatError>([&] { readCifar10Batch(dir / "empty.bin"); });
  CHECK_THAT(m, Catch::Contains("0 bytes"));
  std::string bad = cifarRecords(3);
  bad[2 * 3073] = 11;
  writeFile(dir / "label.bin", bad);
  m = errorOf<DataFormatError>([&] { readCifar10Batch(dir / "label.bin"); });
  CHECK_THAT(m, Catch::Contains("label 11 of record 2 is out of range"));
  m = errorOf<DataFileError>([&] { readCifar10(dir / "nowhere", Split::Test, info); });
  CHECK_THAT(m, Catch::Contains((dir / "nowhere").string()));
}

TEST_CASE("fashion-mnist: the real data set loads with its known sizes and statistics", "[real]") {
  if (!fs::exists(fs::path(kDefaultFashionMnistDir) / "train-images-idx3-ubyte.gz")) {
    CTORCH_SKIP("Fashion-MNIST not installed at " << kDefaultFashionMnistDir
                                                  << " (apt-get install dataset-fashion-mnist)");
  }
  auto train = loadDataset({.name = "fashion-mnist", .split = Split::Train});
  REQUIRE(train.inputs().sizes() == torch::IntArrayRef({60000, 1, 28, 28}));
  auto counts = torch::bincount(train.targets());
  CHECK(torch::equal(counts, torch::full({10}, 6000, torch::kLong)));  // balanced by construction
  auto norm = computeNormalization(train.inputs());
  CHECK(norm.mean[0] == Approx(Normalization::fashionMnist().mean[0]).margin(5e-4));
  CHECK(norm.std[0] == Approx(Normalization::fashionMnist().std[0]).margin(5e-4));
  auto test = loadDataset({.name = "fashion-mnist", .split = Split::Test, .limit = 1000});
  CHECK(test.size() == 1000);
  CHECK(test.info().normalization.has_value());
}

TEST_CASE("registry: names and validation errors and limits", "[registry][errors]") {
  CHECK(datasetNames() == std::vector<std::string>{"fashion-mnist", "mnist", "cifar10",
                                                   "synthetic-regression", "synthetic-images"});
  auto m = errorOf<DataOptionsError>([] { loadDataset({.name = "imagenet"}); });
  CHECK(m == "unknown dataset 'imagenet' (known: fashion-mnist, mnist, cifar10, synthetic-regression, "
             "synthetic-images)");
  m = errorOf<DataOptionsError>([] { loadDataset({.name = "cifar10"}); });
  CHECK_THAT(m, Catch::Contains("cifar10") && Catch::Contains("data directory"));
  m = errorOf<DataOptionsError>([] { loadDataset({.name = "synthetic-images", .limit = -3}); });
  CHECK_THAT(m, Catch::Contains("-3"));
  m = errorOf<DataOptionsError>([] { parseSplit("validation"); });
  CHECK_THAT(m, Catch::Contains("'validation'"));
  m = errorOf<DataOptionsError>(
      [] { loadDataset({.name = "synthetic-images", .imageShape = {1, 0, 28}}); });
  CHECK_THAT(m, Catch::Contains("shape"));

  TempDir dir;
  writeMnistDir(dir.path(), 7, true);
  auto limited = loadDataset({.name = "mnist", .root = dir.path(), .limit = 4});
  CHECK(limited.size() == 4);
  CHECK(limited.info().normalization->mean == Normalization::mnist().mean);
  CHECK(loadDataset({.name = "mnist", .root = dir.path(), .limit = 100}).size() == 7);
  CHECK(loadDataset({.name = "synthetic-regression"}).size() == 2048);  // the tutorial's size
  CHECK(loadDataset({.name = "synthetic-regression", .split = Split::Test}).size() == 512);
  CHECK(loadDataset({.name = "synthetic-images", .syntheticSize = 10}).size() == 10);
}

TEST_CASE("synthetic: deterministic from the seed while splits and seeds differ", "[synthetic]") {
  auto a = makeSyntheticRegression(64, 7);
  auto b = makeSyntheticRegression(64, 7);
  REQUIRE(a.inputs().sizes() == torch::IntArrayRef({64, 20}));
  REQUIRE(a.targets().sizes() == torch::IntArrayRef({64, 1}));
  CHECK(torch::equal(a.inputs(), b.inputs()));
  CHECK(torch::equal(a.targets(), b.targets()));
  CHECK_FALSE(torch::equal(a.inputs(), makeSyntheticRegression(64, 8).inputs()));
  CHECK_FALSE(torch::equal(a.inputs(), makeSyntheticRegression(64, 7, Split::Test).inputs()));
  CHECK(a.inputs().min().item<float>() >= 0.0f);
  CHECK(a.inputs().max().item<float>() < 1.0f);

  auto x = makeSyntheticImages(200, {3, 8, 8}, 5, 1);
  auto y = makeSyntheticImages(200, {3, 8, 8}, 5, 1);
  REQUIRE(x.inputs().sizes() == torch::IntArrayRef({200, 3, 8, 8}));
  REQUIRE(x.inputs().scalar_type() == torch::kByte);
  CHECK(torch::equal(x.inputs(), y.inputs()));
  CHECK(torch::equal(x.targets(), y.targets()));
  CHECK(torch::bincount(x.targets(), {}, 5).min().item<int64_t>() > 0);  // every class occurs
  CHECK_FALSE(torch::equal(x.inputs(), makeSyntheticImages(200, {3, 8, 8}, 5, 2).inputs()));
  // Learnable: a sample is nearer its own class mean than any other (nearest-centroid on train
  // classifies most test samples right; chance is 20%).
  auto test = makeSyntheticImages(200, {3, 8, 8}, 5, 1, Split::Test);
  CHECK_FALSE(torch::equal(test.inputs(), x.inputs()));
  auto flat = x.inputs().view({200, -1}).to(torch::kFloat);
  std::vector<torch::Tensor> means;
  for (int64_t c = 0; c < 5; ++c) means.push_back(flat.index({x.targets() == c}).mean(0));
  auto centroids = torch::stack(means);
  auto pred = torch::cdist(test.inputs().view({200, -1}).to(torch::kFloat), centroids).argmin(1);
  CHECK(pred.eq(test.targets()).to(torch::kFloat).mean().item<float>() > 0.9f);
}

TEST_CASE("synthetic: the regression set equals Python's torch.rand with the same seed", "[synthetic][python]") {
  if (!fs::exists("/usr/bin/python3")) CTORCH_SKIP("no /usr/bin/python3");
  auto probe = run({.argv = {"/usr/bin/python3", "-c", "import torch"}});
  if (!probe.ok()) CTORCH_SKIP("/usr/bin/python3 has no torch: " << probe.output);
  auto py = run({.argv = {"/usr/bin/python3", "-c",
                          "import torch\n"
                          "g = torch.Generator().manual_seed(1234)\n"
                          "x = torch.rand(3, 20, generator=g); y = torch.rand(3, 1, generator=g)\n"
                          "print(' '.join(float(v).hex() for v in torch.cat([x.flatten(), y.flatten()])))\n"}});
  REQUIRE(py.ok());
  auto ds = makeSyntheticRegression(3, 1234);
  auto all = torch::cat({ds.inputs().flatten(), ds.targets().flatten()}).to(torch::kDouble);
  std::string mine;
  for (int64_t i = 0; i < all.numel(); ++i) {
    // Python's float.hex and C's %.13a agree for normal numbers: 0x1.<13 hex digits>p<exp>.
    char buf[64];
    double v = all[i].item<double>();
    std::snprintf(buf, sizeof buf, "%s%.13a", i ? " " : "", v);
    mine += buf;
  }
  CHECK(mine + "\n" == py.output);
}
