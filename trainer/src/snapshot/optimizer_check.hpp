// Private: an optimizer state judged where a snapshot is chosen (ResilientTraining's search).
#pragma once

#include "ctorch/snapshot.hpp"

#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace ctorch::detail {

// The problems of `state` (OPTIMIZER_STATE as saved, of optimizer type `typeName`) that are damage —
// an entry missing or of another type in a state that is otherwise for `optimizer` (the same type,
// groups and parameters per group); empty when it restores, and when it is for another optimizer
// (an incompatibility, which restoreSnapshot refuses with SnapshotIncompatible). Restores nothing.
std::vector<std::string> optimizerStateDamage(torch::optim::Optimizer& optimizer, const std::string& typeName,
                                              const ItemDict& state);

}  // namespace ctorch::detail
