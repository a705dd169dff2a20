#include "ctorch/sampler.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <sstream>

namespace ctorch {
namespace {

std::string boolName(bool b) { return b ? "true" : "false"; }

// Python: ceil((N - W) / W) when drop_last and N % W != 0, else ceil(N / W). For N % W != 0 the
// first is floor(N / W); for N < W it is 0 (math.ceil of a value in (-1, 0)).
std::int64_t samplesPerRank(std::int64_t datasetSize, std::int64_t worldSize, bool dropLast) {
  if (dropLast && datasetSize % worldSize != 0) return datasetSize / worldSize;
  return (datasetSize + worldSize - 1) / worldSize;
}

} // namespace

void DistributedSamplerOptions::validate() const {
  if (datasetSize < 0)
    throw ConfigError("DistributedSampler: dataset size must be >= 0, got " +
                                std::to_string(datasetSize));
  if (worldSize < 1)
    throw ConfigError("DistributedSampler: world size must be >= 1, got " +
                                std::to_string(worldSize));
  if (rank < 0 || rank >= worldSize)
    throw ConfigError("DistributedSampler: invalid rank " + std::to_string(rank) +
                                ", rank should be in the interval [0, " +
                                std::to_string(worldSize - 1) + "]");
  // The generator is seeded with seed + epoch as an unsigned 64-bit value; negative seeds are
  // refused rather than silently wrapped.
  if (seed < 0)
    throw ConfigError("DistributedSampler: seed must be >= 0, got " +
                                std::to_string(seed));
}

bool SamplerState::operator==(const SamplerState& o) const {
  return epoch == o.epoch && consumed == o.consumed && worldSize == o.worldSize &&
         datasetSize == o.datasetSize && seed == o.seed && shuffle == o.shuffle &&
         dropLast == o.dropLast;
}

DistributedSampler::DistributedSampler(const DistributedSamplerOptions& options)
    : options_(options) {
  options_.validate();
  numSamples_ = samplesPerRank(options_.datasetSize, options_.worldSize, options_.dropLast);
}

void DistributedSampler::setEpoch(std::int64_t epoch) {
  if (epoch < 0)
    throw ConfigError("DistributedSampler::setEpoch: epoch must be >= 0, got " +
                                std::to_string(epoch));
  const bool keepRestoredPosition = resumePending_ && epoch == epoch_;
  resumePending_ = false;
  if (keepRestoredPosition) return;
  if (epoch != epoch_) indicesValid_ = false;
  epoch_ = epoch;
  position_ = 0;
}

const std::vector<std::int64_t>& DistributedSampler::indices() const {
  ensureIndices();
  return indices_;
}

void DistributedSampler::ensureIndices() const {
  if (indicesValid_) return;
  const std::int64_t n = options_.datasetSize;
  const std::int64_t total = totalSize();
  indices_.clear();
  indices_.reserve(static_cast<std::size_t>(numSamples_));
  // Padding repeats the list from its start (Python's indices[:pad] or repeated list); dropping
  // keeps the first total_size. Either way position i of the padded list is list[i % n].
  if (options_.shuffle) {
    // Same generator, seeding and kernel as Python's torch.Generator().manual_seed(seed + epoch)
    // followed by torch.randperm(n, generator=g).
    auto gen = at::make_generator<at::CPUGeneratorImpl>(
        static_cast<std::uint64_t>(options_.seed) + static_cast<std::uint64_t>(epoch_));
    const at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
    const auto* p = perm.data_ptr<std::int64_t>();
    for (std::int64_t i = options_.rank; i < total; i += options_.worldSize) indices_.push_back(p[i % n]);
  } else {
    for (std::int64_t i = options_.rank; i < total; i += options_.worldSize) indices_.push_back(i % n);
  }
  indicesValid_ = true;
}

std::vector<std::int64_t> DistributedSampler::next(std::int64_t count) {
  if (count < 0)
    throw ConfigError("DistributedSampler::next: count must be >= 0, got " +
                                std::to_string(count));
  ensureIndices();
  const std::int64_t take = std::min(count, remaining());
  std::vector<std::int64_t> out(indices_.begin() + position_,
                                indices_.begin() + position_ + take);
  position_ += take;
  resumePending_ = false;
  return out;
}

void DistributedSampler::advance(std::int64_t count) {
  if (count < 0 || count > remaining())
    throw ConfigError("DistributedSampler::advance: count " + std::to_string(count) +
                                " is outside [0, " + std::to_string(remaining()) +
                                "] (indices left in epoch " + std::to_string(epoch_) + ")");
  position_ += count;
  resumePending_ = false;
}

SamplerState DistributedSampler::state() const {
  SamplerState s;
  s.epoch = epoch_;
  s.consumed = position_;
  s.worldSize = options_.worldSize;
  s.datasetSize = options_.datasetSize;
  s.seed = options_.seed;
  s.shuffle = options_.shuffle;
  s.dropLast = options_.dropLast;
  return s;
}

void DistributedSampler::loadState(const SamplerState& s) {
  if (s.epoch < 0 || s.consumed < 0)
    throw ConfigError("DistributedSampler::loadState: negative epoch (" +
                                std::to_string(s.epoch) + ") or consumed count (" +
                                std::to_string(s.consumed) + ")");
  if (s.worldSize < 1 || s.datasetSize < 0)
    throw ConfigError("DistributedSampler::loadState: invalid saved world size " +
                                std::to_string(s.worldSize) + " or dataset size " +
                                std::to_string(s.datasetSize));
  const std::int64_t savedSamples = samplesPerRank(s.datasetSize, s.worldSize, s.dropLast);
  if (s.consumed > savedSamples)
    throw ConfigError("DistributedSampler::loadState: consumed count " +
                                std::to_string(s.consumed) + " exceeds the " +
                                std::to_string(savedSamples) + " indices per rank of that epoch");

  const bool atBoundary = s.consumed == 0 || s.consumed == savedSamples;
  std::ostringstream diff;
  auto differs = [&](const char* what, const std::string& saved, const std::string& now) {
    diff << (diff.tellp() > 0 ? ", " : "") << what << " " << saved << " in the saved state, "
         << now << " now";
  };
  if (s.worldSize != options_.worldSize)
    differs("world size", std::to_string(s.worldSize), std::to_string(options_.worldSize));
  if (s.datasetSize != options_.datasetSize)
    differs("dataset size", std::to_string(s.datasetSize), std::to_string(options_.datasetSize));
  if (s.shuffle != options_.shuffle) differs("shuffle", boolName(s.shuffle), boolName(options_.shuffle));
  if (s.shuffle && options_.shuffle && s.seed != options_.seed)
    differs("seed", std::to_string(s.seed), std::to_string(options_.seed));
  if (s.dropLast != options_.dropLast)
    differs("drop_last", boolName(s.dropLast), boolName(options_.dropLast));

  const std::string differences = diff.str();
  if (!atBoundary && !differences.empty())
    throw SamplerResumeRefused(
        "cannot resume epoch " + std::to_string(s.epoch) + " mid-way (" +
        std::to_string(s.consumed) + " of " + std::to_string(savedSamples) +
        " indices per rank consumed): " + differences +
        "; the remaining indices would not match what each rank already saw. Resume with the "
        "saved configuration, or from a snapshot taken at an epoch boundary (where a change is "
        "fine).");

  if (s.epoch != epoch_) indicesValid_ = false;
  epoch_ = s.epoch;
  // A completed epoch stays completed under any configuration; mid-epoch the lists are equal.
  position_ = (s.consumed == savedSamples && savedSamples > 0) ? numSamples_ : s.consumed;
  if (s.consumed == 0) position_ = 0;
  resumePending_ = true;
}

} // namespace ctorch
