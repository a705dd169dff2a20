// What a snapshot holds of an optimizer, in Python's state_dict() layout, below the public capture and
// restore calls (ctorch/snapshot.hpp): the plan a restore checks before it changes anything, shared by
// the whole-snapshot restore (capture_restore.cpp) and the optimizer's own (optimizer_state.cpp). Internal.
#pragma once

#include "ctorch/state_dict.hpp"

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ctorch::detail {

// A copy of `t` on the CPU, contiguous, for a snapshot (from the capture pool when one is set).
at::Tensor portableCopy(const at::Tensor& t);
// "[2, 3]".
std::string shapeText(at::IntArrayRef sizes);

// "SGD", "Adam", "AdamW", "RMSprop", "Adagrad"; empty for any other optimizer.
std::string optimizerTypeName(const torch::optim::Optimizer& o);

// A prepared change to one parameter group; applied only when every group checked out.
struct GroupPlan {
  std::function<void(torch::optim::OptimizerOptions&)> setOptions;
  std::vector<std::pair<at::Tensor, std::unique_ptr<torch::optim::OptimizerParamState>>> states;
};

// Checks `state` (of an optimizer of type `typeName`) against `optimizer`: each problem appended to
// `errors`, the plan returned; `fits` (optional) is cleared when the state belongs to another
// optimizer or shape, not merely damaged (optimizerStateDamage).
std::vector<GroupPlan> planOptimizerRestore(torch::optim::Optimizer& optimizer, const std::string& typeName,
                                            const ItemDict& state, std::vector<std::string>& errors,
                                            bool* fits = nullptr);
void applyOptimizerRestore(torch::optim::Optimizer& optimizer, std::vector<GroupPlan>& plans);

} // namespace ctorch::detail
