// Snapshot format: digest, round trip, every kind of corruption, incompatibility, restore checks.
#include "fixtures.hpp"

#include "snapshot/digest.hpp"

#include <torch/csrc/jit/serialization/pickle.h>

using ctorch::SnapshotCorrupt;
using Kind = ctorch::SnapshotCorrupt::Kind;
using namespace snaptest;

namespace {

std::string blake(const std::string& data) {
  ctorch::Blake2b h(32);
  h.update(data);
  return h.hexDigest();
}

std::string pattern(std::size_t n) {
  std::string s(n, '\0');
  for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i % 251);
  return s;
}

} // namespace

TEST_CASE("BLAKE2b-256 matches Python hashlib.blake2b test vectors", "[snapshot][digest]") {
  // From /usr/bin/python3 -c "hashlib.blake2b(data, digest_size=32).hexdigest()".
  CHECK(blake("") == "0e5751c026e543b2e8ab2eb06099daa1d1e5df47778f7787faab45cdf12fe3a8");
  CHECK(blake("abc") == "bddd813c634239723171ef3fee98579b94964e3bb1cb3e427262c8c068d52319");
  CHECK(blake(pattern(128)) == "c3582f71ebb2be66fa5dd750f80baae97554f3b015663c8be377cfcb2488c1d1");
  CHECK(blake(pattern(129)) == "f7f3c46ba2564ff4c4c162da1f5b605f9f1c4aa6a20652a9f9a337c1a2f5b9c9");
  CHECK(blake(pattern(256)) == "582f782226018ec33076bd8d1c42413530ac7e1126260ffc0f306ba3befc3f24");
  CHECK(blake(pattern(1000)) == "b372d0608f720c8c3dd41e9c8eecb10143b41abe520b616607e754bf79c08331");
  // 8193 blocks and a partial one: every round of the unrolled compression, many times over.
  CHECK(blake(pattern((1 << 20) + 7)) == "73a620485a1bbc5ea669f92753cbe3d3c95ce4a25018362f3f5ee963e71f04c1");
  // Fed in odd pieces, the result is the same.
  ctorch::Blake2b h(32);
  const std::string data = pattern(1000);
  for (std::size_t at = 0, step = 1; at < data.size(); at += step, step = step * 3 % 257 + 1)
    h.update(data.data() + at, std::min(step, data.size() - at));
  CHECK(h.hexDigest() == "b372d0608f720c8c3dd41e9c8eecb10143b41abe520b616607e754bf79c08331");
  ctorch::Blake2b full(64);
  full.update("abc");
  CHECK(full.hexDigest().substr(0, 32) == "ba80a53f981c4d0d6a2797b69f12f6e9");
}

TEST_CASE("content digest ignores dict order and sees every value and type", "[snapshot][digest]") {
  auto dict = [](std::vector<std::pair<std::string, c10::IValue>> items) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    for (auto& [k, v] : items) d.insert(k, v);
    return c10::IValue(d);
  };
  const auto t = torch::arange(6, torch::kFloat);
  const auto a = ctorch::contentDigest(dict({{"x", t}, {"y", int64_t(1)}}));
  CHECK(a.rfind("blake2b-256:", 0) == 0);
  CHECK(a.size() == 12 + 64);
  CHECK(ctorch::contentDigest(dict({{"y", int64_t(1)}, {"x", t}})) == a);  // order-independent
  CHECK(ctorch::contentDigest(dict({{"x", t.clone()}, {"y", int64_t(1)}})) == a);
  auto flipped = t.clone();
  reinterpret_cast<std::uint8_t*>(flipped.data_ptr())[5] ^= 0x10;  // one bit of one element
  CHECK(ctorch::contentDigest(dict({{"x", flipped}, {"y", int64_t(1)}})) != a);
  CHECK(ctorch::contentDigest(dict({{"x", t}, {"y", 1.0}})) != a);                     // int vs float
  CHECK(ctorch::contentDigest(dict({{"x", t.to(torch::kDouble)}, {"y", int64_t(1)}})) != a);
  CHECK(ctorch::contentDigest(dict({{"x", t.reshape({2, 3})}, {"y", int64_t(1)}})) != a);
  CHECK(ctorch::contentDigest(c10::ivalue::Tuple::create({int64_t(1)})) !=
        ctorch::contentDigest(c10::List<int64_t>({1})));
  CHECK_THROWS_WITH(ctorch::contentDigest(dict({{"dev", c10::Device(c10::kCPU)}}), "USER_STATE"),
                    Catch::Contains("USER_STATE['dev'] has type Device"));
}

TEST_CASE("encode and decode round trip every field", "[snapshot][format]") {
  auto snap = populatedSnapshot(3);
  const auto bytes = ctorch::encodeSnapshot(snap);
  CHECK(!snap.header.contentDigest.empty());
  const auto back = ctorch::decodeSnapshot(bytes, "mem/snapshot.pt");

  CHECK(back.source == "mem/snapshot.pt");
  CHECK(back.header.magic == ctorch::kSnapshotMagic);
  CHECK(back.header.formatVersion == ctorch::kSnapshotFormatVersion);
  CHECK(back.header.worldSize == 2);
  CHECK(back.header.modelName == "tiny");
  CHECK(back.header.config == snap.header.config);
  CHECK(back.header.configHash == snap.header.configHash);
  CHECK(back.header.configHash.rfind("blake2b-256:", 0) == 0);
  CHECK(std::chrono::duration_cast<std::chrono::seconds>(back.header.createdAt.time_since_epoch()) ==
        std::chrono::duration_cast<std::chrono::seconds>(snap.header.createdAt.time_since_epoch()));
  CHECK_THAT(back.header.ctorchVersion, Catch::StartsWith("ctorch "));
  CHECK(back.header.torchVersion == snap.header.torchVersion);
  CHECK(back.header.contentDigest == snap.header.contentDigest);

  REQUIRE(back.modelState.size() == snap.modelState.size());
  for (const auto& e : snap.modelState) CHECK(sameTensorBytes(back.modelState.at(e.key()), e.value()));
  CHECK(back.optimizerType == "SGD");
  CHECK(back.epochsRun == 3);
  CHECK(back.stepInEpoch == 7);
  CHECK(back.globalStep == 157);
  REQUIRE(back.sampler);
  CHECK(*back.sampler == *snap.sampler);
  CHECK(back.sampler->consumed == 7);
  CHECK(sameTensorBytes(back.rng.cpu, snap.rng.cpu));
  CHECK(back.rng.cpu.numel() == 5056);  // torch.get_rng_state() size
  CHECK(back.rankRng.empty());
  CHECK(back.schedulerState.at("last_epoch").toInt() == 3);
  CHECK(back.schedulerState.at("gamma").toDouble() == 0.5);
  CHECK(back.userState.at("best_accuracy").toDouble() == 0.875);
  CHECK(back.userState.at("note").toStringRef() == "hello");
  CHECK(back.userState.at("history").toListRef().size() == 2);
  CHECK(sameTensorBytes(back.userState.at("marker").toTensor(), torch::full({64}, 1234.5f)));

  // Encoding again gives the same digest (creation time and content unchanged).
  auto again = back;
  ctorch::encodeSnapshot(again);
  CHECK(again.header.contentDigest == snap.header.contentDigest);
}

TEST_CASE("unsupported user items are refused at save time naming the entry", "[snapshot][format]") {
  auto snap = populatedSnapshot();
  snap.userState.insert("device", c10::Device(c10::kCPU));
  CHECK_THROWS_WITH(ctorch::encodeSnapshot(snap), Catch::Contains("['USER_STATE']['device']") &&
                                                      Catch::Contains("has type Device"));
}

TEST_CASE("empty zeroed truncated and random files are named as such", "[snapshot][corrupt]") {
  const auto good = encoded(populatedSnapshot());
  REQUIRE_FALSE(corruptionOf(good));  // control: the intact bytes decode

  std::string msg;
  CHECK(corruptionOf({}, &msg) == Kind::Empty);
  CHECK_THAT(msg, Catch::Contains("test/snapshot.pt") && Catch::Contains("0 bytes"));

  CHECK(corruptionOf(std::vector<char>(good.size(), 0), &msg) == Kind::Zeroed);
  CHECK_THAT(msg, Catch::Contains("all " + std::to_string(good.size()) + " bytes are zero"));

  for (std::size_t keep : {good.size() - 1, good.size() - 22, good.size() / 2, std::size_t(100)}) {
    INFO("truncated to " << keep << " of " << good.size());
    CHECK(corruptionOf(std::vector<char>(good.begin(), good.begin() + keep), &msg) == Kind::Truncated);
    CHECK_THAT(msg, Catch::Contains("(truncated)") && Catch::Contains("cut short"));
  }

  std::vector<char> random(4096);
  std::uint32_t x = 12345;
  for (auto& c : random) c = static_cast<char>((x = x * 1664525 + 1013904223) >> 24);
  CHECK(corruptionOf(random, &msg) == Kind::Foreign);
  CHECK_THAT(msg, Catch::Contains("not a torch.save archive"));

  // Zeros over the start of an otherwise complete file: named by what it starts with.
  auto headZeroed = good;
  std::fill(headZeroed.begin(), headZeroed.begin() + 4096, 0);
  CHECK(corruptionOf(headZeroed, &msg) == Kind::Foreign);
  CHECK_THAT(msg, Catch::Contains("starts with 4096 zero bytes"));
}

TEST_CASE("a bit flip inside tensor data is caught by the record checksum", "[snapshot][corrupt]") {
  auto bytes = encoded(populatedSnapshot());
  // The marker tensor's bytes (64 x 1234.5f) are easy to find in the file.
  const float value = 1234.5f;
  std::string needle(reinterpret_cast<const char*>(&value), sizeof value);
  needle = needle + needle + needle + needle;
  const auto at = find(bytes, needle);
  REQUIRE(at != std::string::npos);
  bytes[at + 9] ^= 0x04;
  std::string msg;
  CHECK(corruptionOf(bytes, &msg) == Kind::Checksum);
  CHECK_THAT(msg, Catch::Contains("record 'archive/data/") && Catch::Contains("fails its CRC-32"));
}

TEST_CASE("a bit flip in the pickle or the central directory is caught", "[snapshot][corrupt]") {
  const auto good = encoded(populatedSnapshot());
  auto pickle = good;
  const auto pkl = find(pickle, "CTORCH_SNAPSHOT");  // inside data.pkl
  REQUIRE(pkl != std::string::npos);
  pickle[pkl + 3] ^= 0x01;
  std::string msg;
  CHECK(corruptionOf(pickle, &msg) == Kind::Checksum);
  CHECK_THAT(msg, Catch::Contains("archive/data.pkl"));

  auto directory = good;
  const auto central = find(directory, std::string("PK\x01\x02", 4));
  REQUIRE(central != std::string::npos);
  directory[central + 1] ^= 0x20;  // the signature of the first central directory entry
  CHECK(corruptionOf(directory, &msg) == Kind::Damaged);
  CHECK_THAT(msg, Catch::Contains("central directory entry 0 is damaged"));
}

TEST_CASE("every single-bit flip is detected or harmless", "[snapshot][corrupt]") {
  // A flip either makes the file refused as corrupt, or lands in bytes nothing reads (zip padding,
  // local-header timestamps) and the content decodes identical. Never silently different content,
  // never a crash.
  auto snap = populatedSnapshot(2, 4);
  const auto good = ctorch::encodeSnapshot(snap);
  std::size_t detected = 0, harmless = 0;
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bytes = good;
    bytes[i] ^= static_cast<char>(1u << (i % 8));
    try {
      const auto back = ctorch::decodeSnapshot(bytes, "flip");
      // Decoded: it must be the very same content (its digest was verified against the header).
      REQUIRE(back.header.contentDigest == snap.header.contentDigest);
      ++harmless;
    } catch (const ctorch::SnapshotError&) {
      ++detected;
    }
  }
  INFO("detected " << detected << ", harmless " << harmless << " of " << good.size());
  // Most bytes are read and checked (LibTorch 1.13's archive: ~80 % of flips detected; 2.14 aligns
  // its records with more padding: ~78 %). A decoder that checked nothing would detect none.
  CHECK(detected > good.size() * 7 / 10);
}

TEST_CASE("content changed behind the digest's back is refused", "[snapshot][corrupt]") {
  // A well-formed archive (valid CRCs) whose content no longer matches the digest in its header,
  // e.g. a parameter edited and saved again with another tool.
  const auto good = encoded(populatedSnapshot());
  auto top = torch::jit::pickle_load(good).toGenericDict();
  auto model = top.at("MODEL_STATE").toGenericDict();
  auto weight = model.at("0.weight").toTensor();
  weight.view(-1)[0].add_(1e-6);
  const auto tampered = torch::jit::pickle_save(top);
  std::string msg;
  CHECK(corruptionOf(tampered, &msg) == Kind::Digest);
  CHECK_THAT(msg, Catch::Contains("recorded blake2b-256:") && Catch::Contains("computed blake2b-256:"));

  // The header is covered too: another world size written into it is refused.
  auto top2 = torch::jit::pickle_load(good).toGenericDict();
  top2.at("CTORCH_SNAPSHOT").toGenericDict().insert_or_assign("world_size", int64_t(64));
  CHECK(corruptionOf(torch::jit::pickle_save(top2)) == Kind::Digest);
}

TEST_CASE("foreign archives and newer formats are named", "[snapshot][corrupt]") {
  std::string msg;
  // A torch.save-style archive of something else.
  c10::impl::GenericDict other(c10::StringType::get(), c10::AnyType::get());
  other.insert("weights", torch::ones({3}));
  CHECK(corruptionOf(torch::jit::pickle_save(other), &msg) == Kind::Foreign);
  CHECK_THAT(msg, Catch::Contains("dict with keys [weights]") && Catch::Contains("without a 'CTORCH_SNAPSHOT' header"));
  CHECK(corruptionOf(torch::jit::pickle_save(torch::ones({2})), &msg) == Kind::Foreign);
  CHECK_THAT(msg, Catch::Contains("holding a Tensor"));

  // Our key, someone else's magic.
  c10::impl::GenericDict header(c10::StringType::get(), c10::AnyType::get());
  header.insert("magic", std::string("other-tool"));
  c10::impl::GenericDict top(c10::StringType::get(), c10::AnyType::get());
  top.insert("CTORCH_SNAPSHOT", header);
  CHECK(corruptionOf(torch::jit::pickle_save(top), &msg) == Kind::Foreign);
  CHECK_THAT(msg, Catch::Contains("lacks the magic 'ctorch-snapshot'"));

  // A newer format version is incompatible, not corrupt: the file may be fine for a newer ctorch.
  auto good = torch::jit::pickle_load(encoded(populatedSnapshot())).toGenericDict();
  good.at("CTORCH_SNAPSHOT").toGenericDict().insert_or_assign("format_version", int64_t(2));
  try {
    ctorch::decodeSnapshot(torch::jit::pickle_save(good), "x/snapshot.pt");
    FAIL("a format version 2 snapshot was accepted");
  } catch (const ctorch::SnapshotIncompatible& e) {
    CHECK_THAT(e.what(), Catch::Contains("x/snapshot.pt") &&
                             Catch::Contains("format version 2 is newer than this ctorch reads (up to 1)"));
  }
}

TEST_CASE("an incompatible header lists every difference", "[snapshot][incompatible]") {
  auto snap = populatedSnapshot();
  ctorch::SnapshotExpectation same;
  same.modelName = "tiny";
  same.config = snap.header.config;
  same.worldSize = 2;
  CHECK(ctorch::compareWithExpectation(snap.header, same).empty());  // control
  CHECK(ctorch::compareWithExpectation(snap.header, {}).empty());    // nothing expected

  ctorch::SnapshotExpectation other;
  other.modelName = "resnet";
  other.config = std::map<std::string, std::string>{{"lr", "0.01"}, {"epochs", "9"}};
  other.worldSize = 4;
  const auto diffs = ctorch::compareWithExpectation(snap.header, other);
  REQUIRE(diffs.size() == 5);
  CHECK(diffs[0] == "model name is 'tiny' in the snapshot, 'resnet' in this run");
  CHECK(diffs[1] == "world size is 2 in the snapshot, 4 in this run");
  CHECK(diffs[2] == "config 'batch_size' is only in the snapshot ('8')");
  CHECK(diffs[3] == "config 'lr' is '0.1' in the snapshot, '0.01' in this run");
  CHECK(diffs[4] == "config 'epochs' is only in this run ('9')");
  ctorch::SnapshotIncompatible e("run/snapshot.pt", diffs);
  CHECK_THAT(e.what(), Catch::StartsWith("snapshot run/snapshot.pt does not fit this run: model name"));
}

TEST_CASE("restore puts model optimizer sampler and RNG back in place", "[snapshot][restore]") {
  torch::manual_seed(3);
  auto model = torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 1));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
  auto step = [&](torch::nn::Sequential& m, torch::optim::Optimizer& o) {
    o.zero_grad();
    m->forward(torch::randn({6, 5})).pow(2).mean().backward();
    o.step();
  };
  for (int i = 0; i < 3; ++i) step(model, opt);
  ctorch::DistributedSamplerOptions so;
  so.datasetSize = 30;
  ctorch::DistributedSampler sampler(so);
  sampler.setEpoch(2);
  sampler.next(4);
  auto snap = ctorch::decodeSnapshot(
      encoded(ctorch::captureSnapshot({model.ptr().get(), &opt, &sampler}, identity(), {2, 4, 30})),
      "mem");

  // Continue the original one step.
  step(model, opt);
  const auto expected = ctorch::captureModelState(*model);

  // Another process would start from different weights and a fresh optimizer.
  torch::manual_seed(99);
  auto model2 = torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 1));
  torch::optim::Adam opt2(model2->parameters(), torch::optim::AdamOptions(0.5));
  ctorch::DistributedSampler sampler2(so);
  ctorch::restoreSnapshot(snap, {model2.ptr().get(), &opt2, &sampler2});
  CHECK(static_cast<torch::optim::AdamOptions&>(opt2.param_groups()[0].options()).lr() == 0.01);
  CHECK(sampler2.epoch() == 2);
  CHECK(sampler2.position() == 4);
  step(model2, opt2);  // the RNG was restored too: same random batch as the original's 4th step
  const auto got = ctorch::captureModelState(*model2);
  for (const auto& e : expected) CHECK(sameTensorBytes(got.at(e.key()), e.value()));
}

TEST_CASE("optimizer state round trips for every supported optimizer", "[snapshot][restore]") {
  using namespace torch::optim;
  auto make = [](const std::string& type, std::vector<at::Tensor> params) -> std::unique_ptr<Optimizer> {
    if (type == "SGD") return std::make_unique<SGD>(params, SGDOptions(0.1).momentum(0.9).nesterov(true));
    if (type == "Adam") return std::make_unique<Adam>(params, AdamOptions(0.01).amsgrad(true));
    if (type == "AdamW") return std::make_unique<AdamW>(params, AdamWOptions(0.01));
    if (type == "RMSprop") return std::make_unique<RMSprop>(params, RMSpropOptions(0.01).momentum(0.5).centered(true));
    return std::make_unique<Adagrad>(params, AdagradOptions(0.1).lr_decay(0.01));
  };
  for (const std::string type : {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad"}) {
    INFO(type);
    auto run = [&](torch::nn::Linear& m, Optimizer& o, int seed) {
      torch::manual_seed(seed);
      o.zero_grad();
      m->forward(torch::randn({3, 4})).sum().backward();
      o.step();
    };
    torch::manual_seed(1);
    torch::nn::Linear a(4, 2);
    auto optA = make(type, a->parameters());
    run(a, *optA, 10);
    run(a, *optA, 11);
    std::string savedType;
    const auto state = ctorch::captureOptimizerState(*optA, &savedType);
    CHECK(savedType == type);
    const auto weights = ctorch::captureModelState(*a);

    torch::nn::Linear b(4, 2);
    auto optB = make(type, b->parameters());
    REQUIRE(ctorch::restoreModelState(*b, weights).empty());
    REQUIRE(ctorch::restoreOptimizerState(*optB, type, state).empty());
    run(a, *optA, 12);
    run(b, *optB, 12);
    CHECK(sameTensorBytes(a->weight, b->weight));
    CHECK(sameTensorBytes(a->bias, b->bias));

    // Control: without the optimizer state the next step differs (the state matters).
    torch::nn::Linear c(4, 2);
    auto optC = make(type, c->parameters());
    REQUIRE(ctorch::restoreModelState(*c, weights).empty());
    run(c, *optC, 12);
    CHECK_FALSE(sameTensorBytes(a->weight, c->weight));
  }
}

TEST_CASE("restore refuses what does not fit and changes nothing", "[snapshot][restore]") {
  auto snap = ctorch::decodeSnapshot(encoded(populatedSnapshot()), "run/snapshot.pt");

  // Another width: shapes differ. Another layout: names differ.
  auto wider = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::BatchNorm1d(32), torch::nn::Linear(32, 2));
  const auto before = ctorch::captureModelState(*wider);
  torch::optim::SGD sgd(wider->parameters(), torch::optim::SGDOptions(0.3));
  try {
    ctorch::restoreSnapshot(snap, {wider.ptr().get(), &sgd, nullptr});
    FAIL("a wider model was accepted");
  } catch (const ctorch::SnapshotIncompatible& e) {
    CHECK_THAT(e.what(), Catch::Contains("run/snapshot.pt") &&
                             Catch::Contains("parameter '0.weight' has shape [16, 8] in the snapshot, [32, 8] in the model"));
    CHECK_THAT(e.what(), Catch::Contains("param_groups[0]") || Catch::Contains("state["));
  }
  const auto after = ctorch::captureModelState(*wider);
  for (const auto& e : before) CHECK(sameTensorBytes(after.at(e.key()), e.value()));
  CHECK(static_cast<torch::optim::SGDOptions&>(sgd.param_groups()[0].options()).lr() == 0.3);

  auto deeper = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16),
                                      torch::nn::Linear(16, 2), torch::nn::Linear(2, 2));
  try {
    ctorch::restoreSnapshot(snap, {deeper.ptr().get(), nullptr, nullptr});
    FAIL("a model with more parameters was accepted");
  } catch (const ctorch::SnapshotIncompatible& e) {
    CHECK_THAT(e.what(), Catch::Contains("missing in the snapshot: 3.weight, 3.bias"));
  }
  auto other = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, 2));
  try {
    ctorch::restoreSnapshot(snap, {other.ptr().get(), nullptr, nullptr});
    FAIL("a model with other layers was accepted");
  } catch (const ctorch::SnapshotIncompatible& e) {
    CHECK_THAT(e.what(), Catch::Contains("parameter '1.weight' has shape [16] in the snapshot, [2, 16] in the model"));
    CHECK_THAT(e.what(), Catch::Contains("in the snapshot but not in the model: 1.running_mean, "
                                         "1.running_var, 1.num_batches_tracked, 2.weight, 2.bias"));
  }

  // Same model, other optimizer type.
  auto same = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::Linear(16, 2));
  torch::optim::Adam adam(same->parameters());
  CHECK_THROWS_WITH(ctorch::restoreSnapshot(snap, {same.ptr().get(), &adam, nullptr}),
                    Catch::Contains("optimizer is SGD in the snapshot, Adam in this run"));

  // Same model, sampler under another world size mid-epoch.
  ctorch::DistributedSamplerOptions so;
  so.datasetSize = 100;
  so.worldSize = 4;
  so.seed = 5;
  ctorch::DistributedSampler sampler(so);
  CHECK_THROWS_WITH(ctorch::restoreSnapshot(snap, {same.ptr().get(), nullptr, &sampler}),
                    Catch::Contains("sampler: cannot resume epoch 3 mid-way") &&
                        Catch::Contains("world size 2 in the saved state, 4 now"));

  // Control: the matching objects are accepted.
  torch::optim::SGD sgd2(same->parameters(), torch::optim::SGDOptions(0.3));
  so.worldSize = 2;
  ctorch::DistributedSampler sampler2(so);
  CHECK_NOTHROW(ctorch::restoreSnapshot(snap, {same.ptr().get(), &sgd2, &sampler2}));
}

TEST_CASE("restore picks this rank's RNG state when every rank's was gathered", "[snapshot][restore]") {
  auto stateAfterSeed = [](std::uint64_t seed) {
    torch::manual_seed(seed);
    return ctorch::captureRngState();
  };
  auto drawAfterSeed = [](std::uint64_t seed) {
    torch::manual_seed(seed);
    return torch::rand({6});
  };
  torch::nn::Linear model(2, 2);
  auto snap = ctorch::captureSnapshot({model.ptr().get(), nullptr, nullptr}, identity("tiny", 3), {});
  snap.rng = stateAfterSeed(100);
  snap.rankRng = {stateAfterSeed(100), stateAfterSeed(101), stateAfterSeed(102)};  // one per rank
  const auto back = ctorch::decodeSnapshot(encoded(snap), "mem");
  REQUIRE(back.rankRng.size() == 3);
  CHECK(sameTensorBytes(back.rankRng[2].cpu, snap.rankRng[2].cpu));

  auto restoreAs = [&](std::int64_t rank) {
    ctorch::RestoreOptions o;
    o.rank = rank;
    torch::manual_seed(7);  // something else entirely
    ctorch::restoreSnapshot(back, {model.ptr().get(), nullptr, nullptr}, o);
    return torch::rand({6});
  };
  CHECK(sameTensorBytes(restoreAs(1), drawAfterSeed(101)));
  CHECK(sameTensorBytes(restoreAs(2), drawAfterSeed(102)));
  CHECK(sameTensorBytes(restoreAs(-1), drawAfterSeed(100)));  // no rank given: the writer's
  CHECK(sameTensorBytes(restoreAs(5), drawAfterSeed(100)));   // a rank the snapshot lacks
  CHECK_FALSE(sameTensorBytes(drawAfterSeed(101), drawAfterSeed(100)));  // control
}

TEST_CASE("CPU RNG state round trips", "[snapshot][restore]") {
  torch::manual_seed(5);
  torch::rand({10});
  const auto state = ctorch::captureRngState();
  const auto first = torch::rand({8});
  torch::rand({100});
  CHECK(ctorch::restoreRngState(state).empty());
  CHECK(sameTensorBytes(torch::rand({8}), first));
}
