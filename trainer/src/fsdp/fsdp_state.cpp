// FullyShardedDataParallel as a checkpoint sees it (ctorch/stateful.hpp): rank 0's snapshot holds
// no parameters (USER_STATE["fsdp_model"] says so); every rank's shard file holds its parameter
// shard (fsdp_model) and its optimizer's state shard (fsdp_optimizer), which a resume reshards over
// another world size (state_dict.cpp). In place, it follows the re-formed default group when it
// runs on it; on groups of its own (hybrid sharding, FSDPOptions::processGroup) it cannot.
#include "ctorch/fully_sharded_data_parallel.hpp"

#include "resilience/shard_files.hpp"

namespace ctorch::detail {
namespace {

// A string-keyed dict read back from a file (its key type may come back as Any).
ItemDict itemDictOf(const c10::IValue& value) {
  ItemDict out = newItemDict();
  for (const auto& item : value.toGenericDict()) out.insert(item.key().toStringRef(), item.value());
  return out;
}

} // namespace

std::string FSDPCore::stateName() const { return "FullyShardedDataParallel"; }

torch::nn::Module* FSDPCore::trackedModule() { return &module(); }

void FSDPCore::saveEntries(ItemDict& userState) const { userState.insert(kShardedModelKey, true); }

std::vector<std::string> FSDPCore::entryNames() const { return {kShardedModelKey}; }

ItemDict FSDPCore::shardState(torch::optim::Optimizer* optimizer) const {
  ItemDict shard = newItemDict();
  shard.insert(kShardedModelKey, shardStateDict());
  if (optimizer) shard.insert(kShardedOptimizerKey, optimizerShardStateDict(*optimizer));
  return shard;
}

Snapshot FSDPCore::shardFile(const ShardContext& context) const {
  Snapshot s = captureSnapshot(TrainingObjects{&noModel(), nullptr, nullptr}, context.identity, context.progress);
  const ItemDict model = shardStateDict();
  s.userState.insert(kShardedModelKey, model);
  if (context.optimizer) s.userState.insert(kShardedOptimizerKey, optimizerShardStateDict(*context.optimizer));
  s.userState.insert(kShardRankKey, model.at("rank"));
  return s;
}

void FSDPCore::loadState(const Snapshot& snapshot, const std::vector<ItemDict>& shards, StateLoad& load) {
  if (!snapshot.userState.contains(kShardedModelKey))
    throw SnapshotIncompatible(snapshot.source, {"it holds a whole model (saved without FullyShardedDataParallel): "
                                                 "resume it without sharding the model"});
  std::vector<ItemDict> models, optimizers;
  for (const auto& shard : shards) {
    models.push_back(itemDictOf(shard.at(kShardedModelKey)));
    if (shard.contains(kShardedOptimizerKey)) optimizers.push_back(itemDictOf(shard.at(kShardedOptimizerKey)));
  }
  if (load.optimizer && load.options.optimizer && optimizers.size() != shards.size())
    throw SnapshotIncompatible(snapshot.source, {"its shards hold no optimizer state"});
  if (load.options.model) loadShardStateDicts(models);
  if (load.optimizer && load.options.optimizer) loadOptimizerShardStateDicts(*load.optimizer, optimizers);
  // The parameters and the optimizer's state came from the shards.
  load.options.model = false;
  load.options.optimizer = false;
}

std::string FSDPCore::whyNotInPlace() const {
  if (followsDefaultGroup()) return {};
  return "its FullyShardedDataParallel runs on process groups of its own (hybrid sharding or FSDPOptions::processGroup), "
         "which are not re-formed";
}

void FSDPCore::joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) {
  (void)userState;
  rejoin(group);
}

} // namespace ctorch::detail
