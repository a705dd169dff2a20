// ctorch-snapshot (issue 42.1, 42.2): a sharded run's snapshot seen from outside — its shards found,
// checked and refused by name, and consolidated into one file whose state is exactly that of a run
// without sharding, which plain torch.load opens and a run without sharding resumes from.
#include "trainer_test_util.hpp"

#include <ctorch/resilience.hpp>
#include <ctorch/sharded_snapshot.hpp>
#include <ctorch/snapshot.hpp>

#include <torch/torch.h>

using namespace traintest;
using ctorch::test::TempDir;

namespace {

// 2 ranks x 4 steps per epoch, Adam (per-element state and a step count), snapshots every 3 steps.
std::vector<std::string> smallRun(const std::string& sharding, const std::string& epochs) {
  return {"--model", "simple-cnn", "--dataset", "synthetic-images", "--synthetic-size", "128", "--test-limit", "32",
          "--batch-size", "16", "--epochs", epochs, "--optimizer", "adam", "--sharding", sharding,
          "--save-every-steps", "3"};
}

ProcessResult tool(const std::vector<std::string>& args) {
  SpawnOptions o;
  o.argv = {CTORCH_SNAPSHOT_EXE};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.timeout = std::chrono::seconds(60);
  return ctorch::test::run(o);
}

// Every entry of two item trees equal to the last bit (tensors by value, the rest by printed form).
std::string sameState(const c10::IValue& a, const c10::IValue& b, const std::string& where) {
  if (a.isTensor() && b.isTensor()) {
    const auto x = a.toTensor(), y = b.toTensor();
    if (!x.sizes().equals(y.sizes()) || x.scalar_type() != y.scalar_type() || !torch::equal(x, y)) return where + " differs";
    return "";
  }
  if (a.isGenericDict() && b.isGenericDict()) {
    const auto x = a.toGenericDict(), y = b.toGenericDict();
    if (x.size() != y.size()) return where + " has " + std::to_string(x.size()) + " entries, not " + std::to_string(y.size());
    for (const auto& e : x) {
      std::ostringstream key;
      key << e.key();
      if (!y.contains(e.key())) return where + "[" + key.str() + "] is missing";
      if (auto d = sameState(e.value(), y.at(e.key()), where + "[" + key.str() + "]"); !d.empty()) return d;
    }
    return "";
  }
  if (a.isList() && b.isList()) {
    const auto x = a.toListRef(), y = b.toListRef();
    if (x.size() != y.size()) return where + " has another length";
    for (std::size_t i = 0; i < x.size(); ++i)
      if (auto d = sameState(x[i], y[i], where + "[" + std::to_string(i) + "]"); !d.empty()) return d;
    return "";
  }
  std::ostringstream x, y;
  x << a;
  y << b;
  return x.str() == y.str() ? "" : where + " is " + x.str() + ", not " + y.str();
}

std::string sameModel(const ctorch::Snapshot& a, const ctorch::Snapshot& b) {
  c10::impl::GenericDict x(c10::StringType::get(), c10::AnyType::get()), y(c10::StringType::get(), c10::AnyType::get());
  for (const auto& e : a.modelState) x.insert(e.key(), e.value());
  for (const auto& e : b.modelState) y.insert(e.key(), e.value());
  return sameState(x, y, "MODEL_STATE");
}

std::string sameOptimizer(const ctorch::Snapshot& a, const ctorch::Snapshot& b) {
  if (a.optimizerType != b.optimizerType) return "OPTIMIZER_TYPE " + a.optimizerType + " against " + b.optimizerType;
  return sameState(a.optimizerState, b.optimizerState, "OPTIMIZER_STATE");
}

}  // namespace

TEST_CASE("ctorch-snapshot: ZeRO-1 and FSDP snapshots consolidate into exactly the state of a run without sharding, "
          "torch.load opens them and a run without sharding resumes from them bit-identically",
          "[trainer][process][snapshot-tool][sharding]") {
  TempDir none("tool-none"), zero("tool-zero"), fsdp("tool-fsdp"), noneLong("tool-none-2"), fromZero("tool-from-zero"),
      fromFsdp("tool-from-fsdp");
  for (const auto& [dir, sharding] : {std::pair{&none, "none"}, {&zero, "optimizer"}, {&fsdp, "full"}}) {
    const auto r = ctorch::test::run(trainUnderLauncher(dir->path(), 2, smallRun(sharding, "1")));
    INFO(show(r));
    REQUIRE(r.ok());
  }
  // The shards of a snapshot lie together; the snapshot and its shards carry one save id.
  const auto shards = ctorch::snapshotShardFiles(zero / "snapshot.pt");
  REQUIRE(shards == std::vector<fs::path>{zero / "snapshot.pt.shards" / "rank0.pt", zero / "snapshot.pt.shards" / "rank1.pt"});
  CHECK(ctorch::loadSnapshot(shards[1]).header.saveId == ctorch::loadSnapshot(zero / "snapshot.pt").header.saveId);
  CHECK_FALSE(ctorch::loadSnapshot(shards[1]).header.saveId.empty());

  const auto reference = ctorch::loadSnapshot(none / "snapshot.pt");
  for (const auto* dir : {&zero, &fsdp}) {
    INFO("from " << dir->path());
    const auto v = tool({"verify", (*dir / "snapshot.pt").string()});
    INFO(show(v));
    CHECK(v.exitCode == 0);
    const auto c = tool({"consolidate", (*dir / "snapshot.pt").string(), "-o", (*dir / "whole.pt").string()});
    INFO(show(c));
    REQUIRE(c.exitCode == 0);
    CHECK_THAT(c.output, Catch::Contains("Adam state for 10 parameters"));
    const auto whole = ctorch::loadSnapshot(*dir / "whole.pt");
    CHECK(ctorch::shardingOf(whole) == ctorch::SnapshotSharding::kNone);
    CHECK(whole.globalStep == reference.globalStep);
    CHECK(sameModel(whole, reference) == "");
    CHECK(sameOptimizer(whole, reference) == "");
  }
  // FSDP's consolidated model is the model its own run gathered at the end (model.pt).
  {
    const auto whole = ctorch::loadSnapshot(fsdp / "whole.pt");
    const auto weights = loadWeights(fsdp / "model.pt");
    REQUIRE(weights.size() == whole.modelState.size());
    for (const auto& [name, value] : weights) {
      INFO(name);
      REQUIRE(whole.modelState.contains(name));
      CHECK(torch::equal(whole.modelState.at(name), value));
    }
  }
  // Plain torch.load, as a Python user opens it: the whole model and the optimizer's state by parameter.
  if (havePythonTorch()) {
    SpawnOptions py;
    py.argv = {"/usr/bin/python3", "-c",
               "import sys, torch\n"
               "s = torch.load(sys.argv[1])\n"
               "m, o = s['MODEL_STATE'], s['OPTIMIZER_STATE']\n"
               "print(len(m), sum(t.numel() for t in m.values()), s['OPTIMIZER_TYPE'], sorted(o['state']),"
               " o['param_groups'][0]['params'], sorted(o['state'][0]))\n",
               (fsdp / "whole.pt").string()};
    py.timeout = std::chrono::seconds(90);
    const auto r = ctorch::test::run(py);
    INFO(show(r));
    CHECK(r.output == "10 44426 Adam [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] ['exp_avg', "
                      "'exp_avg_sq', 'step']\n");
  }
  // Crafted shards (a valid file whose content lies: a flat buffer of 10^15 elements, a shape whose
  // product overflows, 400 parameters laid over the same elements, a parameter's shape shrunk so that
  // elements belong to none, one rank's piece in float16, rank 0's piece stretched over rank 1's
  // elements with other values) are refused in one line by verify and consolidate, with nothing
  // allocated for the lie and nothing written (issue 58: the last three verified "ok", and
  // consolidation cast to the first piece's dtype or took the last piece's values).
  for (const std::string lie : {"numel", "shape", "overlap", "gap", "dtype", "stretch"}) {
    TempDir crafted("tool-crafted");
    fs::copy(fsdp.path(), crafted.path(), fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    fs::remove(crafted / "whole.pt");
    // The layout lies are told by every rank's shard (the layout is read from rank 0's); the
    // pieces' by one.
    for (const char* name : {"rank0.pt", "rank1.pt"}) {
      const bool rankZero = std::string(name) == "rank0.pt";
      const fs::path shard = crafted / "snapshot.pt.shards" / name;
      ctorch::Snapshot s = ctorch::loadSnapshot(shard);
      auto flats = s.userState.at("fsdp_model").toGenericDict().at("flat_parameters").toGenericDict();
      auto entry = flats.begin()->value().toGenericDict();
      if (lie == "numel") {
        entry.insert_or_assign("numel", std::int64_t{1000000000000000});
      } else if (lie == "overlap") {
        // Each of 400 pieces the whole buffer, named after the buffer's own parameters in turn
        // (issue 58: every piece was copied out, 400 copies of the buffer).
        const auto real = entry.at("layout").toListRef();
        c10::impl::GenericList layout(c10::AnyType::get());
        for (std::size_t i = 0; i < 400; ++i) {
          auto piece = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
          piece.insert("name", real[i % real.size()].toGenericDict().at("name"));
          piece.insert("offset", std::int64_t{0});
          piece.insert("shape", std::vector<std::int64_t>{entry.at("numel").toInt()});
          layout.push_back(piece);
        }
        entry.insert_or_assign("layout", layout);
      } else if (lie == "gap") {
        auto piece = entry.at("layout").toListRef()[0].toGenericDict();
        std::vector<std::int64_t> shape;
        for (const auto& d : piece.at("shape").toListRef()) shape.push_back(d.toInt());
        REQUIRE(shape.at(0) > 1);
        shape[0] -= 1;
        piece.insert_or_assign("shape", shape);
      } else if (lie == "dtype") {
        if (rankZero) continue;
        entry.insert_or_assign("data", entry.at("data").toTensor().to(torch::kHalf));
      } else if (lie == "stretch") {
        if (!rankZero) continue;
        const auto data = entry.at("data").toTensor();
        REQUIRE(entry.at("begin").toInt() == 0);
        REQUIRE(data.numel() < entry.at("numel").toInt());
        entry.insert_or_assign("data", torch::cat({data, torch::full({entry.at("numel").toInt() - data.numel()}, 7.0, data.options())}));
      } else {
        auto piece = entry.at("layout").toListRef()[0].toGenericDict();
        piece.insert_or_assign("shape", std::vector<std::int64_t>{4000000000, 4000000000, 4000000000});
      }
      // Written beside and renamed over the shard: its previous ones (rank<r>.pt.1) stay.
      ctorch::SnapshotSlotOptions slot;
      slot.path = crafted / "crafted-shard.pt";
      slot.keepPrevious = 0;
      ctorch::saveSnapshot(s, slot);
      fs::rename(slot.path, shard);
    }
    const char* says = lie == "numel"     ? "(elements from "
                       : lie == "overlap" ? "'conv1.flat''s layout lays '"
                       : lie == "gap"     ? "'conv1.flat''s layout leaves elements "
                       : lie == "dtype"   ? "the pieces of 'conv1.flat' are of two dtypes (Float and Half)"
                       : lie == "stretch" ? "two pieces of 'conv1.flat' overlap (elements "
                                          : "'conv1.flat''s layout gives a parameter a dimension outside";
    const auto v = tool({"verify", (crafted / "snapshot.pt").string()});
    INFO(lie << ": " << show(v));
    CHECK(v.exitCode == 1);
    CHECK_THAT(v.output, Catch::Contains(says));
    const auto r = tool({"consolidate", (crafted / "snapshot.pt").string(), "-o", (crafted / "whole.pt").string()});
    INFO(lie << ": " << show(r));
    CHECK(r.exitCode == 1);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
    CHECK_THAT(r.output, Catch::Contains(says));
    if (lie == "numel") CHECK_THAT(r.output, Catch::Contains("of 1000000000000000)"));
    CHECK_FALSE(fs::exists(crafted / "whole.pt"));
    // A run resuming with FSDP sets such a set aside where it chooses the snapshot, like a damaged
    // file, and resumes from the one before (it read the stretched piece before).
    if (lie == "stretch") {
      const auto t = ctorch::test::run(trainUnderLauncher(crafted.path(), 2, smallRun("full", "2")));
      INFO(show(t));
      CHECK(t.ok());
      CHECK_THAT(t.output, Catch::Contains("two pieces of 'conv1.flat' overlap"));
      CHECK_THAT(t.output, Catch::Contains("resuming from"));
    }
  }
  // A run without sharding resumes from each and ends where one never sharded ends.
  {
    const auto r = ctorch::test::run(trainUnderLauncher(noneLong.path(), 2, smallRun("none", "2")));
    INFO(show(r));
    REQUIRE(r.ok());
  }
  for (const auto& [from, dir] : {std::pair{&zero, &fromZero}, {&fsdp, &fromFsdp}}) {
    fs::copy_file(*from / "whole.pt", *dir / "snapshot.pt");
    const auto r = ctorch::test::run(trainUnderLauncher(dir->path(), 2, smallRun("none", "2")));
    INFO(show(r));
    REQUIRE(r.ok());
    CHECK_THAT(r.output, Catch::Contains("resuming from"));
    CHECK(bitDifference(*dir / "model.pt", noneLong / "model.pt").empty());
  }
}

TEST_CASE("ctorch-snapshot: a missing, damaged or foreign shard is named with exit 1, bad input is one line with "
          "exit 2, shards under their old names are still read",
          "[trainer][process][snapshot-tool][sharding]") {
  TempDir run("tool-bad"), other("tool-bad-other");
  for (const auto* dir : {&run, &other}) {
    const auto r = ctorch::test::run(trainUnderLauncher(dir->path(), 2, smallRun("optimizer", "1")));
    INFO(show(r));
    REQUIRE(r.ok());
  }
  const std::string snapshot = (run / "snapshot.pt").string();
  const fs::path shard1 = run / "snapshot.pt.shards" / "rank1.pt";
  const std::string kept = shard1.string() + ".keep";
  fs::copy_file(shard1, kept);

  // inspect: the snapshot's point, save and shards; a shard says whose it is.
  auto r = tool({"inspect", snapshot});
  INFO(show(r));
  CHECK(r.exitCode == 0);
  CHECK_THAT(r.output, Catch::Contains("optimizer (ZeRO-1 or parameter server)"));
  CHECK_THAT(r.output, Catch::Contains("rank 1: " + shard1.string() + "  ok"));
  CHECK_THAT(r.output, Catch::Contains("complete and consistent"));
  r = tool({"inspect", shard1.string()});
  CHECK(r.exitCode == 0);
  CHECK_THAT(r.output, Catch::Contains("a shard:       rank 1 of 2"));

  // Another run's shard of the same step and configuration: refused by its save.
  fs::copy_file(other / "snapshot.pt.shards" / "rank1.pt", shard1, fs::copy_options::overwrite_existing);
  r = tool({"verify", snapshot});
  INFO(show(r));
  CHECK(r.exitCode == 1);
  CHECK_THAT(r.output, Catch::Contains("rank 1's shard is not usable: " + shard1.string() + " belongs to save " +
                                       ctorch::loadSnapshot(other / "snapshot.pt").header.saveId));
  r = tool({"consolidate", snapshot, "-o", (run / "whole.pt").string()});
  CHECK(r.exitCode == 1);
  CHECK_THAT(r.output, Catch::Contains("lacks rank 1's shard"));
  CHECK_FALSE(fs::exists(run / "whole.pt"));
  r = tool({"inspect", snapshot});
  CHECK(r.exitCode == 1);
  CHECK_THAT(r.output, Catch::Contains("incomplete"));

  // Damaged (one byte flipped) and missing.
  {
    std::string bytes = ctorch::test::readFile(kept);
    bytes[bytes.size() / 2] ^= 0x5a;
    std::ofstream(shard1, std::ios::binary | std::ios::trunc) << bytes;
  }
  r = tool({"verify", snapshot});
  CHECK(r.exitCode == 1);
  CHECK_THAT(r.output, Catch::Contains("rank 1's shard is not usable"));
  fs::remove(shard1);
  r = tool({"verify", snapshot});
  CHECK(r.exitCode == 1);
  CHECK_THAT(r.output, Catch::Contains("rank 1's shard is not usable: no shard file"));

  // The old names ("<file>.optim-rank<r>" beside the snapshot) are read.
  fs::rename(kept, snapshot + ".optim-rank1");
  r = tool({"verify", snapshot});
  INFO(show(r));
  CHECK(r.exitCode == 0);
  CHECK(ctorch::snapshotShardFiles(snapshot) ==
        std::vector<fs::path>{run / "snapshot.pt.shards" / "rank0.pt", fs::path(snapshot + ".optim-rank1")});

  // Bad input: one line, exit 2, nothing written.
  r = tool({"verify", (run / "nothing.pt").string()});
  CHECK(r.exitCode == 2);
  CHECK(r.output == "ctorch-snapshot: error: no such file: " + (run / "nothing.pt").string() + "\n");
  r = tool({"consolidate", snapshot, "-o", snapshot});
  CHECK(r.exitCode == 2);
  CHECK_THAT(r.output, Catch::Contains("is the snapshot itself"));
  // Nor any file of its set, even with --force (issue 58: a shard file named as OUT was overwritten
  // by the consolidation that read it): the shard folder, a previous slot, an old shard name, the
  // epoch slot, and a shard under another name (a hard link).
  {
    const fs::path shard0 = run / "snapshot.pt.shards" / "rank0.pt";
    const std::string before = ctorch::test::readFile(shard0);
    fs::create_hard_link(shard0, run / "elsewhere.pt");
    for (const fs::path& out : {shard0, run / "snapshot.pt.1", fs::path(snapshot + ".optim-rank1"),
                                run / "snapshot.pt.shards" / "new.pt", run / "snapshot-epoch.pt", run / "elsewhere.pt"}) {
      r = tool({"consolidate", snapshot, "-o", out.string(), "--force"});
      INFO(out << ": " << show(r));
      CHECK(r.exitCode == 2);
      CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
      CHECK_THAT(r.output, Catch::Contains(out.filename() == "elsewhere.pt" ? "a file of the snapshot: name another file"
                                                                            : "is inside the snapshot's own set"));
    }
    CHECK(ctorch::test::readFile(shard0) == before);
    CHECK(ctorch::test::readFile(snapshot + ".optim-rank1").size() > 0);
    CHECK_FALSE(fs::exists(run / "snapshot.pt.shards" / "new.pt"));
    fs::remove(run / "elsewhere.pt");
  }
  r = tool({"consolidate", snapshot, "-o", (run / "model.pt").string()});
  CHECK(r.exitCode == 2);
  CHECK_THAT(r.output, Catch::Contains("exists: name another file, or add --force"));
  r = tool({"consolidate", (run / "snapshot.pt.shards" / "rank0.pt").string(), "-o", (run / "x.pt").string()});
  CHECK(r.exitCode == 2);
  CHECK_THAT(r.output, Catch::Contains("is one rank's shard"));
  r = tool({"inspect", (run / "metrics.jsonl").string()});
  CHECK(r.exitCode == 1);
  CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);
  r = tool({"frobnicate"});
  CHECK(r.exitCode == 2);
}
