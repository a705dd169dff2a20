// ZeRO stage 1: the sorted-greedy partition of the parameters over the ranks, the local optimizer
// over this rank's share, and the broadcast of every share from its owner after each step.
#include "ctorch/zero_redundancy_optimizer.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/snapshot.hpp"
#include "core/exception_text.hpp"
#include "zero/optimizer_shard.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <map>
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

namespace detail {

std::vector<std::int64_t> flatShareNumels(const std::vector<at::Tensor>& parameters, const std::string& who) {
  std::vector<std::int64_t> numels;
  for (const auto& p : parameters) {
    if (!p.defined()) throw ConfigError(who + ": an undefined parameter");
    // A share travels as one flat buffer of one dtype on one device.
    if (p.scalar_type() != parameters.front().scalar_type() || p.device() != parameters.front().device())
      throw ConfigError(who + ": the parameters must share one dtype and device (found " +
                        std::string(c10::toString(parameters.front().scalar_type())) + " on " +
                        parameters.front().device().str() + " and " + c10::toString(p.scalar_type()) + " on " +
                        p.device().str() + ")");
    numels.push_back(p.numel());
  }
  return numels;
}

std::vector<std::vector<std::size_t>> sharesOf(const std::vector<int>& owners, int count) {
  std::vector<std::vector<std::size_t>> shares(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < owners.size(); ++i) shares[static_cast<std::size_t>(owners[i])].push_back(i);
  return shares;
}

} // namespace detail

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> parameters, OptimizerFactory makeOptimizer,
                                                 ZeroOptions options)
    : parameters_(std::move(parameters)),
      group_(options.processGroup() ? options.processGroup() : getDefaultGroup()) {
  if (!makeOptimizer) throw ConfigError("ZeroRedundancyOptimizer: no optimizer factory");
  if (parameters_.empty()) throw ConfigError("ZeroRedundancyOptimizer: no parameters");
  if (options.broadcastInPlaceBytes() < 0)
    throw ConfigError("ZeroRedundancyOptimizer: broadcastInPlaceBytes must be >= 0, got " +
                      std::to_string(options.broadcastInPlaceBytes()));
  inPlaceBytes_ = options.broadcastInPlaceBytes();
  followsDefaultGroup_ = !options.processGroup();
  const std::vector<std::int64_t> numels = detail::flatShareNumels(parameters_, "ZeroRedundancyOptimizer");
  rank_ = group_->getRank();
  owners_ = partitionParameters(numels, group_->getSize());
  shares_ = detail::sharesOf(owners_, group_->getSize());
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
  broadcastShares();
}

void ZeroRedundancyOptimizer::broadcastShares() {
  if (shares_.size() == 1) return;  // one rank: its parameters are the only copy
  if (!group_) throw DistributedError("ZeroRedundancyOptimizer: no process group (in-place recovery under way)");
  torch::NoGradGuard noGrad;
  if (packBuffers_.size() != shares_.size()) packBuffers_.resize(shares_.size());
  // Every broadcast is started before any is waited for (the process group runs them in order), then
  // the packed ones are unpacked.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::string> what;
  std::vector<std::size_t> unpackOwners;
  const auto start = [&](at::Tensor t, std::size_t owner, const std::string& description) {
    std::vector<at::Tensor> one{std::move(t)};
    c10d::BroadcastOptions from;
    from.rootRank = static_cast<std::int64_t>(owner);
    works.push_back(group_->broadcast(one, from));
    what.push_back(description);
  };
  try {
    for (std::size_t owner = 0; owner < shares_.size(); ++owner) {
      const auto& share = shares_[owner];
      if (share.empty()) continue;
      const bool mine = static_cast<int>(owner) == rank_;
      std::int64_t packedNumel = 0;
      for (std::size_t i : share) {
        const auto& p = parameters_[i];
        if (p.is_contiguous() && static_cast<std::int64_t>(p.nbytes()) >= inPlaceBytes_)
          start(p.detach(), owner, "rank " + std::to_string(owner) + "'s parameter " + std::to_string(i));
        else packedNumel += p.numel();
      }
      if (packedNumel == 0) continue;
      auto& buffer = packBuffers_[owner];
      const auto& first = parameters_[share.front()];
      if (!buffer.defined() || buffer.numel() != packedNumel || buffer.device() != first.device() ||
          buffer.scalar_type() != first.scalar_type())
        buffer = at::empty({packedNumel}, first.options().requires_grad(false));
      if (mine) {
        std::int64_t offset = 0;
        for (std::size_t i : share) {
          const auto& p = parameters_[i];
          if (p.is_contiguous() && static_cast<std::int64_t>(p.nbytes()) >= inPlaceBytes_) continue;
          buffer.narrow(0, offset, p.numel()).view(p.sizes()).copy_(p.detach());
          offset += p.numel();
        }
      } else {
        unpackOwners.push_back(owner);
      }
      start(buffer, owner, "rank " + std::to_string(owner) + "'s packed parameters");
    }
    for (std::size_t w = 0; w < works.size(); ++w) {
      try {
        works[w]->wait();
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        const std::string message = detail::messageOf(e);
        detail::throwDistributed("rank " + std::to_string(rank_) + ": ZeroRedundancyOptimizer's broadcast of " +
                                     what[w] + " failed: " + message,
                                 message);
      }
    }
  } catch (...) {
    // Nothing may still be writing into a parameter or a buffer once this returns.
    for (auto& w : works) {
      try {
        w->wait();
      } catch (...) {
      }
    }
    throw;
  }
  for (std::size_t owner : unpackOwners) {
    std::int64_t offset = 0;
    for (std::size_t i : shares_[owner]) {
      auto& p = parameters_[i];
      if (p.is_contiguous() && static_cast<std::int64_t>(p.nbytes()) >= inPlaceBytes_) continue;
      p.detach().copy_(packBuffers_[owner].narrow(0, offset, p.numel()).view(p.sizes()));
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

namespace detail {

// Global index of each of `local`'s parameters, in its param_groups' order.
static std::vector<std::int64_t> globalIndicesOf(const torch::optim::Optimizer& local,
                                               const std::vector<at::Tensor>& parameters, const std::string& who) {
  std::vector<std::int64_t> globals;
  for (const auto& group : local.param_groups())
    for (const auto& p : group.params()) {
      const auto it = std::find_if(parameters.begin(), parameters.end(),
                                   [&](const at::Tensor& q) { return q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl(); });
      if (it == parameters.end())
        throw ConfigError(who + ": the local optimizer holds a tensor that is not one of the parameters");
      globals.push_back(it - parameters.begin());
    }
  return globals;
}

ItemDict optimizerShard(const torch::optim::Optimizer* local, const std::vector<at::Tensor>& parameters,
                        int worldSize, int rank, const std::string& who) {
  ItemDict out = newItemDict();
  c10::impl::GenericDict states(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  std::string type;
  if (local) {
    const ItemDict captured = captureOptimizerState(*local, &type);
    const auto globals = globalIndicesOf(*local, parameters, who);
    for (const auto& e : captured.at("state").toGenericDict()) states.insert(globals.at(static_cast<std::size_t>(e.key().toInt())), e.value());
    for (const auto& g : captured.at("param_groups").toListRef()) {
      auto group = g.toGenericDict().copy();
      c10::impl::GenericList ids(c10::AnyType::get());
      for (const auto& id : group.at("params").toListRef()) ids.push_back(globals.at(static_cast<std::size_t>(id.toInt())));
      group.insert_or_assign("params", ids);
      groups.push_back(group);
    }
  }
  out.insert("state", states);
  out.insert("param_groups", groups);
  out.insert("optimizer_type", type);
  out.insert("world_size", static_cast<std::int64_t>(worldSize));
  out.insert("rank", static_cast<std::int64_t>(rank));
  return out;
}

void loadOptimizerShards(torch::optim::Optimizer* optimizer, const std::vector<at::Tensor>& parameters,
                         const std::vector<ItemDict>& shards, const std::string& who) {
  if (!optimizer) return;  // owns nothing: nothing to restore
  auto refuse = [&](const std::string& why) { throw ConfigError(who + ": cannot restore: " + why); };
  std::string type;
  (void)captureOptimizerState(*optimizer, &type);  // its type name, as the shards spell it
  // Every global index's state and the options of the group that held it, from whichever shard has it.
  std::map<std::int64_t, c10::IValue> stateOf;
  std::map<std::int64_t, c10::impl::GenericDict> groupOf;
  for (const auto& shard : shards) {
    for (const char* key : {"state", "param_groups", "optimizer_type"})
      if (!shard.contains(key)) refuse(std::string("a shard has no '") + key + "'");
    const auto& shardType = shard.at("optimizer_type");
    if (!shardType.isString()) refuse("a shard's optimizer_type is not a string");
    const std::string saved = shardType.toStringRef();
    if (!saved.empty() && saved != type) refuse("the shards hold " + saved + " state, the optimizer is " + type);
    for (const auto& e : shard.at("state").toGenericDict()) stateOf.insert_or_assign(e.key().toInt(), e.value());
    for (const auto& g : shard.at("param_groups").toListRef()) {
      const auto group = g.toGenericDict();
      for (const auto& id : group.at("params").toListRef()) groupOf.insert_or_assign(id.toInt(), group);
    }
  }
  // This rank's optimizer state as captureOptimizerState would give it, in the local order.
  const auto globals = globalIndicesOf(*optimizer, parameters, who);
  c10::impl::GenericDict states(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  std::int64_t local = 0;
  for (const auto& group : optimizer->param_groups()) {
    std::optional<c10::impl::GenericDict> options;
    c10::impl::GenericList ids(c10::AnyType::get());
    for (std::size_t i = 0; i < group.params().size(); ++i, ++local) {
      const std::int64_t global = globals.at(static_cast<std::size_t>(local));
      const auto held = groupOf.find(global);
      if (held == groupOf.end()) refuse("no shard holds parameter " + std::to_string(global));
      if (!options) options = held->second.copy();
      if (const auto st = stateOf.find(global); st != stateOf.end()) states.insert(local, st->second);
      ids.push_back(local);
    }
    if (!options) continue;
    options->insert_or_assign("params", ids);
    groups.push_back(*options);
  }
  ItemDict dict = newItemDict();
  dict.insert("state", states);
  dict.insert("param_groups", groups);
  const auto errors = restoreOptimizerState(*optimizer, type, dict);
  if (!errors.empty()) refuse(errors.front());
}

} // namespace detail

ItemDict ZeroRedundancyOptimizer::shardStateDict() const {
  return detail::optimizerShard(local_.get(), parameters_, static_cast<int>(shares_.size()), rank_,
                                "ZeroRedundancyOptimizer");
}

void ZeroRedundancyOptimizer::releaseGroup() { group_.reset(); }

void ZeroRedundancyOptimizer::rejoin(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  if (!group || group->getRank() != rank_ || group->getSize() != static_cast<int>(shares_.size()))
    throw ConfigError("ZeroRedundancyOptimizer::rejoin: the group is not the one its shares were cut for (rank " +
                      std::to_string(rank_) + " of " + std::to_string(shares_.size()) + ")");
  group_ = std::move(group);
}

void ZeroRedundancyOptimizer::loadShardStateDicts(const std::vector<ItemDict>& shards) {
  detail::loadOptimizerShards(local_.get(), parameters_, shards, "ZeroRedundancyOptimizer");
}

} // namespace ctorch
