// The files of a ZeRO snapshot's optimizer shards: one per rank beside the slot, each a small
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
  s.userState.insert("zero_rank", shard.at("rank"));
  return s;
}

Snapshot captureShard(FSDPCore& fsdp, const torch::optim::Optimizer* optimizer, const SnapshotIdentity& identity,
                      const TrainingProgress& progress) {
  Snapshot s = captureSnapshot(TrainingObjects{&noModel(), nullptr, nullptr}, identity, progress);
  const ItemDict model = fsdp.shardStateDict();
  s.userState.insert(kShardedModelKey, model);
  if (optimizer) s.userState.insert("fsdp_optimizer", fsdp.optimizerShardStateDict(*optimizer));
  s.userState.insert("zero_rank", model.at("rank"));
  return s;
}

namespace {

ItemDict asShard(const Snapshot& file) {
  ItemDict shard = newItemDict();
  shard.insert("state", file.optimizerState.contains("state") ? file.optimizerState.at("state")
                                                              : c10::IValue(c10::impl::GenericDict(c10::IntType::get(), c10::AnyType::get())));
  shard.insert("param_groups", file.optimizerState.contains("param_groups")
                                   ? file.optimizerState.at("param_groups")
                                   : c10::IValue(c10::impl::GenericList(c10::AnyType::get())));
  shard.insert("optimizer_type", file.optimizerType);
  for (const char* key : {kShardedModelKey, "fsdp_optimizer"})
    if (file.userState.contains(key)) shard.insert(key, file.userState.at(key));
  return shard;
}

}  // namespace

std::vector<ItemDict> findShards(const Snapshot& snapshot, const std::vector<std::filesystem::path>& slots,
                                 const SnapshotExpectation& expect) {
  const auto& saved = snapshot.userState.at(kZeroShardsKey);
  if (!saved.isInt() || saved.toInt() < 1 || saved.toInt() > (1 << 20))
    throw SnapshotCorrupt(snapshot.source, SnapshotCorrupt::Kind::BadContent, "zero_shards is not a world size");
  const int world = static_cast<int>(saved.toInt());
  std::vector<ItemDict> shards;
  for (int rank = 0; rank < world; ++rank) {
    std::optional<ItemDict> found;
    std::string why = "no shard file";
    std::set<std::filesystem::path> seen;
    for (const auto& slot : slots)
      for (const auto& file : listSnapshotFiles(shardSlotFor(slot, rank))) {
        if (found || !seen.insert(file).second) continue;
        try {
          const Snapshot s = loadSnapshot(file, expect);
          if (s.globalStep != snapshot.globalStep || s.header.worldSize != world) continue;
          found = asShard(s);
        } catch (const SnapshotError& e) {
          why = e.what();
        }
      }
    if (!found)
      throw SnapshotError(snapshot.source, "snapshot " + snapshot.source.string() + " (global step " +
                                               std::to_string(snapshot.globalStep) + ") lacks rank " + std::to_string(rank) +
                                               "'s optimizer shard (" + shardSlotFor(slots.front(), rank).string() +
                                               "...: " + why + ")");
    shards.push_back(std::move(*found));
  }
  return shards;
}

ItemDict wholeOptimizerAsShard(const Snapshot& snapshot) { return asShard(snapshot); }

} // namespace ctorch::detail

namespace ctorch {

std::vector<std::filesystem::path> optimizerShardFiles(const std::filesystem::path& snapshotFile) {
  const std::string prefix = detail::shardPrefix(snapshotFile);
  const std::filesystem::path dir = snapshotFile.has_parent_path() ? snapshotFile.parent_path() : ".";
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string rank = name.substr(std::min(name.size(), prefix.size()));
    if (name.rfind(prefix, 0) == 0 && !rank.empty() &&
        std::all_of(rank.begin(), rank.end(), [](unsigned char c) { return std::isdigit(c) != 0; }))
      files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

} // namespace ctorch
