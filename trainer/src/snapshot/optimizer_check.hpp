// Private: an optimizer state judged where a snapshot is chosen (ResilientTraining's search).
#pragma once

#include "ctorch/snapshot.hpp"

#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace ctorch::detail {

// The problems of `state` (OPTIMIZER_STATE as saved, of optimizer type `typeName`) that are damage —
// an entry of another type than any writer gives it, in a state that is otherwise for `optimizer`;
// empty when it restores, and when it is for another optimizer or model (another type, number of
// groups or parameters, a tensor of another shape, an entry missing: another version or program
// wrote it), which restoreSnapshot refuses with SnapshotIncompatible. Restores nothing.
std::vector<std::string> optimizerStateDamage(torch::optim::Optimizer& optimizer, const std::string& typeName,
                                              const ItemDict& state);

}  // namespace ctorch::detail
