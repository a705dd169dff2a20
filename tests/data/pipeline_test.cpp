// Transforms, the batch pipeline and the loader: augmentation is a pure function of
// (seed, epoch, index), the vectorised crop/flip equals a per-sample reference, both conversions give
// identical batches, the background loader equals the synchronous one and propagates errors.
#include "ctorch_catch.hpp"

#include <torch/torch.h>

#include <set>

#include <ctorch/data/error.hpp>
#include <ctorch/data/loader.hpp>
#include <ctorch/data/pipeline.hpp>
#include <ctorch/data/synthetic.hpp>
#include <ctorch/data/transforms.hpp>

using namespace ctorch::data;
namespace F = torch::nn::functional;

namespace {

std::shared_ptr<const InMemoryDataset> images(int64_t n = 40, std::vector<int64_t> shape = {3, 8, 8}) {
  return std::make_shared<const InMemoryDataset>(makeSyntheticImages(n, shape, 4, 11));
}

std::shared_ptr<const BatchPipeline> pipeline(std::shared_ptr<const InMemoryDataset> ds, bool augment,
                                              Conversion conversion = Conversion::PerBatch,
                                              uint64_t seed = 5) {
  PipelineOptions o;
  if (augment) o.augment = AugmentOptions{.seed = seed, .padding = 2};
  o.conversion = conversion;
  return std::make_shared<const BatchPipeline>(std::move(ds), o);
}

// Per-sample reference of the crop/flip, written the obvious (slow) way.
torch::Tensor referenceCropFlip(const torch::Tensor& image, const CropFlip& d, int64_t padding) {
  auto padded = F::pad(image.unsqueeze(0), F::PadFuncOptions({padding, padding, padding, padding})).squeeze(0);
  auto out = padded.narrow(1, d.top, image.size(1)).narrow(2, d.left, image.size(2));
  return d.flip ? out.flip({2}) : out;
}

}  // namespace

TEST_CASE("transforms: crop/flip decisions are a pure function of seed and epoch and index", "[transforms]") {
  RandomCropFlip a(AugmentOptions{.seed = 3, .padding = 4});
  RandomCropFlip b(AugmentOptions{.seed = 3, .padding = 4});
  std::set<int64_t> tops, lefts;
  int flips = 0, epochDiffers = 0, seedDiffers = 0;
  RandomCropFlip other(AugmentOptions{.seed = 4, .padding = 4});
  for (int64_t i = 0; i < 2000; ++i) {
    auto d = a.decide(7, i), e = b.decide(7, i);
    REQUIRE((d.top == e.top && d.left == e.left && d.flip == e.flip));
    REQUIRE((d.top >= 0 && d.top <= 8 && d.left >= 0 && d.left <= 8));
    tops.insert(d.top);
    lefts.insert(d.left);
    flips += d.flip;
    auto n = a.decide(8, i);
    epochDiffers += (n.top != d.top || n.left != d.left || n.flip != d.flip);
    auto s = other.decide(7, i);
    seedDiffers += (s.top != d.top || s.left != d.left || s.flip != d.flip);
  }
  CHECK(tops.size() == 9);
  CHECK(lefts.size() == 9);
  CHECK(flips > 900);  // p = 1/2: 1000 +- 22 (1 sigma)
  CHECK(flips < 1100);
  // Same (top, left, flip) by chance has probability 1/162 per sample.
  CHECK(epochDiffers > 1900);
  CHECK(seedDiffers > 1900);
}

TEST_CASE("transforms: the vectorised crop/flip equals a per-sample reference", "[transforms]") {
  auto ds = images(16);
  RandomCropFlip aug(AugmentOptions{.seed = 9, .padding = 3});
  auto idx = torch::arange(16, torch::kLong).flip({0});
  auto out = aug.apply(ds->inputs(), idx, 2);
  REQUIRE(out.sizes() == ds->inputs().sizes());
  int flipped = 0, moved = 0;
  for (int64_t k = 0; k < 16; ++k) {
    auto d = aug.decide(2, idx[k].item<int64_t>());
    flipped += d.flip;
    moved += (d.top != 3 || d.left != 3);
    INFO("sample " << k << " top " << d.top << " left " << d.left << " flip " << d.flip);
    CHECK(torch::equal(out[k], referenceCropFlip(ds->inputs()[k], d, 3)));
  }
  CHECK(flipped > 0);  // the reference exercised both branches
  CHECK(moved > 0);
  // Control: a reference with the flips ignored disagrees somewhere.
  bool anyDiff = false;
  for (int64_t k = 0; k < 16; ++k) {
    auto d = aug.decide(2, idx[k].item<int64_t>());
    d.flip = !d.flip;
    anyDiff |= !torch::equal(out[k], referenceCropFlip(ds->inputs()[k], d, 3));
  }
  CHECK(anyDiff);
  // Per-channel fill for already-normalised images.
  auto fill = torch::tensor({-1.0f, -2.0f, -3.0f});
  RandomCropFlip corner(AugmentOptions{.padding = 3, .randomCrop = true, .horizontalFlip = false});
  auto f = corner.apply(ds->inputs().to(torch::kFloat), idx, 0, fill);
  for (int64_t k = 0; k < 16; ++k) {
    auto d = corner.decide(0, idx[k].item<int64_t>());
    if (d.top < 3 || d.left < 3) {  // the top-left output pixel comes from the padding
      CHECK(f[k][0][0][0].item<float>() == -1.0f);
      CHECK(f[k][2][0][0].item<float>() == -3.0f);
    }
  }
}

TEST_CASE("pipeline: a sample's augmentation does not depend on batch composition or rank split", "[pipeline]") {
  auto p = pipeline(images(), true);
  auto whole = p->batch(std::vector<int64_t>{3, 7, 1, 20, 33, 39}, 4);
  auto alone = p->batch(std::vector<int64_t>{7}, 4);
  CHECK(torch::equal(whole.inputs[1], alone.inputs[0]));
  CHECK(whole.targets[1].item<int64_t>() == alone.targets[0].item<int64_t>());
  // Two "ranks" with a different split of the same samples (world size 2 versus 1).
  auto rank0 = p->batch(std::vector<int64_t>{3, 1, 33}, 4);
  auto rank1 = p->batch(std::vector<int64_t>{7, 20, 39}, 4);
  CHECK(torch::equal(whole.inputs.index_select(0, torch::tensor({0, 2, 4})), rank0.inputs));
  CHECK(torch::equal(whole.inputs.index_select(0, torch::tensor({1, 3, 5})), rank1.inputs));
  // Another epoch augments differently (some of 6 samples differ with near certainty: 1/50 each).
  auto later = p->batch(std::vector<int64_t>{3, 7, 1, 20, 33, 39}, 5);
  CHECK_FALSE(torch::equal(whole.inputs, later.inputs));
  // ... and the same epoch again gives the same batch (a resumed run).
  CHECK(torch::equal(whole.inputs, p->batch(std::vector<int64_t>{3, 7, 1, 20, 33, 39}, 4).inputs));
  // Without augmentation the epoch does not matter.
  auto plain = pipeline(images(), false);
  CHECK(torch::equal(plain->batch(std::vector<int64_t>{3, 7}, 0).inputs,
                     plain->batch(std::vector<int64_t>{3, 7}, 9).inputs));
}

TEST_CASE("pipeline: once and per-batch conversion give bit-identical normalised batches", "[pipeline]") {
  auto ds = images();
  for (bool augment : {false, true}) {
    auto perBatch = pipeline(ds, augment, Conversion::PerBatch);
    auto once = pipeline(ds, augment, Conversion::Once);
    std::vector<int64_t> idx{0, 5, 39, 12, 12};
    auto a = perBatch->batch(idx, 3), b = once->batch(idx, 3);
    INFO("augment " << augment);
    REQUIRE(a.inputs.scalar_type() == torch::kFloat);
    CHECK(torch::equal(a.inputs, b.inputs));
    CHECK(torch::equal(a.targets, b.targets));
  }
  // And they are what the formula says: (pixel / 255 - mean) / std.
  auto p = pipeline(ds, false);
  auto b = p->batch(std::vector<int64_t>{2, 4});
  const auto& n = *ds->info().normalization;
  auto expected = (ds->inputs().index_select(0, torch::tensor({2, 4})).to(torch::kFloat) / 255 -
                   static_cast<float>(n.mean[0])) / static_cast<float>(n.std[0]);
  CHECK(torch::allclose(b.inputs, expected, 1e-6, 1e-6));
  PipelineOptions raw;
  raw.normalize = false;
  auto unnormalised = BatchPipeline(ds, raw).batch(std::vector<int64_t>{2, 4});
  CHECK(torch::equal(unnormalised.inputs,
                     ds->inputs().index_select(0, torch::tensor({2, 4})).to(torch::kFloat).div(255)));
}

TEST_CASE("pipeline: computed normalisation makes inputs zero-mean unit-std", "[pipeline]") {
  auto raw = makeSyntheticImages(500, {2, 6, 6}, 3, 1);
  auto info = raw.info();
  info.normalization = computeNormalization(raw.inputs());
  REQUIRE(info.normalization->mean.size() == 2);
  auto ds = std::make_shared<const InMemoryDataset>(raw.inputs(), raw.targets(), info);
  BatchPipeline p(ds, {});
  auto all = p.batch(torch::arange(500, torch::kLong)).inputs.transpose(0, 1).reshape({2, -1});
  CHECK(all.mean(1).abs().max().item<float>() < 1e-4);
  CHECK((all.std(1, false) - 1).abs().max().item<float>() < 1e-4);
}

TEST_CASE("pipeline: bad indices and bad options are one-line errors", "[pipeline][errors]") {
  auto p = pipeline(images(10), false);
  try {
    p->batch(std::vector<int64_t>{1, 10});
    FAIL("no exception");
  } catch (const DataOptionsError& e) {
    CHECK(std::string(e.what()) == "dataset 'synthetic-images': index 10 out of range [0, 10)");
  }
  CHECK_THROWS_AS(p->batch(std::vector<int64_t>{-1}), DataOptionsError);
  CHECK_THROWS_AS(p->batch(torch::tensor({1.0f})), DataOptionsError);
  auto regression = std::make_shared<const InMemoryDataset>(makeSyntheticRegression(8, 0));
  PipelineOptions o;
  o.augment = AugmentOptions{};
  CHECK_THROWS_WITH(BatchPipeline(regression, o), Catch::Contains("needs images"));
  o.augment->padding = -1;
  CHECK_THROWS_WITH(BatchPipeline(images(2), o), Catch::Contains("padding -1"));
  CHECK_THROWS_WITH(BatchLoader(p, std::vector<int64_t>{0}, LoaderOptions{.batchSize = 0}), Catch::Contains("batch size 0"));
  CHECK_THROWS_WITH(BatchLoader(p, std::vector<int64_t>{0}, LoaderOptions{.prefetch = 3}), Catch::Contains("prefetch 3"));
}

TEST_CASE("loader: background batches equal synchronous ones with skip and drop-last", "[loader]") {
  auto p = pipeline(images(50), true);
  std::vector<int64_t> order(50);
  for (int64_t i = 0; i < 50; ++i) order[i] = (i * 17) % 50;  // a permutation, as a sampler gives
  for (bool dropLast : {false, true}) {
    for (int64_t skip : {0, 2}) {
      std::vector<Batch> reference;
      BatchLoader sync(p, order, {.batchSize = 8, .dropLast = dropLast, .epoch = 3, .skipBatches = skip, .prefetch = 0});
      CHECK(sync.numBatches() == (dropLast ? 6 : 7));
      while (auto b = sync.next()) reference.push_back(*b);
      CHECK(reference.size() == static_cast<size_t>(sync.numBatches() - skip));
      CHECK(reference.back().size() == (dropLast ? 8 : 2));
      CHECK(reference.front().indices[0].item<int64_t>() == order[skip * 8]);
      for (int prefetch : {1, 2}) {
        BatchLoader bg(p, order, {.batchSize = 8, .dropLast = dropLast, .epoch = 3, .skipBatches = skip, .prefetch = prefetch});
        size_t k = 0;
        while (auto b = bg.next()) {
          REQUIRE(k < reference.size());
          CHECK(torch::equal(b->inputs, reference[k].inputs));
          CHECK(torch::equal(b->targets, reference[k].targets));
          CHECK(torch::equal(b->indices, reference[k].indices));
          ++k;
        }
        CHECK(k == reference.size());
        CHECK_FALSE(bg.next().has_value());  // stays at the end
      }
    }
  }
  // A Long tensor of indices is the same as the vector.
  BatchLoader fromTensor(p, torch::tensor(order), {.batchSize = 8, .epoch = 3, .prefetch = 1});
  BatchLoader fromVector(p, order, {.batchSize = 8, .epoch = 3, .prefetch = 0});
  CHECK(torch::equal(fromTensor.next()->inputs, fromVector.next()->inputs));
  // Control: another epoch's loader differs (augmentation), so the equality above can fail.
  BatchLoader a(p, order, {.batchSize = 50, .epoch = 3, .prefetch = 0});
  BatchLoader b(p, order, {.batchSize = 50, .epoch = 4, .prefetch = 1});
  CHECK_FALSE(torch::equal(a.next()->inputs, b.next()->inputs));
}

TEST_CASE("loader: a preparation error reaches the consumer at its batch and then the loader ends", "[loader][errors]") {
  auto p = pipeline(images(20), false);
  std::vector<int64_t> order{0, 1, 2, 3, 4, 5, 99, 6, 7, 8};  // 99 is in the 4th batch of 2
  for (int prefetch : {0, 1, 2}) {
    INFO("prefetch " << prefetch);
    BatchLoader loader(p, order, {.batchSize = 2, .prefetch = prefetch});
    for (int i = 0; i < 3; ++i) REQUIRE(loader.next().has_value());
    CHECK_THROWS_WITH(loader.next(), Catch::Contains("index 99 out of range"));
    CHECK_FALSE(loader.next().has_value());
  }
}

TEST_CASE("loader: destroying a loader mid-epoch stops its thread without hanging", "[loader]") {
  auto p = pipeline(images(200), true);
  std::vector<int64_t> order(200);
  for (int64_t i = 0; i < 200; ++i) order[i] = i;
  for (int round = 0; round < 20; ++round) {
    BatchLoader loader(p, order, {.batchSize = 4, .prefetch = 2});
    if (round % 2) REQUIRE(loader.next().has_value());
  }  // CTest's timeout catches a hang here
  BatchLoader empty(p, std::vector<int64_t>{}, {.batchSize = 4, .prefetch = 1});
  CHECK(empty.numBatches() == 0);
  CHECK_FALSE(empty.next().has_value());
  BatchLoader skipped(p, order, {.batchSize = 4, .skipBatches = 1000, .prefetch = 1});
  CHECK_FALSE(skipped.next().has_value());
}
