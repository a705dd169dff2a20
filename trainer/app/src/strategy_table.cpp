// ctorch-train's strategy table (strategy_table.hpp): each way of sharing a step with its flags, what
// it refuses (in the words the user reads), how it is spoken of and how it is made.
#include "ctorch/train/strategy_table.hpp"

#include "option_choices.hpp"
#include "strategies.hpp"

#include <stdexcept>

namespace ctorch::train {

namespace {

bool asks(const TrainOptions& o, Feature f) {
  switch (f) {
    case Feature::kSharding: return o.sharding != ShardingChoice::kNone;
    case Feature::kParameterServer: return o.sync == SyncChoice::kParameterServer;
    case Feature::kLossScaling: return o.amp && o.ampDtype == "float16";
    case Feature::kAmp: return o.amp;
    case Feature::kCudaGraphs: return o.cudaGraphs;
    case Feature::kClipping: return o.clipGradNorm > 0;
    case Feature::kAccumulation: return o.gradAccumSteps > 1;
    case Feature::kChannelsLast: return o.memoryFormat == MemoryFormatChoice::kChannelsLast;
    case Feature::kShardCopies: return o.shardCopies > 0;
    case Feature::kFsdpMixedPrecision: return !o.fsdpParamDtype.empty() || !o.fsdpReduceDtype.empty();
  }
  return false;
}

std::string featureFlags(const TrainOptions& o, Feature f) {
  switch (f) {
    case Feature::kSharding: return std::string("--sharding ") + toString(o.sharding);
    case Feature::kParameterServer: return "--sync parameter-server";
    case Feature::kLossScaling: return "--amp float16 (loss scaling)";
    case Feature::kAmp: return "--amp";
    case Feature::kCudaGraphs: return "--cuda-graphs";
    case Feature::kClipping: return "--clip-grad-norm";
    case Feature::kAccumulation: return "--grad-accum-steps " + std::to_string(o.gradAccumSteps);
    case Feature::kChannelsLast: return "--memory-format channels-last";
    case Feature::kShardCopies: return "--shard-copies " + std::to_string(o.shardCopies);
    case Feature::kFsdpMixedPrecision:
      return !o.fsdpParamDtype.empty() ? "--fsdp-param-dtype " + o.fsdpParamDtype : "--fsdp-reduce-dtype " + o.fsdpReduceDtype;
  }
  return "?";
}

void replaceAll(std::string& text, const std::string& from, const std::string& to) {
  for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size()))
    text.replace(at, from.size(), to);
}

std::string shardingFlags(const TrainOptions& o) { return std::string("--sharding ") + toString(o.sharding); }

// What a pipeline's own flags need besides their ranges (validate checks those for every run).
void checkPipeline(const TrainOptions& o) {
  auto refuse = [&](const std::string& with, const std::string& why) {
    throw UsageError("--pipeline-stages " + std::to_string(o.pipelineStages) + " with " + with + ": " + why);
  };
  if (o.microBatches > o.batchSize)
    refuse("--micro-batches " + std::to_string(o.microBatches) + " and --batch-size " + std::to_string(o.batchSize),
           "every micro-batch needs a row of the batch (use --micro-batches <= --batch-size)");
  if (o.model == "linear") refuse("--model linear", "the model is one layer, nothing to cut into stages (use mnist-cnn, simple-cnn or resnet18)");
}

void checkParameterServer(const TrainOptions& o) {
  if (o.psServers < 1 || o.psServers > 1024) choices::bad("--ps-servers", std::to_string(o.psServers), "must be in [1, 1024]");
}

// The refusals several entries share, in their words.
constexpr const char* kShardCopiesNeedShards =
    "{feature} needs sharded state: --sharding optimizer, grad-op or full (a run without it recovers in place already)";
constexpr const char* kFsdpMixedPrecisionNeedsFsdp =
    "{feature} is FSDP's mixed precision, and {flags} does not shard the model (use --sharding grad-op, full, hybrid "
    "or hybrid-grad-op)";
// GradScaler checks the gradients of the optimizer it steps: a rank's share only, so the ranks could
// disagree on skipping a step.
constexpr const char* kShardedLossScaling =
    "{flags} with {feature} is not supported: use --amp-dtype bfloat16 or --sharding none";
constexpr const char* kOnlyDdpCaptured = "{feature} with {flags}: only DDP's step is captured (use --sharding none)";
// FSDP keeps each unit's parameters as views of one flat contiguous buffer (ctorch/memory_format.hpp).
constexpr const char* kFlatParameters =
    "{feature} with {flags} is not supported: FSDP keeps each unit's parameters in one flat contiguous buffer (use "
    "--memory-format auto or contiguous, or --sharding none or optimizer)";

std::vector<StrategyEntry> makeTable() {
  std::vector<StrategyEntry> t;
  // --sharding none: DDP with the whole optimizer on every rank; also the unsharded state under a
  // parameter server or a pipeline.
  t.push_back({"DDP", [](const TrainOptions& o) { return o.sharding == ShardingChoice::kNone; }, shardingFlags,
               {{Feature::kShardCopies, kShardCopiesNeedShards},
                {Feature::kFsdpMixedPrecision, kFsdpMixedPrecisionNeedsFsdp}},
               nullptr, InPlaceRecovery::kYes, "rank", nullptr, makeDataParallel});
  // --sharding optimizer: DDP with ZeRO-1's share of the optimizer on each rank.
  t.push_back({"ZeRO-1", [](const TrainOptions& o) { return o.sharding == ShardingChoice::kOptimizer; }, shardingFlags,
               {{Feature::kLossScaling, kShardedLossScaling},
                {Feature::kFsdpMixedPrecision, kFsdpMixedPrecisionNeedsFsdp},
                {Feature::kCudaGraphs, kOnlyDdpCaptured}},
               nullptr, InPlaceRecovery::kWithShardCopies, "rank", nullptr, makeDataParallel});
  // --sharding grad-op|full: FSDP over all ranks.
  t.push_back({"FSDP", [](const TrainOptions& o) { return shardsModel(o.sharding) && !isHybrid(o.sharding); }, shardingFlags,
               {{Feature::kLossScaling, kShardedLossScaling},
                {Feature::kChannelsLast, kFlatParameters},
                {Feature::kCudaGraphs, kOnlyDdpCaptured}},
               nullptr, InPlaceRecovery::kWithShardCopies, "rank", "auto: FSDP's flat parameters are contiguous",
               makeFullySharded});
  // --sharding hybrid|hybrid-grad-op: FSDP within each node, replicas across the nodes.
  t.push_back({"hybrid FSDP", [](const TrainOptions& o) { return isHybrid(o.sharding); }, shardingFlags,
               {{Feature::kLossScaling, kShardedLossScaling},
                {Feature::kShardCopies, "{feature} with {flags} is not supported: hybrid sharding's node and replica groups "
                                        "are not re-formed in place (use --sharding full or grad-op, or --shard-copies 0)"},
                {Feature::kChannelsLast, kFlatParameters},
                {Feature::kCudaGraphs, kOnlyDdpCaptured}},
               nullptr, InPlaceRecovery::kWithShardCopies, "rank", "auto: FSDP's flat parameters are contiguous",
               makeFullySharded});
  // --sync parameter-server: workers compute gradients, the last --ps-servers ranks average them and step.
  t.push_back({"parameter server", [](const TrainOptions& o) { return o.sync == SyncChoice::kParameterServer; },
               [](const TrainOptions&) { return std::string("--sync parameter-server"); },
               {{Feature::kSharding, "{flags} with {feature}: the servers already hold the optimizer state, sharded over them (use --sharding none)"},
                // A worker holds its own gradients only: no rank sees the averaged gradient whose norm clipping needs.
                {Feature::kClipping, "{flags} with {feature}: no rank holds the averaged gradients whose norm it needs (use --sync allreduce)"},
                {Feature::kLossScaling, "{flags} with {feature} is not supported: use --amp-dtype bfloat16 or --sync allreduce"},
                {Feature::kCudaGraphs, "{feature} with {flags}: its push and pull run on the host"}},
               checkParameterServer, InPlaceRecovery::kNo, "worker", nullptr, makeParameterServing});
  // --pipeline-stages S: the model cut into stages over consecutive ranks (docs/pipeline.md).
  t.push_back({"pipeline", [](const TrainOptions& o) { return o.pipelineStages > 1; },
               [](const TrainOptions& o) { return "--pipeline-stages " + std::to_string(o.pipelineStages); },
               {{Feature::kSharding, "{flags} with {feature}: each stage holds its own parameters and optimizer already (use --sharding none)"},
                {Feature::kParameterServer, "{flags} with {feature}: the stages' replicas average by allreduce (use --sync allreduce)"},
                {Feature::kAccumulation, "{flags} with {feature}: a pipeline's step accumulates over its micro-batches already (use --micro-batches)"},
                {Feature::kClipping, "{flags} with {feature}: the global norm over the stages is not computed yet"},
                {Feature::kAmp, "{flags} with {feature}: mixed precision is not carried through the stages yet"},
                {Feature::kCudaGraphs, "{flags} with {feature}: a pipeline's step sends and receives between processes"},
                {Feature::kChannelsLast, "{flags} with {feature}: activations travel between the stages contiguous (use --memory-format auto or contiguous)"}},
               checkPipeline, InPlaceRecovery::kNo, "pipeline", "auto: a pipeline's activations travel contiguous",
               makePipelined});
  return t;
}

}  // namespace

const std::vector<StrategyEntry>& strategyTable() {
  static const std::vector<StrategyEntry> table = makeTable();
  return table;
}

const StrategyEntry& chosenStrategy(const TrainOptions& o) {
  const auto& table = strategyTable();
  for (auto entry = table.rbegin(); entry != table.rend(); ++entry)
    if (entry->chosenBy(o)) return *entry;
  throw std::logic_error("no strategy entry takes these options");  // every --sharding has one
}

void checkStrategy(const TrainOptions& o) {
  for (const StrategyEntry& entry : strategyTable()) {
    if (!entry.chosenBy(o)) continue;
    if (entry.checkOwn) entry.checkOwn(o);
    for (const Refusal& refusal : entry.refuses) {
      if (!asks(o, refusal.feature)) continue;
      // That CUDA graphs need CUDA comes before why this strategy's step cannot be captured.
      if (refusal.feature == Feature::kCudaGraphs && o.device == DeviceChoice::kCpu)
        throw UsageError(choices::kCudaGraphsNeedCuda);
      std::string message = refusal.message;
      replaceAll(message, "{flags}", entry.flags(o));
      replaceAll(message, "{feature}", featureFlags(o, refusal.feature));
      throw UsageError(message);
    }
  }
}

std::string inPlaceRecoveryOffWith(const TrainOptions& o) {
  const StrategyEntry& entry = chosenStrategy(o);
  switch (entry.inPlaceRecovery) {
    case InPlaceRecovery::kYes: return "";
    case InPlaceRecovery::kWithShardCopies: return o.shardCopies == 0 ? entry.flags(o) + " --shard-copies 0" : "";
    case InPlaceRecovery::kNo: return entry.flags(o);
  }
  return "";
}

}  // namespace ctorch::train
