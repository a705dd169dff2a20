// DistributedSampler against Python's own index lists (tests/sampler/golden, made by
// make_golden.py with python3-torch 1.13), plus position, state and resume rules.
#include "ctorch_catch.hpp"

#include "ctorch/sampler.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <set>

using ctorch::DistributedSampler;
using ctorch::DistributedSamplerOptions;
using ctorch::SamplerResumeRefused;
using ctorch::SamplerState;

namespace {

struct GoldenCase {
  DistributedSamplerOptions options;  // rank filled per list
  std::int64_t epoch = 0;
  std::int64_t numSamples = 0, totalSize = 0;
  std::vector<std::vector<std::int64_t>> ranks;
  std::string describe() const {
    return "size=" + std::to_string(options.datasetSize) + " world=" +
           std::to_string(options.worldSize) + " seed=" + std::to_string(options.seed) +
           " epoch=" + std::to_string(epoch) + " shuffle=" + std::to_string(options.shuffle) +
           " drop_last=" + std::to_string(options.dropLast);
  }
};

const std::vector<GoldenCase>& goldenCases() {
  static const std::vector<GoldenCase> cases = [] {
    std::ifstream in(CTORCH_SAMPLER_GOLDEN);
    REQUIRE(in.good());
    auto doc = nlohmann::json::parse(in);
    std::vector<GoldenCase> out;
    for (const auto& c : doc.at("cases")) {
      GoldenCase g;
      g.options.datasetSize = c.at("size");
      g.options.worldSize = c.at("world");
      g.options.seed = c.at("seed");
      g.options.shuffle = c.at("shuffle");
      g.options.dropLast = c.at("drop_last");
      g.epoch = c.at("epoch");
      g.numSamples = c.at("num_samples");
      g.totalSize = c.at("total_size");
      g.ranks = c.at("ranks").get<std::vector<std::vector<std::int64_t>>>();
      out.push_back(std::move(g));
    }
    return out;
  }();
  return cases;
}

DistributedSampler makeSampler(const GoldenCase& g, std::int64_t rank, std::int64_t epoch) {
  auto o = g.options;
  o.rank = rank;
  DistributedSampler s(o);
  s.setEpoch(epoch);
  return s;
}

DistributedSamplerOptions opts(std::int64_t size, std::int64_t world, std::int64_t rank,
                               bool shuffle = true, std::int64_t seed = 0, bool dropLast = false) {
  DistributedSamplerOptions o;
  o.datasetSize = size;
  o.worldSize = world;
  o.rank = rank;
  o.shuffle = shuffle;
  o.seed = seed;
  o.dropLast = dropLast;
  return o;
}

} // namespace

TEST_CASE("golden index lists equal Python DistributedSampler exactly", "[sampler][golden]") {
  const auto& cases = goldenCases();
  // The grid in make_golden.py: sizes 0..100 and 5003, worlds 1..8, both flags, several seeds/epochs.
  REQUIRE(cases.size() > 700);
  std::size_t lists = 0, indicesCompared = 0;
  for (const auto& g : cases) {
    REQUIRE(static_cast<std::int64_t>(g.ranks.size()) == g.options.worldSize);
    for (std::int64_t r = 0; r < g.options.worldSize; ++r) {
      auto s = makeSampler(g, r, g.epoch);
      INFO(g.describe() << " rank=" << r);
      REQUIRE(s.size() == g.numSamples);
      REQUIRE(s.totalSize() == g.totalSize);
      REQUIRE(s.indices() == g.ranks[static_cast<std::size_t>(r)]);
      ++lists;
      indicesCompared += s.indices().size();
    }
  }
  CHECK(lists > 2500);
  CHECK(indicesCompared > 20000);
}

TEST_CASE("control: the golden comparison detects a wrong epoch or seed", "[sampler][golden]") {
  // Shuffled cases with more than a few elements must differ when the epoch or the seed is off by
  // one, otherwise the comparison above proves nothing about seeding. All ranks together: one
  // short rank list can agree by chance.
  auto allRanks = [](const GoldenCase& g, std::int64_t seed, std::int64_t epoch) {
    std::vector<std::vector<std::int64_t>> lists;
    for (std::int64_t r = 0; r < g.options.worldSize; ++r) {
      auto o = g.options;
      o.rank = r;
      o.seed = seed;
      DistributedSampler s(o);
      s.setEpoch(epoch);
      lists.push_back(s.indices());
    }
    return lists;
  };
  std::size_t checked = 0;
  for (const auto& g : goldenCases()) {
    if (!g.options.shuffle || g.options.datasetSize < 10) continue;
    INFO(g.describe());
    REQUIRE(allRanks(g, g.options.seed, g.epoch) == g.ranks);
    CHECK(allRanks(g, g.options.seed, g.epoch + 1) != g.ranks);
    CHECK(allRanks(g, g.options.seed + 1, g.epoch) != g.ranks);
    ++checked;
  }
  CHECK(checked > 100);
}

TEST_CASE("ranks together cover the dataset exactly once without padding", "[sampler]") {
  for (std::int64_t size : {0, 1, 9, 12, 101}) {
    for (std::int64_t world : {1, 2, 3, 5}) {
      for (bool dropLast : {false, true}) {
        std::multiset<std::int64_t> seen;
        for (std::int64_t r = 0; r < world; ++r) {
          DistributedSampler s(opts(size, world, r, true, 5, dropLast));
          s.setEpoch(3);
          seen.insert(s.indices().begin(), s.indices().end());
        }
        INFO("size=" << size << " world=" << world << " dropLast=" << dropLast);
        std::set<std::int64_t> distinct(seen.begin(), seen.end());
        if (dropLast) {
          CHECK(seen.size() == distinct.size());  // no repeats
          CHECK(static_cast<std::int64_t>(seen.size()) == size / world * world);
        } else {
          CHECK(static_cast<std::int64_t>(distinct.size()) == size);  // every index visited
          CHECK(static_cast<std::int64_t>(seen.size()) == (size + world - 1) / world * world);
        }
      }
    }
  }
}

TEST_CASE("bad options are refused naming the value", "[sampler]") {
  auto message = [](const DistributedSamplerOptions& o) {
    try {
      DistributedSampler s(o);
    } catch (const ctorch::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  CHECK_THAT(message(opts(10, 2, 2)), Catch::Contains("invalid rank 2") && Catch::Contains("[0, 1]"));
  CHECK_THAT(message(opts(10, 2, -1)), Catch::Contains("invalid rank -1"));
  CHECK_THAT(message(opts(-3, 2, 0)), Catch::Contains("dataset size must be >= 0, got -3"));
  CHECK_THAT(message(opts(10, 0, 0)), Catch::Contains("world size must be >= 1, got 0"));
  CHECK_THAT(message(opts(10, 1, 0, true, -7)), Catch::Contains("seed must be >= 0, got -7"));
  CHECK(message(opts(10, 2, 1)) == "(accepted)");
}

TEST_CASE("setEpoch reshuffles and next hands out the epoch in order", "[sampler]") {
  DistributedSampler s(opts(50, 3, 1, true, 11));
  s.setEpoch(0);
  const auto epoch0 = s.indices();
  s.setEpoch(1);
  CHECK(s.indices() != epoch0);
  s.setEpoch(0);
  CHECK(s.indices() == epoch0);

  CHECK(s.size() == 17);
  CHECK(s.position() == 0);
  auto a = s.next(5);
  auto b = s.next(10);
  auto c = s.next(10);  // only 2 left
  CHECK(a.size() == 5);
  CHECK(b.size() == 10);
  CHECK(c.size() == 2);
  CHECK(s.exhausted());
  CHECK(s.next(4).empty());
  std::vector<std::int64_t> all(a);
  all.insert(all.end(), b.begin(), b.end());
  all.insert(all.end(), c.begin(), c.end());
  CHECK(all == epoch0);

  s.setEpoch(0);  // same epoch again: from the start, as Python's iterator would
  CHECK(s.position() == 0);
  s.advance(3);
  CHECK(s.position() == 3);
  CHECK_THROWS_AS(s.advance(15), ctorch::ConfigError);
  CHECK_THROWS_AS(s.next(-1), ctorch::ConfigError);
}

TEST_CASE("state round trip resumes mid-epoch on the same index", "[sampler][state]") {
  DistributedSampler a(opts(40, 2, 1, true, 3));
  a.setEpoch(4);
  a.next(7);
  const SamplerState st = a.state();
  CHECK(st.epoch == 4);
  CHECK(st.consumed == 7);
  CHECK(st.worldSize == 2);
  CHECK(st.datasetSize == 40);

  DistributedSampler b(opts(40, 2, 1, true, 3));
  b.loadState(st);
  b.setEpoch(4);  // resume code calls setEpoch(epoch) as usual: the position is kept
  CHECK(b.position() == 7);
  CHECK(b.next(100) == a.next(100));
  CHECK(b.state() == a.state());

  // Another rank restores rank 0's state (snapshots are written by rank 0): same position.
  DistributedSampler other(opts(40, 2, 0, true, 3));
  other.loadState(st);
  other.setEpoch(4);
  CHECK(other.position() == 7);

  // setEpoch with another epoch after a restore starts that epoch from the beginning.
  DistributedSampler c(opts(40, 2, 1, true, 3));
  c.loadState(st);
  c.setEpoch(5);
  CHECK(c.position() == 0);

  // A restored position is only kept for the first setEpoch.
  DistributedSampler d(opts(40, 2, 1, true, 3));
  d.loadState(st);
  d.setEpoch(4);
  d.setEpoch(4);
  CHECK(d.position() == 0);
}

TEST_CASE("mid-epoch resume under another world size is refused with a clear message",
          "[sampler][state]") {
  DistributedSampler a(opts(40, 2, 0, true, 3));
  a.setEpoch(1);
  a.next(5);
  DistributedSampler b(opts(40, 4, 0, true, 3));
  try {
    b.loadState(a.state());
    FAIL("mid-epoch state under a different world size was accepted");
  } catch (const SamplerResumeRefused& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Catch::Contains("cannot resume epoch 1 mid-way"));
    CHECK_THAT(m, Catch::Contains("5 of 20 indices per rank consumed"));
    CHECK_THAT(m, Catch::Contains("world size 2 in the saved state, 4 now"));
    CHECK_THAT(m, Catch::Contains("epoch boundary"));
  }
  // The refused sampler is untouched.
  CHECK(b.epoch() == 0);
  CHECK(b.position() == 0);
}

TEST_CASE("mid-epoch resume names every other setting that changes the lists", "[sampler][state]") {
  DistributedSampler a(opts(40, 2, 0, true, 3, false));
  a.setEpoch(2);
  a.next(1);
  const auto st = a.state();
  struct Variant {
    DistributedSamplerOptions o;
    const char* expect;
  };
  const Variant variants[] = {
      {opts(41, 2, 0, true, 3, false), "dataset size 40 in the saved state, 41 now"},
      {opts(40, 2, 0, true, 4, false), "seed 3 in the saved state, 4 now"},
      {opts(40, 2, 0, false, 3, false), "shuffle true in the saved state, false now"},
      {opts(40, 2, 0, true, 3, true), "drop_last false in the saved state, true now"},
  };
  for (const auto& v : variants) {
    DistributedSampler b(v.o);
    try {
      b.loadState(st);
      FAIL("accepted: expected refusal with " << v.expect);
    } catch (const SamplerResumeRefused& e) {
      CHECK_THAT(e.what(), Catch::Contains(v.expect));
    }
  }
  // Control: the same configuration is accepted.
  DistributedSampler same(opts(40, 2, 0, true, 3, false));
  CHECK_NOTHROW(same.loadState(st));
}

TEST_CASE("at an epoch boundary another world size is fine", "[sampler][state]") {
  DistributedSampler a(opts(40, 2, 0, true, 3));
  a.setEpoch(6);
  const auto fresh = a.state();  // nothing consumed yet
  a.next(1000);
  const auto done = a.state();   // whole epoch consumed

  DistributedSampler b(opts(40, 3, 2, true, 9));
  CHECK_NOTHROW(b.loadState(fresh));
  b.setEpoch(6);
  CHECK(b.epoch() == 6);
  CHECK(b.position() == 0);

  DistributedSampler c(opts(40, 3, 2, true, 9));
  CHECK_NOTHROW(c.loadState(done));
  CHECK(c.epoch() == 6);
  CHECK(c.exhausted());
}

TEST_CASE("an impossible saved state is refused", "[sampler][state]") {
  DistributedSampler a(opts(40, 2, 0));
  SamplerState st = a.state();
  st.consumed = 21;  // only 20 per rank exist
  CHECK_THROWS_WITH(a.loadState(st), Catch::Contains("consumed count 21 exceeds the 20 indices"));
  st.consumed = -1;
  CHECK_THROWS_AS(a.loadState(st), ctorch::ConfigError);
}
