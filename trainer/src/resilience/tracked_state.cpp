// The registry of what ResilientTraining saves, with its one capture and its one restore: a file's
// snapshot and a state sent in place between ranks are assembled and read back the same way.
#include "resilience/tracked_state.hpp"

#include "resilience/shard_files.hpp"
#include "snapshot/optimizer_check.hpp"

#include "ctorch/errors.hpp"

#include <torch/optim/optimizer.h>

namespace ctorch::detail {
namespace {

// A value of a snapshot in a message: a number as it is, anything else by its type (a hostile file's
// string is not echoed).
std::string describeValue(const c10::IValue& value) {
  if (value.isInt()) return std::to_string(value.toInt());
  return "a " + value.tagKind();
}

bool claims(const Stateful& object, const std::string& key) {
  for (const auto& name : object.entryNames())
    if (name == key) return true;
  return false;
}

}  // namespace

SnapshotPoint pointOf(const Snapshot& s) {
  SnapshotPoint p;
  p.file = s.source;
  p.worldSize = s.header.worldSize;
  p.epochsRun = s.epochsRun;
  p.stepInEpoch = s.stepInEpoch;
  p.globalStep = s.globalStep;
  if (s.userState.contains(kEpochCompleteKey)) {
    const c10::IValue& complete = s.userState.at(kEpochCompleteKey);  // a bool (checkFields)
    p.epochComplete = complete.isBool() && complete.toBool();
  }
  return p;
}

void TrackedState::setModel(torch::nn::Module& module) {
  if (model_) throw ConfigError("ResilientTraining: a model is already registered (one model per run)");
  model_ = &module;
}

void TrackedState::setOptimizer(torch::optim::Optimizer& optimizer) {
  if (optimizer_ || optimizerObject_) throw ConfigError("ResilientTraining: an optimizer is already registered (one per run)");
  optimizer_ = &optimizer;
}

void TrackedState::add(Stateful& object) {
  for (const Stateful* o : objects_)
    if (o == &object) throw ConfigError("ResilientTraining: " + object.stateName() + " is registered twice");
  if (torch::nn::Module* module = object.trackedModule()) {
    setModel(*module);
    modelObject_ = &object;
  }
  if (object.tracksOptimizer()) {
    if (optimizer_ || optimizerObject_) throw ConfigError("ResilientTraining: an optimizer is already registered (one per run)");
    optimizerObject_ = &object;
  }
  objects_.push_back(&object);
}

Stateful* TrackedState::shardSource() const {
  if (optimizerObject_ && optimizerObject_->sharded()) return optimizerObject_;
  for (Stateful* o : objects_)
    if (o->sharded()) return o;
  return nullptr;
}

Snapshot TrackedState::captureRankShard(const SnapshotIdentity& identity, const TrainingProgress& progress, int rank) const {
  return shardSource()->shardFile(ShardContext{optimizer_, rank, identity, progress});
}

ItemDict TrackedState::rankShard() const { return shardSource()->shardState(optimizer_); }

std::string TrackedState::whyNoShardCopies() const {
  for (const Stateful* o : objects_)
    if (o->sharded())
      if (std::string why = o->whyNotInPlace(); !why.empty()) return why;
  return {};
}

ItemDict TrackedState::entries() const {
  ItemDict entries = newItemDict();
  for (const Stateful* o : objects_) o->saveEntries(entries);
  return entries;
}

void TrackedState::prepareLoad(const ItemDict* userState) const {
  for (Stateful* o : objects_) o->prepareLoad(userState);
}

void TrackedState::stepEnded() const {
  for (Stateful* o : objects_) o->stepEnded();
}

std::vector<at::Tensor> TrackedState::steppedParameters() const {
  for (const Stateful* o : objects_)
    if (auto stepped = o->steppedParameters(); !stepped.empty()) return stepped;
  return model_ ? model_->parameters() : std::vector<at::Tensor>{};
}

void TrackedState::leaveGroups() const {
  for (Stateful* o : objects_) o->leaveGroup();
}

void TrackedState::joinGroups(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) const {
  for (Stateful* o : objects_) o->joinGroup(group, userState);
}

void TrackedState::setSampler(DistributedSampler& sampler) {
  if (sampler_) throw ConfigError("ResilientTraining: a sampler is already registered (one per run)");
  sampler_ = &sampler;
}

void TrackedState::setScheduler(std::function<ItemDict()> save, std::function<void(const ItemDict&)> load) {
  if (schedulerSave_) throw ConfigError("ResilientTraining: a scheduler is already registered (one per run)");
  if (!save || !load) throw ConfigError("ResilientTraining::trackScheduler needs both a save and a load function");
  schedulerSave_ = std::move(save);
  schedulerLoad_ = std::move(load);
}

void TrackedState::addItems(std::function<void(ItemDict&)> save, std::function<void(const ItemDict&)> load) {
  if (!save || !load) throw ConfigError("ResilientTraining::trackItems needs both a save and a load function");
  items_.push_back(Items{std::move(save), std::move(load)});
}

void TrackedState::claimName(const std::string& name) {
  if (name.empty()) throw ConfigError("ResilientTraining::track: the name of a value is empty");
  if (name == kEpochCompleteKey || name == kDdpBucketsKey || name == kZeroShardsKey || name == kShardedModelKey)
    throw ConfigError("ResilientTraining::track: '" + name + "' is a name the library keeps for itself");
  for (const auto& n : names_)
    if (n == name) throw ConfigError("ResilientTraining::track: '" + name + "' is registered twice");
  names_.push_back(name);
}

void TrackedState::addNamed(const std::string& name, std::function<c10::IValue()> save,
                            std::function<void(const c10::IValue&)> load,
                            std::function<void(const c10::IValue&)> check) {
  if (!save || !load) throw ConfigError("ResilientTraining::track('" + name + "'): needs a save and a load function");
  claimName(name);
  if (check) checks_.emplace_back(name, std::move(check));
  addItems([name, save](ItemDict& d) { d.insert(name, save()); },
           [name, load](const ItemDict& d) {
             if (d.contains(name)) load(d.at(name));
           });
}

void TrackedState::checkFields(const Snapshot& snap) const {
  const ItemDict& user = snap.userState;
  auto refuse = [&](const std::string& key, const std::string& why) {
    throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "USER_STATE['" + key + "'] " + why);
  };
  auto expect = [&](const char* key, bool (c10::IValue::*is)() const, const char* kind) {
    if (user.contains(key) && !(user.at(key).*is)()) refuse(key, "is a " + user.at(key).tagKind() + ", expected " + kind);
  };
  auto positive = [&](const char* key) {
    expect(key, &c10::IValue::isInt, "an int");
    if (user.contains(key) && user.at(key).toInt() < 1) refuse(key, "is " + std::to_string(user.at(key).toInt()) + ", below 1");
  };
  expect(kEpochCompleteKey, &c10::IValue::isBool, "a bool");
  expect(kShardedModelKey, &c10::IValue::isBool, "a bool");
  positive(kZeroShardsKey);
  positive(kPipelineStageKey);
  for (const Stateful* o : objects_) o->checkEntries(snap);  // SnapshotCorrupt when malformed
  for (const auto& item : perRank_) {
    if (!user.contains(item.name)) continue;
    const c10::IValue& v = user.at(item.name);
    if (!v.isList()) refuse(item.name, "is a " + v.tagKind() + ", expected a list of numbers (one per rank)");
    for (const c10::IValue& x : v.toListRef())
      if (!x.isDouble() && !x.isInt()) refuse(item.name, "holds a " + x.tagKind() + ", expected numbers (one per rank)");
  }
  // The optimizer's state (a whole one: a sharded optimizer's is in the shards), dry-run against the
  // live optimizer: an entry missing or retyped in a state that is otherwise this optimizer's is
  // damage, set aside like a damaged file; a state for another optimizer is restore()'s to refuse.
  if (optimizer_ && !snap.optimizerType.empty() && !user.contains(kZeroShardsKey)) {
    const auto damage = optimizerStateDamage(*optimizer_, snap.optimizerType, snap.optimizerState);
    if (!damage.empty())
      throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "OPTIMIZER_STATE: " + damage.front());
  }
  for (const auto& [name, check] : checks_) {
    if (!user.contains(name)) continue;
    try {
      check(user.at(name));
    } catch (const std::exception& e) {
      refuse(name, std::string("cannot be restored: ") + errorMessage(e));
    }
  }
}

void TrackedState::addPerRank(const std::string& name, std::function<double()> save,
                              std::function<void(std::optional<double>)> load) {
  if (!save || !load) throw ConfigError("ResilientTraining::trackPerRank('" + name + "'): needs a save and a load function");
  claimName(name);
  perRank_.push_back(PerRank{name, std::move(save), std::move(load)});
}

std::vector<double> TrackedState::perRankValues() const {
  std::vector<double> values;
  for (const auto& item : perRank_) values.push_back(item.save());
  return values;
}

void TrackedState::insertPerRank(ItemDict& userState, const std::vector<double>& all, int world) const {
  const std::size_t count = perRank_.size();
  for (std::size_t k = 0; k < count; ++k) {
    std::vector<double> values;
    for (int r = 0; r < world; ++r) values.push_back(all.at(static_cast<std::size_t>(r) * count + k));
    userState.insert(perRank_[k].name, c10::IValue(values));
  }
}

void TrackedState::restorePerRank(const Snapshot& snapshot, int rank, int world) const {
  for (const auto& item : perRank_) {
    std::optional<double> mine;
    if (snapshot.userState.contains(item.name) && snapshot.header.worldSize == world) {
      // A list of floats (as written), read back as a generic list by some LibTorch versions.
      const c10::IValue& v = snapshot.userState.at(item.name);
      std::vector<double> values;
      if (v.isDoubleList()) {
        for (double x : v.toDoubleList()) values.push_back(x);
      } else if (v.isList()) {
        for (const c10::IValue& x : v.toListRef())
          if (x.isDouble()) values.push_back(x.toDouble());
      }
      if (values.size() != static_cast<std::size_t>(world))
        throw SnapshotIncompatible(snapshot.source, {"USER_STATE['" + item.name + "'] is not one number per rank (" +
                                                     std::to_string(world) + ")"});
      mine = values[static_cast<std::size_t>(rank)];
    }
    item.load(mine);
  }
}

Snapshot TrackedState::capture(const SnapshotIdentity& identity, const TrainingProgress& progress, bool epochComplete,
                               const ItemDict* entries, CapturePool* pool) const {
  // A model whose parameters are in the ranks' shard files (FSDP's, a pipeline stage's) is saved
  // there with its optimizer's state; the snapshot holds neither.
  const bool inShards = modelObject_ && modelObject_->modelInShards();
  Snapshot s = [&] {
    CapturePoolScope reuse(pool);
    if (inShards) return captureSnapshot(TrainingObjects{&noModel(), nullptr, sampler_}, identity, progress);
    return captureSnapshot(TrainingObjects{model_, optimizer_, sampler_}, identity, progress);
  }();
  if (schedulerSave_) s.schedulerState = schedulerSave_();
  for (const auto& item : items_) item.save(s.userState);
  s.userState.insert(kEpochCompleteKey, epochComplete);
  for (const auto& entry : entries ? *entries : this->entries()) s.userState.insert(entry.key(), entry.value());
  if (sharded()) s.userState.insert(kZeroShardsKey, static_cast<std::int64_t>(identity.worldSize));
  return s;
}

void TrackedState::refuseUnclaimed(const Snapshot& snap, const RestoreOptions& options) const {
  auto claimed = [&](const char* key) {
    for (const Stateful* o : objects_)
      if (claims(*o, key)) return true;
    return false;
  };
  const ItemDict& user = snap.userState;
  const std::string world = user.contains(kZeroShardsKey) ? describeValue(user.at(kZeroShardsKey)) : "its";
  if (user.contains(kPipelineStageKey) && !claimed(kPipelineStageKey))
    throw SnapshotIncompatible(snap.source, {"its model is split into pipeline stages (saved with a PipelineSchedule: " +
                                             describeValue(user.at(kPipelineStageKey)) +
                                             " stages): track a PipelineSchedule with the same stages to resume it"});
  if (user.contains(kShardedModelKey) && !claimed(kShardedModelKey))
    throw SnapshotIncompatible(snap.source, {"its model is sharded over " + world +
                                             " ranks (saved with FullyShardedDataParallel): track one to resume it"});
  // Optimizer shards with no sharded object to take them: a whole optimizer cannot.
  if (optimizer_ && options.optimizer && user.contains(kZeroShardsKey) && !sharded())
    throw SnapshotIncompatible(snap.source, {"its optimizer state is sharded over " + world +
                                             " ranks (saved with a ZeroRedundancyOptimizer): track one to resume it"});
}

SnapshotPoint TrackedState::restore(const Snapshot& snap, const RestoreOptions& options,
                                    const std::vector<ItemDict>& shards) const {
  refuseUnclaimed(snap, options);
  // Each tracked object takes its part (a sharded one from `shards`), checked before it changes
  // anything, and says what the rest must not restore.
  StateLoad load{snap, optimizer_, options, {}};
  for (Stateful* o : objects_) o->loadState(snap, shards, load);
  restoreSnapshot(load.whole,
                  TrainingObjects{load.options.model ? model_ : &noModel(), load.options.optimizer ? optimizer_ : nullptr, sampler_},
                  load.options);
  for (const auto& after : load.after) after();
  if (schedulerLoad_) schedulerLoad_(snap.schedulerState);
  for (const auto& item : items_) item.load(snap.userState);
  return pointOf(snap);
}

} // namespace ctorch::detail
