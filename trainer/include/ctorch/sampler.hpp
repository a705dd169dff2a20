// DistributedSampler: which dataset indices each rank visits in an epoch, index for index the same
// as Python's torch.utils.data.DistributedSampler, plus a position within the epoch so a job that
// was stopped mid-epoch resumes exactly where it was. No LibTorch in this header.
#pragma once

#include "ctorch/errors.hpp"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch {

struct DistributedSamplerOptions {
  std::int64_t datasetSize = 0;  // len(dataset)
  std::int64_t worldSize = 1;    // num_replicas
  std::int64_t rank = 0;
  bool shuffle = true;
  std::int64_t seed = 0;         // the permutation of epoch e uses seed + e
  bool dropLast = false;

  // Throws std::invalid_argument naming the bad value (negative size, rank outside the world...).
  void validate() const;
};

// Progress of a sampler, written into snapshots. Rank-independent: every rank of a data-parallel
// job consumes the same number of indices per step, so rank 0's state restores every rank.
struct SamplerState {
  std::int64_t epoch = 0;
  std::int64_t consumed = 0;     // indices of this epoch already handed out, per rank
  // The configuration that determines the index lists; a mid-epoch resume requires it unchanged.
  std::int64_t worldSize = 1;
  std::int64_t datasetSize = 0;
  std::int64_t seed = 0;
  bool shuffle = true;
  bool dropLast = false;

  bool operator==(const SamplerState& other) const;
  bool operator!=(const SamplerState& other) const { return !(*this == other); }
};

// Restoring a state whose epoch is partly consumed under a configuration that would produce
// different index lists (another world size, dataset size, seed, shuffle or drop_last).
class SamplerResumeRefused : public Error {
 public:
  using Error::Error;
};

class DistributedSampler {
 public:
  explicit DistributedSampler(const DistributedSamplerOptions& options);

  // Starts epoch `epoch` from its first index, as Python's set_epoch does, with one exception that
  // keeps resume code simple: right after loadState() restored a partly consumed epoch E,
  // setEpoch(E) keeps the restored position (any other epoch starts from the beginning).
  void setEpoch(std::int64_t epoch);
  std::int64_t epoch() const { return epoch_; }

  // Indices per rank per epoch (Python's len(sampler), num_samples) and for all ranks (total_size).
  std::int64_t size() const { return numSamples_; }
  std::int64_t totalSize() const { return numSamples_ * options_.worldSize; }

  // This rank's indices for the current epoch: exactly list(iter(python_sampler)).
  const std::vector<std::int64_t>& indices() const;

  // Position within the epoch: how many of indices() were handed out already.
  std::int64_t position() const { return position_; }
  std::int64_t remaining() const { return numSamples_ - position_; }
  bool exhausted() const { return position_ >= numSamples_; }
  // The next min(count, remaining()) indices, advancing the position past them.
  std::vector<std::int64_t> next(std::int64_t count);
  // Marks `count` more indices as consumed (for loops that index indices() themselves).
  void advance(std::int64_t count);

  SamplerState state() const;
  // Restores epoch and position. At an epoch boundary (nothing or everything of the epoch
  // consumed) any configuration is accepted and only the epoch is taken over; mid-epoch the index
  // lists must be the same, else SamplerResumeRefused says which setting differs.
  void loadState(const SamplerState& state);

  const DistributedSamplerOptions& options() const { return options_; }

 private:
  void ensureIndices() const;

  DistributedSamplerOptions options_;
  std::int64_t numSamples_ = 0;
  std::int64_t epoch_ = 0;
  std::int64_t position_ = 0;
  bool resumePending_ = false;
  mutable bool indicesValid_ = false;
  mutable std::vector<std::int64_t> indices_;
};

} // namespace ctorch
