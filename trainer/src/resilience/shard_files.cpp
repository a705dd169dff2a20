// The files of a sharded snapshot's shards: one per rank in the snapshot's "<file>.shards/", each a small
// self-checking snapshot file, found again by the global step of the snapshot that needs them.
#include "resilience/shard_files.hpp"

#include "ctorch/resilience.hpp"

#include "snapshot/generic_dict.hpp"
#include "snapshot/slot_layout.hpp"

#include <torch/nn/module.h>

#include <algorithm>
#include <cctype>
#include <set>

namespace ctorch::detail {

std::filesystem::path shardSlotFor(const std::filesystem::path& slot, int rank) {
  return shardFile(slot, rank);
}

torch::nn::Module& noModel() {
  // Held by a shared_ptr: LibTorch walks modules through shared_from_this.
  static const auto empty = std::make_shared<torch::nn::Module>();
  return *empty;
}

Snapshot captureShard(const ItemDict& shard, const SnapshotIdentity& identity,
                      const TrainingProgress& progress) {
  // A shard holds no parameters.
  Snapshot s = captureSnapshot(TrainingObjects{&noModel(), nullptr, nullptr}, identity, progress);
  s.optimizerType = shard.at("optimizer_type").toStringRef();
  s.optimizerState = newItemDict();
  s.optimizerState.insert("state", shard.at("state"));
  s.optimizerState.insert("param_groups", shard.at("param_groups"));
  s.userState.insert(kShardRankKey, shard.at("rank"));
  return s;
}

Snapshot captureShard(torch::nn::Module& stageModule, torch::optim::Optimizer* optimizer, const ItemDict& layout,
                      int rank, const SnapshotIdentity& identity, const TrainingProgress& progress) {
  Snapshot s = captureSnapshot(TrainingObjects{&stageModule, optimizer, nullptr}, identity, progress);
  s.userState.insert(kPipelineStageKey, layout);
  s.userState.insert(kShardRankKey, static_cast<std::int64_t>(rank));
  return s;
}

namespace {

// A shard file's content as a shard (`entries`: with its writer's USER_STATE entries; a whole
// snapshot's optimizer state taken as one shard has none).
ItemDict asShard(const Snapshot& file, bool entries = true) {
  ItemDict shard = newItemDict();
  shard.insert("state", file.optimizerState.contains("state") ? file.optimizerState.at("state")
                                                              : c10::IValue(c10::impl::GenericDict(c10::IntType::get(), c10::AnyType::get())));
  shard.insert("param_groups", file.optimizerState.contains("param_groups")
                                   ? file.optimizerState.at("param_groups")
                                   : c10::IValue(c10::impl::GenericList(c10::AnyType::get())));
  shard.insert("optimizer_type", file.optimizerType);
  // Every entry its writer (a Stateful's shardFile()) left in the file's USER_STATE: FSDP's shards of
  // the parameters and the optimizer's state, a pipeline stage's layout, a user's own.
  if (!entries) return shard;
  for (const auto& entry : file.userState)
    if (entry.key() != kShardRankKey) shard.insert(entry.key(), entry.value());
  if (file.userState.contains(kPipelineStageKey))  // a pipeline stage's: its parameters too
    shard.insert(kPipelineModelKey, file.modelState);
  return shard;
}

}  // namespace

ShardLookup lookForShard(const Snapshot& snapshot, int world, int rank, const std::vector<std::filesystem::path>& slots,
                         const SnapshotExpectation& expect) {
  ShardLookup out;
  out.why = "no shard file";
  std::set<std::filesystem::path> seen;
  std::vector<std::filesystem::path> candidates;
  for (const auto& slot : slots)
    for (const auto& shardSlot : {shardFile(slot, rank), legacyShardFile(slot, rank)})
      for (auto& file : listSnapshotFiles(shardSlot)) candidates.push_back(std::move(file));
  out.file = candidates.empty() ? shardFile(slots.front(), rank) : candidates.front();
  for (const auto& file : candidates) {
    if (!seen.insert(file).second) continue;
    try {
      Snapshot s = loadSnapshot(file, expect);
      if (s.globalStep != snapshot.globalStep || s.header.worldSize != world) continue;
      // Same step and world size, but written by another save (another run, a copied file): its
      // state is not this snapshot's, however close.
      if (!snapshot.header.saveId.empty() && s.header.saveId != snapshot.header.saveId) {
        out.file = file;
        out.why = file.string() + " belongs to save " + (s.header.saveId.empty() ? "(none)" : s.header.saveId) +
                  ", the snapshot to save " + snapshot.header.saveId;
        continue;
      }
      if (s.header.configHash != snapshot.header.configHash) {
        out.file = file;
        out.why = file.string() + " was saved with another configuration";
        continue;
      }
      out.file = file;
      out.found = std::move(s);
      return out;
    } catch (const SnapshotError& e) {
      out.file = file;
      out.why = e.what();
    }
  }
  return out;
}

namespace {
[[noreturn]] void badStage(const Snapshot& snap, const std::string& what) {
  throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "its pipeline stage shards: " + what);
}

}  // namespace

PipelineStageLayout pipelineStageLayout(const Snapshot& snap, const c10::IValue& value) {
  if (!value.isGenericDict()) badStage(snap, "a stage layout that is not a dict");
  const auto d = value.toGenericDict();
  PipelineStageLayout layout;
  for (auto [key, field] : {std::pair{"stages", &layout.stages}, std::pair{"stage", &layout.stage},
                            std::pair{"parameters", &layout.parameters}, std::pair{"steps", &layout.steps}}) {
    if (!d.contains(key) || !d.at(key).isInt() || d.at(key).toInt() < 0) badStage(snap, std::string("no count '") + key + "'");
    *field = d.at(key).toInt();
  }
  if (layout.stages < 1 || layout.stages > (1 << 20) || layout.stage >= layout.stages) badStage(snap, "a stage index outside its stages");
  if (layout.parameters > (std::int64_t{1} << 40)) badStage(snap, "a parameter count beyond any model");
  if (!d.contains("children") || !d.at("children").isList()) badStage(snap, "no list of the stage's children");
  for (const auto& child : d.at("children").toListRef()) {
    // A module's name (a Sequential's: its index), nothing a message should not echo.
    if (!child.isString() || child.toStringRef().empty() || child.toStringRef().size() > 64 ||
        !std::all_of(child.toStringRef().begin(), child.toStringRef().end(),
                     [](unsigned char c) { return std::isalnum(c) != 0 || c == '_'; }))
      badStage(snap, "a child's name that is not a module's name");
    layout.children.push_back(child.toStringRef());
  }
  return layout;
}

PipelineStageLayout pipelineShardLayout(const Snapshot& snap, const ItemDict& shard) {
  if (!shard.contains(kPipelineStageKey) || !shard.at(kPipelineStageKey).isGenericDict() || !shard.contains(kPipelineModelKey) ||
      !shard.at(kPipelineModelKey).isGenericDict())
    badStage(snap, "a shard without a stage layout or parameters");
  return pipelineStageLayout(snap, shard.at(kPipelineStageKey));
}

int shardWorld(const Snapshot& snapshot) {
  const auto& saved = snapshot.userState.at(kZeroShardsKey);
  if (!saved.isInt() || saved.toInt() < 1 || saved.toInt() > (1 << 20) || saved.toInt() != snapshot.header.worldSize)
    throw SnapshotCorrupt(snapshot.source, SnapshotCorrupt::Kind::BadContent,
                          "zero_shards is not the world size the snapshot was saved at");
  return static_cast<int>(saved.toInt());
}

std::vector<ItemDict> findShards(const Snapshot& snapshot, const std::vector<std::filesystem::path>& slots,
                                 const SnapshotExpectation& expect) {
  const int world = shardWorld(snapshot);
  std::vector<ItemDict> shards;
  for (int rank = 0; rank < world; ++rank) {
    ShardLookup shard = lookForShard(snapshot, world, rank, slots, expect);
    if (!shard.found)
      throw SnapshotError(snapshot.source, "snapshot " + snapshot.source.string() + " (global step " +
                                               std::to_string(snapshot.globalStep) + ") lacks rank " + std::to_string(rank) +
                                               "'s shard (" + shardSlotFor(slots.front(), rank).string() + "...: " +
                                               shard.why + ")");
    shards.push_back(asShard(*shard.found));
  }
  return shards;
}

std::vector<std::filesystem::path> slotsOf(const std::filesystem::path& file) {
  std::vector<std::filesystem::path> slots{file};
  // "<slot>.N", a rotated snapshot: its shards rotated among the slot's.
  const std::string name = file.filename().string();
  const auto dot = name.rfind('.');
  if (dot != std::string::npos && dot + 1 < name.size() &&
      std::all_of(name.begin() + static_cast<std::ptrdiff_t>(dot) + 1, name.end(), [](unsigned char c) { return std::isdigit(c) != 0; }))
    slots.push_back(file.parent_path() / name.substr(0, dot));
  return slots;
}

ItemDict shardOf(const Snapshot& shardFile) { return asShard(shardFile); }

ItemDict wholeOptimizerAsShard(const Snapshot& snapshot) { return asShard(snapshot, /*entries=*/false); }

std::vector<ItemDict> optimizerShardsOf(const Snapshot& snapshot, const std::vector<ItemDict>& shards,
                                        const std::string& name) {
  if (snapshot.userState.contains(kZeroShardsKey)) return shards;
  if (snapshot.optimizerType.empty())
    throw SnapshotIncompatible(snapshot.source, {"it holds no optimizer state for the " + name});
  return {asShard(snapshot, /*entries=*/false)};
}

} // namespace ctorch::detail

namespace ctorch {
namespace {

bool allDigits(const std::string& text) {
  return !text.empty() && text.size() <= 9 &&
         std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

// The files in `dir` named prefix + <rank> + suffix, by rank.
std::vector<std::pair<int, std::filesystem::path>> rankFiles(const std::filesystem::path& dir, const std::string& prefix,
                                                             const std::string& suffix) {
  std::vector<std::pair<int, std::filesystem::path>> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0 ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string rank = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
    if (allDigits(rank)) files.emplace_back(std::stoi(rank), entry.path());
  }
  return files;
}

}  // namespace

std::vector<std::filesystem::path> snapshotShardFiles(const std::filesystem::path& snapshotFile) {
  const std::filesystem::path dir = snapshotFile.has_parent_path() ? snapshotFile.parent_path() : ".";
  auto found = rankFiles(detail::shardDirectory(snapshotFile), "rank", ".pt");
  for (auto& legacy : rankFiles(dir, detail::legacyShardPrefix(snapshotFile), "")) found.push_back(std::move(legacy));
  std::sort(found.begin(), found.end());
  std::vector<std::filesystem::path> files;
  for (auto& [rank, file] : found) files.push_back(std::move(file));
  return files;
}

void removeSnapshotFiles(const std::filesystem::path& snapshotFile) {
  std::error_code ec;
  std::filesystem::remove(snapshotFile, ec);
  for (const auto& shard : snapshotShardFiles(snapshotFile)) std::filesystem::remove(shard, ec);
  std::filesystem::remove(detail::shardDirectory(snapshotFile), ec);  // only when nothing else is left in it
}

} // namespace ctorch
