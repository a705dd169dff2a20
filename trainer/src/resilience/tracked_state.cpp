// The registry of what ResilientTraining saves, with its one capture and its one restore: a file's
// snapshot and a state sent in place between ranks are assembled and read back the same way.
#include "resilience/tracked_state.hpp"

#include "resilience/shard_files.hpp"
#include "snapshot/optimizer_check.hpp"

#include "ctorch/errors.hpp"
#include "ctorch/pipeline.hpp"

#include <torch/optim/optimizer.h>

namespace ctorch::detail {
namespace {

c10::IValue bucketsValue(const BucketLayout& buckets) {
  c10::impl::GenericList list(c10::ListType::create(c10::ListType::ofInts()));
  for (const auto& bucket : buckets) {
    c10::List<int64_t> indices;
    for (size_t i : bucket) indices.push_back(static_cast<int64_t>(i));
    list.push_back(indices);
  }
  return list;
}

// A string-keyed dict read back from a file (its key type may come back as Any).
ItemDict itemDictOf(const c10::IValue& value) {
  ItemDict out = newItemDict();
  for (const auto& item : value.toGenericDict()) out.insert(item.key().toStringRef(), item.value());
  return out;
}

// A value of a snapshot in a message: a number as it is, anything else by its type (a hostile file's
// string is not echoed).
std::string describeValue(const c10::IValue& value) {
  if (value.isInt()) return std::to_string(value.toInt());
  return "a " + value.tagKind();
}

// "children 3 to 5" (the names of a Sequential's children are their indices in the model).
std::string describeChildren(const std::vector<std::string>& children) {
  if (children.empty()) return "no children";
  if (children.size() == 1) return "child " + children.front();
  return "children " + children.front() + " to " + children.back();
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

std::optional<BucketLayout> bucketsOf(const Snapshot& snap) {
  if (!snap.userState.contains(kDdpBucketsKey)) return std::nullopt;
  const auto value = snap.userState.at(kDdpBucketsKey);
  if (!value.isList()) throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets is not a list");
  BucketLayout buckets;
  for (const auto& bucket : value.toList()) {
    const c10::IValue b = bucket;
    if (!b.isList()) throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets holds a non-list");
    buckets.emplace_back();
    for (const auto& item : b.toList()) {
      const c10::IValue index = item;
      if (!index.isInt() || index.toInt() < 0)
        throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets holds a bad parameter index");
      buckets.back().push_back(static_cast<size_t>(index.toInt()));
    }
  }
  return buckets;
}

void TrackedState::setModel(torch::nn::Module& module, DDPCore* ddp) {
  if (model_) throw ConfigError("ResilientTraining: a model is already registered (one model per run)");
  model_ = &module;
  ddp_ = ddp;
}

void TrackedState::setModel(FSDPCore& fsdp) {
  setModel(fsdp.module(), nullptr);
  fsdp_ = &fsdp;
}

void TrackedState::setModel(PipelineSchedule& pipeline) {
  setModel(*pipeline.stage().module().ptr(), nullptr);
  pipeline_ = &pipeline;
}

ItemDict TrackedState::pipelineLayout() const {
  PipelineStage& stage = pipeline_->stage();
  ItemDict layout = newItemDict();
  layout.insert("stages", static_cast<std::int64_t>(stage.numStages()));
  layout.insert("stage", static_cast<std::int64_t>(stage.stageIndex()));
  c10::List<std::string> children;
  for (const auto& child : stage.module()->named_children()) children.push_back(child.key());
  layout.insert("children", children);
  layout.insert("parameters", static_cast<std::int64_t>(stage.module()->parameters().size()));
  layout.insert("steps", pipeline_->stepCount());
  return layout;
}

Snapshot TrackedState::captureRankShard(const SnapshotIdentity& identity, const TrainingProgress& progress, int rank) const {
  if (zero_) return captureShard(zero_->shard(), identity, progress);
  if (pipeline_) return captureShard(*model_, optimizer_, pipelineLayout(), rank, identity, progress);
  return captureShard(*fsdp_, optimizer_, identity, progress);
}

ItemDict TrackedState::rankShard() const {
  if (zero_) return zero_->shard();
  if (pipeline_) return wholeOptimizerAsShard(captureShard(*model_, optimizer_, pipelineLayout(), -1, {}, {}));
  ItemDict shard = newItemDict();
  shard.insert(kShardedModelKey, fsdp_->shardStateDict());
  if (optimizer_) shard.insert("fsdp_optimizer", fsdp_->optimizerShardStateDict(*optimizer_));
  return shard;
}

std::string TrackedState::whyNoShardCopies() const {
  if (fsdp_ && !fsdp_->followsDefaultGroup())
    return "its FullyShardedDataParallel runs on process groups of its own (hybrid sharding or FSDPOptions::processGroup), "
           "which are not re-formed";
  if (pipeline_)
    return "its pipeline stages run on process groups of their own (PipelineStageOptions::group), which are not re-formed";
  if (zero_ && !zero_->rejoin)
    return "its sharded optimizer (a parameter server, or one on a process group of its own) cannot follow a re-formed group";
  return {};
}

void TrackedState::releaseShardedGroups() const {
  if (fsdp_) fsdp_->releaseGroup();
  if (zero_ && zero_->releaseGroup) zero_->releaseGroup();
}

void TrackedState::rejoinShardedGroups(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const {
  if (fsdp_) fsdp_->rejoin(group);
  if (zero_ && zero_->rejoin) zero_->rejoin(group);
}

void TrackedState::setOptimizer(torch::optim::Optimizer& optimizer) {
  if (optimizer_ || zero_) throw ConfigError("ResilientTraining: an optimizer is already registered (one per run)");
  optimizer_ = &optimizer;
}

void TrackedState::setOptimizer(ZeroRedundancyOptimizer& optimizer) {
  ShardedOptimizer sharded{[&optimizer] { return optimizer.shardStateDict(); },
                           [&optimizer](const std::vector<ItemDict>& shards) { optimizer.loadShardStateDicts(shards); },
                           nullptr, nullptr};
  if (optimizer.followsDefaultGroup()) {
    sharded.releaseGroup = [&optimizer] { optimizer.releaseGroup(); };
    sharded.rejoin = [&optimizer](c10::intrusive_ptr<c10d::ProcessGroup> group) { optimizer.rejoin(std::move(group)); };
  }
  setOptimizer(std::move(sharded));
}

void TrackedState::setOptimizer(ShardedOptimizer sharded) {
  if (optimizer_ || zero_) throw ConfigError("ResilientTraining: an optimizer is already registered (one per run)");
  zero_ = std::move(sharded);
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
  (void)bucketsOf(snap);  // SnapshotCorrupt when malformed
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
                               const std::optional<BucketLayout>& buckets, CapturePool* pool) const {
  Snapshot s = [&] {
    CapturePoolScope reuse(pool);
    // A sharded model's parameters and its optimizer's state are in the ranks' shard files.
    // So are a pipeline stage's.
    if (fsdp_ || pipeline_) return captureSnapshot(TrainingObjects{&noModel(), nullptr, sampler_}, identity, progress);
    return captureSnapshot(TrainingObjects{model_, optimizer_, sampler_}, identity, progress);
  }();
  if (schedulerSave_) s.schedulerState = schedulerSave_();
  for (const auto& item : items_) item.save(s.userState);
  s.userState.insert(kEpochCompleteKey, epochComplete);
  if (buckets) s.userState.insert(kDdpBucketsKey, bucketsValue(*buckets));
  if (sharded()) s.userState.insert(kZeroShardsKey, static_cast<std::int64_t>(identity.worldSize));
  if (fsdp_) s.userState.insert(kShardedModelKey, true);
  if (pipeline_) s.userState.insert(kPipelineStageKey, static_cast<std::int64_t>(pipeline_->stage().numStages()));
  return s;
}

SnapshotPoint TrackedState::restore(const Snapshot& snap, const RestoreOptions& options,
                                    const std::vector<ItemDict>& shards) const {
  if (pipeline_) return restorePipeline(snap, options, shards);
  if (snap.userState.contains(kPipelineStageKey))
    throw SnapshotIncompatible(snap.source, {"its model is split into pipeline stages (saved with a PipelineSchedule: " +
                                             describeValue(snap.userState.at(kPipelineStageKey)) +
                                             " stages): track a PipelineSchedule with the same stages to resume it"});
  const bool shardedModel = snap.userState.contains(kShardedModelKey);
  if (fsdp_) {
    if (!shardedModel)
      throw SnapshotIncompatible(snap.source, {"it holds a whole model (saved without FullyShardedDataParallel): "
                                               "resume it without sharding the model"});
    std::vector<ItemDict> models, optimizers;
    for (const auto& shard : shards) {
      models.push_back(itemDictOf(shard.at(kShardedModelKey)));
      if (shard.contains("fsdp_optimizer")) optimizers.push_back(itemDictOf(shard.at("fsdp_optimizer")));
    }
    if (optimizer_ && options.optimizer && optimizers.size() != shards.size())
      throw SnapshotIncompatible(snap.source, {"its shards hold no optimizer state"});
    if (options.model) fsdp_->loadShardStateDicts(models);
    if (optimizer_ && options.optimizer) fsdp_->loadOptimizerShardStateDicts(*optimizer_, optimizers);
    RestoreOptions rest = options;
    rest.model = false;
    rest.optimizer = false;
    restoreSnapshot(snap, TrainingObjects{&noModel(), nullptr, sampler_}, rest);
    if (schedulerLoad_) schedulerLoad_(snap.schedulerState);
    for (const auto& item : items_) item.load(snap.userState);
    return pointOf(snap);
  }
  if (shardedModel)
    throw SnapshotIncompatible(snap.source, {"its model is sharded over " + std::to_string(snap.userState.at(kZeroShardsKey).toInt()) +
                                             " ranks (saved with FullyShardedDataParallel): track one to resume it"});
  if (zero_ && options.optimizer) {
    // Before anything changes: shards that do not fit are refused with nothing restored.
    if (!snap.userState.contains(kZeroShardsKey) && snap.optimizerType.empty())
      throw SnapshotIncompatible(snap.source, {"it holds no optimizer state for the ZeroRedundancyOptimizer"});
    zero_->load(snap.userState.contains(kZeroShardsKey) ? shards
                                                                        : std::vector<ItemDict>{wholeOptimizerAsShard(snap)});
  } else if (optimizer_ && options.optimizer && snap.userState.contains(kZeroShardsKey)) {
    throw SnapshotIncompatible(snap.source, {"its optimizer state is sharded over " +
                                             std::to_string(snap.userState.at(kZeroShardsKey).toInt()) +
                                             " ranks (saved with a ZeroRedundancyOptimizer): track one to resume it"});
  }
  restoreSnapshot(snap, TrainingObjects{model_, optimizer_, sampler_}, options);
  if (schedulerLoad_) schedulerLoad_(snap.schedulerState);
  for (const auto& item : items_) item.load(snap.userState);
  return pointOf(snap);
}

SnapshotPoint TrackedState::restorePipeline(const Snapshot& snap, const RestoreOptions& options,
                                            const std::vector<ItemDict>& shards) const {
  PipelineStage& stage = pipeline_->stage();
  if (!snap.userState.contains(kPipelineStageKey))
    throw SnapshotIncompatible(snap.source, {"it holds a whole model (saved without pipeline stages): resume it without a "
                                             "PipelineSchedule, or start this pipeline afresh"});
  const auto& saved = snap.userState.at(kPipelineStageKey);
  if (!saved.isInt() || saved.toInt() != stage.numStages())
    throw SnapshotIncompatible(snap.source, {"it was saved by a pipeline of " + describeValue(saved) + " stages, this run has " +
                                             std::to_string(stage.numStages()) + ": resume it with " + describeValue(saved) +
                                             " stages (ctorch-train --pipeline-stages), or make it one whole model's "
                                             "(ctorch-snapshot consolidate)"});
  // This rank's own shard when it holds this stage (the same world and layout), else the shard of
  // another replica of the same stage (replicas hold the same state): a world of another number of
  // pipelines resumes too.
  std::vector<std::size_t> order;
  if (options.rank >= 0 && static_cast<std::size_t>(options.rank) < shards.size()) order.push_back(static_cast<std::size_t>(options.rank));
  for (std::size_t i = 0; i < shards.size(); ++i)
    if (static_cast<std::int64_t>(i) != options.rank) order.push_back(i);
  const ItemDict* shard = nullptr;
  PipelineStageLayout layout;
  for (const std::size_t i : order) {
    PipelineStageLayout candidate = pipelineShardLayout(snap, shards[i]);
    if (candidate.stages != stage.numStages())
      throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "its pipeline stage shards are of pipelines of different lengths");
    if (candidate.stage == stage.stageIndex()) {
      shard = &shards[i];
      layout = std::move(candidate);
      break;
    }
  }
  if (!shard)
    throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "its pipeline stage shards: none holds stage " + std::to_string(stage.stageIndex()));
  const PipelineStageLayout mine = pipelineStageLayout(snap, c10::IValue(pipelineLayout()));
  if (layout.children != mine.children || layout.parameters != mine.parameters)
    throw SnapshotIncompatible(snap.source, {"its stage " + std::to_string(stage.stageIndex()) + " held the model's " +
                                             describeChildren(layout.children) + " (" + std::to_string(layout.parameters) +
                                             " parameters), this run's holds " + describeChildren(mine.children) + " (" +
                                             std::to_string(mine.parameters) + ")" +
                                             ": resume it with the same partition of the model into stages, or make it one whole model's "
                                             "(ctorch-snapshot consolidate)"});
  const std::string type = shard->at("optimizer_type").isString() ? shard->at("optimizer_type").toStringRef() : "";
  if (optimizer_ && options.optimizer && type.empty())
    throw SnapshotIncompatible(snap.source, {"its stage shards hold no optimizer state"});
  // The stage's state as a snapshot of its own: the file's checks (names, shapes, dtypes; the
  // optimizer's kind and groups) before anything changes.
  Snapshot part = snap;
  part.modelState = c10::Dict<std::string, at::Tensor>();
  for (const auto& entry : shard->at(kPipelineModelKey).toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor())
      throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "its pipeline stage shards: a parameter that is not a named tensor");
    part.modelState.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  part.optimizerType = type;
  part.optimizerState = newItemDict();
  part.optimizerState.insert("state", shard->at("state"));
  part.optimizerState.insert("param_groups", shard->at("param_groups"));
  restoreSnapshot(part, TrainingObjects{model_, optimizer_, sampler_}, options);
  pipeline_->setStepCount(layout.steps);
  if (schedulerLoad_) schedulerLoad_(snap.schedulerState);
  for (const auto& item : items_) item.load(snap.userState);
  return pointOf(snap);
}

} // namespace ctorch::detail
