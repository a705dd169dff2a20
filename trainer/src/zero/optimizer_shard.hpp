// Private: one rank's shard of a sharded optimizer's state (ZeroRedundancyOptimizer, ParameterServer)
// in Python's state_dict layout with the parameters' GLOBAL indices, and its restore from shards.
#pragma once

#include "ctorch/snapshot.hpp"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ctorch::detail {

// The element counts of `parameters`, checked for what a share's one flat buffer needs (defined, one
// dtype, one device): ConfigError "<who>: ..." naming the first that is not.
std::vector<std::int64_t> flatShareNumels(const std::vector<at::Tensor>& parameters, const std::string& who);
// Per owner (0 .. owners-1): the indices of the parameters `owners` (as partitionParameters) gives it.
std::vector<std::vector<std::size_t>> sharesOf(const std::vector<int>& owners, int count);

// {"state": {global index: {...}}, "param_groups": [{..., "params": [global index, ...]}],
// "optimizer_type": "Adam", "world_size": N, "rank": r}; `local` (null: owns nothing) steps a subset
// of `parameters`. `who` names the owner in errors.
ItemDict optimizerShard(const torch::optim::Optimizer* local, const std::vector<at::Tensor>& parameters,
                        int worldSize, int rank, const std::string& who);
// Restores `optimizer` (null: nothing to restore) from the states of its parameters in whichever of
// `shards` holds them. ConfigError "<who>: cannot restore: ..." naming what does not fit.
void loadOptimizerShards(torch::optim::Optimizer* optimizer, const std::vector<at::Tensor>& parameters,
                         const std::vector<ItemDict>& shards, const std::string& who);

} // namespace ctorch::detail
