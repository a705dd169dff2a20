// A pipeline stage as a checkpoint sees it, through its schedule (ctorch/stateful.hpp): rank 0's
// snapshot holds no parameters (USER_STATE["pipeline_stage"]: the number of stages); every rank's
// shard file holds its stage's parameters, buffers and optimizer state with the stage's layout
// ("stages", "stage", "children" of the model it holds, "parameters", "steps"). A resume takes each
// rank's stage from its own shard, or another replica's of the same stage when the number of
// pipelines changed; a snapshot of another number of stages or another partition is refused. Its
// stages run on groups of their own: it cannot follow a group re-formed in place.
#include "ctorch/pipeline.hpp"

#include "resilience/shard_files.hpp"

#include <torch/nn/module.h>

namespace ctorch {
namespace {

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

// The stage's layout (kPipelineStageKey's dict in its shard file).
ItemDict stageLayout(const PipelineSchedule& schedule) {
  PipelineStage& stage = schedule.stage();
  ItemDict layout = newItemDict();
  layout.insert("stages", static_cast<std::int64_t>(stage.numStages()));
  layout.insert("stage", static_cast<std::int64_t>(stage.stageIndex()));
  c10::List<std::string> children;
  for (const auto& child : stage.module()->named_children()) children.push_back(child.key());
  layout.insert("children", children);
  layout.insert("parameters", static_cast<std::int64_t>(stage.module()->parameters().size()));
  layout.insert("steps", schedule.stepCount());
  return layout;
}

} // namespace

torch::nn::Module* PipelineSchedule::trackedModule() { return stage().module().ptr().get(); }

void PipelineSchedule::saveEntries(ItemDict& userState) const {
  userState.insert(detail::kPipelineStageKey, static_cast<std::int64_t>(stage().numStages()));
}

std::vector<std::string> PipelineSchedule::entryNames() const { return {detail::kPipelineStageKey}; }

ItemDict PipelineSchedule::shardState(torch::optim::Optimizer* optimizer) const {
  return detail::shardOf(detail::captureShard(*stage().module().ptr(), optimizer, stageLayout(*this), -1, {}, {}));
}

Snapshot PipelineSchedule::shardFile(const ShardContext& context) const {
  return detail::captureShard(*stage().module().ptr(), context.optimizer, stageLayout(*this), context.rank,
                              context.identity, context.progress);
}

void PipelineSchedule::loadState(const Snapshot& snap, const std::vector<ItemDict>& shards, StateLoad& load) {
  using detail::kPipelineStageKey;
  PipelineStage& stage = this->stage();
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
  const std::int64_t rank = load.options.rank;
  std::vector<std::size_t> order;
  if (rank >= 0 && static_cast<std::size_t>(rank) < shards.size()) order.push_back(static_cast<std::size_t>(rank));
  for (std::size_t i = 0; i < shards.size(); ++i)
    if (static_cast<std::int64_t>(i) != rank) order.push_back(i);
  const ItemDict* shard = nullptr;
  detail::PipelineStageLayout layout;
  for (const std::size_t i : order) {
    detail::PipelineStageLayout candidate = detail::pipelineShardLayout(snap, shards[i]);
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
  const detail::PipelineStageLayout mine = detail::pipelineStageLayout(snap, c10::IValue(stageLayout(*this)));
  if (layout.children != mine.children || layout.parameters != mine.parameters)
    throw SnapshotIncompatible(snap.source, {"its stage " + std::to_string(stage.stageIndex()) + " held the model's " +
                                             describeChildren(layout.children) + " (" + std::to_string(layout.parameters) +
                                             " parameters), this run's holds " + describeChildren(mine.children) + " (" +
                                             std::to_string(mine.parameters) + ")" +
                                             ": resume it with the same partition of the model into stages, or make it one whole model's "
                                             "(ctorch-snapshot consolidate)"});
  const std::string type = shard->at("optimizer_type").isString() ? shard->at("optimizer_type").toStringRef() : "";
  if (load.optimizer && load.options.optimizer && type.empty())
    throw SnapshotIncompatible(snap.source, {"its stage shards hold no optimizer state"});
  // The rest is restored from the stage's state as a snapshot of its own: the file's checks (names,
  // shapes, dtypes; the optimizer's kind and groups) before anything changes.
  load.whole.modelState = c10::Dict<std::string, at::Tensor>();
  for (const auto& entry : shard->at(detail::kPipelineModelKey).toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor())
      throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "its pipeline stage shards: a parameter that is not a named tensor");
    load.whole.modelState.insert(entry.key().toStringRef(), entry.value().toTensor());
  }
  load.whole.optimizerType = type;
  load.whole.optimizerState = newItemDict();
  load.whole.optimizerState.insert("state", shard->at("state"));
  load.whole.optimizerState.insert("param_groups", shard->at("param_groups"));
  const std::int64_t steps = layout.steps;
  load.after.push_back([this, steps] { setStepCount(steps); });
}

std::string PipelineSchedule::whyNotInPlace() const {
  return "its pipeline stages run on process groups of their own (PipelineStageOptions::group), which are not re-formed";
}

} // namespace ctorch
