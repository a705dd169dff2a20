// ZeRO stage 1: the sorted-greedy partition of the parameters over the ranks, the local optimizer
// over this rank's share, and the broadcast of every share from its owner after each step.
#include "ctorch/zero_redundancy_optimizer.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/snapshot.hpp"
#include "error_text.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <numeric>

namespace ctorch {

std::vector<int> partitionParameters(const std::vector<std::int64_t>& numels, int worldSize) {
  if (worldSize < 1) throw ConfigError("partitionParameters: world size must be >= 1, got " + std::to_string(worldSize));
  std::vector<std::size_t> order(numels.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return numels[a] > numels[b]; });
  std::vector<std::int64_t> load(static_cast<std::size_t>(worldSize), 0);
  std::vector<int> owners(numels.size(), 0);
  for (std::size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());  // the first (lowest rank) on a tie
    owners[i] = static_cast<int>(least - load.begin());
    *least += numels[i];
  }
  return owners;
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> parameters, OptimizerFactory makeOptimizer,
                                                 ZeroOptions options)
    : parameters_(std::move(parameters)),
      group_(options.processGroup() ? options.processGroup() : getDefaultGroup()) {
  if (!makeOptimizer) throw ConfigError("ZeroRedundancyOptimizer: no optimizer factory");
  if (parameters_.empty()) throw ConfigError("ZeroRedundancyOptimizer: no parameters");
  std::vector<std::int64_t> numels;
  for (const auto& p : parameters_) {
    if (!p.defined()) throw ConfigError("ZeroRedundancyOptimizer: an undefined parameter");
    numels.push_back(p.numel());
  }
  rank_ = group_->getRank();
  owners_ = partitionParameters(numels, group_->getSize());
  shares_.assign(static_cast<std::size_t>(group_->getSize()), {});
  for (std::size_t i = 0; i < owners_.size(); ++i) shares_[static_cast<std::size_t>(owners_[i])].push_back(i);
  std::vector<at::Tensor> mine;
  for (std::size_t i : shares_[static_cast<std::size_t>(rank_)]) mine.push_back(parameters_[i]);
  if (!mine.empty()) {
    local_ = makeOptimizer(mine);
    if (!local_) throw ConfigError("ZeroRedundancyOptimizer: the optimizer factory returned no optimizer");
  }
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::step() {
  if (local_) local_->step();
  torch::NoGradGuard noGrad;
  for (std::size_t owner = 0; owner < shares_.size(); ++owner) {
    const auto& share = shares_[owner];
    if (share.empty()) continue;
    // One flat buffer per share: a broadcast per rank, not per parameter.
    std::vector<at::Tensor> flat{[&] {
      std::vector<at::Tensor> views;
      for (std::size_t i : share) views.push_back(parameters_[i].detach().reshape({-1}));
      return torch::cat(views);
    }()};
    try {
      c10d::BroadcastOptions from;
      from.rootRank = static_cast<std::int64_t>(owner);
      group_->broadcast(flat, from)->wait();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      const std::string message = detail::messageOf(e);
      detail::throwDistributed("rank " + std::to_string(rank_) + ": ZeroRedundancyOptimizer's broadcast of rank " +
                                   std::to_string(owner) + "'s parameters failed: " + message,
                               message);
    }
    if (static_cast<int>(owner) == rank_) continue;
    std::int64_t offset = 0;
    for (std::size_t i : share) {
      auto& p = parameters_[i];
      p.detach().copy_(flat[0].narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

void ZeroRedundancyOptimizer::zeroGrad(bool setToNone) {
  for (auto& p : parameters_) {
    auto& g = p.mutable_grad();
    if (!g.defined()) continue;
    if (setToNone) {
      g.reset();
    } else {
      g.detach_();
      g.zero_();
    }
  }
}

std::size_t ZeroRedundancyOptimizer::localStateBytes() const {
  if (!local_) return 0;
  // Counted on the state as a snapshot captures it (every supported optimizer's tensors).
  std::size_t bytes = 0;
  std::function<void(const c10::IValue&)> add = [&](const c10::IValue& v) {
    if (v.isTensor()) bytes += v.toTensor().nbytes();
    else if (v.isGenericDict())
      for (const auto& e : v.toGenericDict()) add(e.value());
    else if (v.isList())
      for (const auto& e : v.toListRef()) add(e);
  };
  const ItemDict state = captureOptimizerState(*local_);
  if (state.contains("state")) add(state.at("state"));
  return bytes;
}

} // namespace ctorch
