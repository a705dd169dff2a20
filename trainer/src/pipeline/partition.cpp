// The pure half of pipeline parallelism: cutting a Sequential into stages and the schedules'
// action lists, with no process group.
#include "pipeline/partition.hpp"

#include "ctorch/mix_bits.hpp"

#include <algorithm>
#include <cctype>
#include <limits>
#include <numeric>

namespace ctorch {
namespace {

std::string sizesText(const std::vector<std::size_t>& sizes) {
  std::string text = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

} // namespace

std::vector<std::size_t> balancedPartitionOfCounts(const std::vector<std::int64_t>& counts, int stages) {
  const std::size_t n = counts.size();
  if (stages < 1) throw ConfigError("pipeline: stages must be at least 1, got " + std::to_string(stages));
  if (n < static_cast<std::size_t>(stages))
    throw ConfigError("pipeline: " + std::to_string(n) + " children cannot make " + std::to_string(stages) +
                      " stages of at least one child each");
  for (std::size_t i = 0; i < n; ++i)
    if (counts[i] < 0) throw ConfigError("pipeline: child " + std::to_string(i) + " has a negative parameter count");
  std::vector<std::int64_t> prefix(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + counts[i];
  const auto sum = [&](std::size_t from, std::size_t to) { return prefix[to] - prefix[from]; };
  constexpr std::int64_t kInf = std::numeric_limits<std::int64_t>::max();
  const std::size_t s = static_cast<std::size_t>(stages);
  // best[k][i]: the smallest largest stage of the first i children cut into k stages; cut[k][i] the
  // start of the k-th stage in it (the earliest start that reaches the best).
  std::vector<std::vector<std::int64_t>> best(s + 1, std::vector<std::int64_t>(n + 1, kInf));
  std::vector<std::vector<std::size_t>> cut(s + 1, std::vector<std::size_t>(n + 1, 0));
  best[0][0] = 0;
  for (std::size_t k = 1; k <= s; ++k)
    for (std::size_t i = k; i <= n; ++i)
      for (std::size_t j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == kInf) continue;
        const std::int64_t cost = std::max(best[k - 1][j], sum(j, i));
        if (cost < best[k][i]) {
          best[k][i] = cost;
          cut[k][i] = j;
        }
      }
  std::vector<std::size_t> sizes(s);
  std::size_t end = n;
  for (std::size_t k = s; k >= 1; --k) {
    sizes[k - 1] = end - cut[k][end];
    end = cut[k][end];
  }
  return sizes;
}

std::vector<std::size_t> balancedPartition(const torch::nn::Sequential& model, int stages) {
  std::vector<std::int64_t> counts;
  for (const auto& child : model->children()) {
    std::int64_t count = 0;
    for (const auto& p : child->parameters()) count += p.numel();
    counts.push_back(count);
  }
  return balancedPartitionOfCounts(counts, stages);
}

torch::nn::Sequential pipelineSplit(const torch::nn::Sequential& model, const std::vector<std::size_t>& stageSizes,
                                    int stage) {
  const std::size_t children = model->size();
  const std::size_t total = std::accumulate(stageSizes.begin(), stageSizes.end(), std::size_t{0});
  if (stageSizes.empty() || total != children)
    throw ConfigError("pipeline: stage sizes " + sizesText(stageSizes) + " add up to " + std::to_string(total) +
                      ", but the model has " + std::to_string(children) + " children");
  if (std::find(stageSizes.begin(), stageSizes.end(), std::size_t{0}) != stageSizes.end())
    throw ConfigError("pipeline: stage sizes " + sizesText(stageSizes) + " give a stage no child");
  if (stage < 0 || static_cast<std::size_t>(stage) >= stageSizes.size())
    throw ConfigError("pipeline: stage " + std::to_string(stage) + " is outside the " +
                      std::to_string(stageSizes.size()) + " stages");
  const std::size_t first = std::accumulate(stageSizes.begin(), stageSizes.begin() + stage, std::size_t{0});
  torch::nn::Sequential part;
  for (std::size_t i = first; i < first + stageSizes[static_cast<std::size_t>(stage)]; ++i)
    part->push_back(std::to_string(i), *(model->begin() + static_cast<std::ptrdiff_t>(i)));  // "3": its index in the model
  return part;
}

const char* toString(PipelineScheduleKind kind) {
  return kind == PipelineScheduleKind::kGPipe ? "gpipe" : "1f1b";
}

PipelineScheduleKind parsePipelineSchedule(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "gpipe") return PipelineScheduleKind::kGPipe;
  if (lower == "1f1b") return PipelineScheduleKind::k1F1B;
  throw ConfigError("pipeline: unknown schedule '" + name + "' (gpipe or 1f1b)");
}

std::vector<PipelineAction> pipelineActions(PipelineScheduleKind kind, int stage, int numStages, int microBatches) {
  if (numStages < 1 || stage < 0 || stage >= numStages || microBatches < 1)
    throw ConfigError("pipeline: no schedule for stage " + std::to_string(stage) + " of " + std::to_string(numStages) +
                      " with " + std::to_string(microBatches) + " micro-batches");
  using K = PipelineAction::Kind;
  std::vector<PipelineAction> actions;
  if (kind == PipelineScheduleKind::kGPipe) {
    for (int m = 0; m < microBatches; ++m) actions.push_back({K::kForward, m});
    for (int m = 0; m < microBatches; ++m) actions.push_back({K::kBackward, m});
    return actions;
  }
  // 1F1B (PipeDream-Flush): the stages after this one need S - stage - 1 forwards in flight before
  // the first gradient can come back; then each forward is followed by the oldest backward.
  const int warmup = std::min(numStages - stage - 1, microBatches);
  int forward = 0, backward = 0;
  for (; forward < warmup; ++forward) actions.push_back({K::kForward, forward});
  for (; forward < microBatches; ++forward, ++backward) {
    actions.push_back({K::kForward, forward});
    actions.push_back({K::kBackward, backward});
  }
  for (; backward < microBatches; ++backward) actions.push_back({K::kBackward, backward});
  return actions;
}

std::string describeActions(const std::vector<PipelineAction>& actions) {
  std::string text;
  for (const auto& a : actions) {
    if (!text.empty()) text += ' ';
    text += (a.kind == PipelineAction::Kind::kForward ? 'F' : 'B') + std::to_string(a.microBatch);
  }
  return text;
}

std::uint64_t pipelineMicroBatchSeed(std::uint64_t seed, std::int64_t step, int microBatch, int stage) {
  return mixBits(seed, static_cast<std::uint64_t>(step),
                 (static_cast<std::uint64_t>(static_cast<std::uint32_t>(stage)) << 32) |
                     static_cast<std::uint32_t>(microBatch));
}

} // namespace ctorch
