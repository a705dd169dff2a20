// FullyShardedDataParallel's state dicts: the full one (gathered unit by unit), and the per-rank shards
// of the parameters and of the optimizer's state, laid out by the unpadded flat buffers so that any
// world size's shards load into any other's.
#include "fsdp/engine.hpp"
#include "snapshot/shard_pieces.hpp"

#include "ctorch/snapshot.hpp"

#include <unordered_map>

namespace ctorch::detail {
namespace {

// Where each flat buffer's shard stands among the optimizer's parameters (param_groups in order).
std::vector<std::int64_t> optimizerIndices(const FSDPCore::Impl& s, const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) params.push_back(p);
  std::vector<std::int64_t> indices;
  for (const auto& unit : s.units)
    for (const auto& flat : unit->flats) {
      std::int64_t index = -1;
      for (std::size_t k = 0; k < params.size(); ++k)
        if (params[k].is_same(flat.shard)) index = static_cast<std::int64_t>(k);
      if (index < 0 && flat.shard.requires_grad())
        throw ConfigError("FullyShardedDataParallel: the optimizer does not hold '" + flat.name +
                          "' (build it over the FullyShardedDataParallel's parameters())");
      indices.push_back(index);
    }
  return indices;
}

// This rank's elements of a flat buffer: [begin, end) of the unpadded buffer.
std::pair<std::int64_t, std::int64_t> ownRange(const FlatParameter& flat, int rank) {
  const std::int64_t begin = std::min<std::int64_t>(rank * flat.shardNumel, flat.numel);
  return {begin, std::min<std::int64_t>(begin + flat.shardNumel, flat.numel)};
}

// Fills `mine` (this rank's range [begin, end)) from the pieces the shards hold of one flat buffer;
// throws ConfigError naming what is missing.
void assemble(at::Tensor& mine, std::int64_t begin, std::int64_t end, const std::vector<std::pair<std::int64_t, at::Tensor>>& pieces,
              std::int64_t numel, const std::string& what, int rank) {
  // Pieces of one dtype (no silent cast) that never override each other's elements (shard_pieces.hpp);
  // they need not cover the whole buffer (a rank rejoining in place gets its own part only), only
  // this rank's range (below). Where the whole set is read (a resume's choice, consolidate) it must
  // tile the buffer exactly.
  if (auto problem = shardPiecesProblem(pieces, numel, what, /*replicas=*/true, /*partial=*/true))
    throw ConfigError("loadShardStateDicts: " + *problem);
  std::int64_t covered = 0;
  for (const auto& [pieceBegin, data] : pieces) {
    const std::int64_t from = std::max(begin, pieceBegin), to = std::min(end, pieceBegin + data.numel());
    if (from >= to) continue;
    mine.narrow(0, from - begin, to - from).copy_(data.narrow(0, from - pieceBegin, to - from));
    covered += to - from;
  }
  if (covered < end - begin)
    throw ConfigError("loadShardStateDicts: the shards do not cover rank " + std::to_string(rank) + "'s part of '" + what +
                      "' (elements " + std::to_string(begin) + " to " + std::to_string(end) + ")");
}

// The entry for one flat buffer in a shard dict's `section`, checked against the model's buffer.
c10::impl::GenericDict entryOf(const ItemDict& shard, const char* section, const FlatParameter& flat) {
  if (!shard.contains(section) || !shard.at(section).isGenericDict())
    throw ConfigError(std::string("loadShardStateDicts: a shard holds no ") + section);
  const auto entries = shard.at(section).toGenericDict();
  if (!entries.contains(flat.name))
    throw ConfigError("loadShardStateDicts: the shards do not hold '" + flat.name + "' (another model or wrap policy?)");
  const auto entry = entries.at(flat.name).toGenericDict();
  if (entry.at("numel").toInt() != flat.numel)
    throw ConfigError("loadShardStateDicts: '" + flat.name + "' holds " + std::to_string(entry.at("numel").toInt()) +
                      " elements in the shards, " + std::to_string(flat.numel) + " in the model");
  return entry;
}

std::int64_t replicaOf(const ItemDict& shard) { return shard.contains("replica") ? shard.at("replica").toInt() : 0; }

// With hybrid sharding every node's ranks wrote a full set of equal shards: the first node's are read
// (shards that do not say which replica they are were written without hybrid sharding: all of them).
std::vector<ItemDict> firstReplica(const std::vector<ItemDict>& shards) {
  std::vector<ItemDict> out;
  for (const auto& shard : shards)
    if (replicaOf(shard) == 0) out.push_back(shard);
  return out.empty() ? shards : out;
}

const ItemDict& rankZeroOf(const std::vector<ItemDict>& shards) {
  for (const auto& shard : shards)
    if (shard.contains("rank") && shard.at("rank").toInt() == 0 && replicaOf(shard) == 0) return shard;
  return shards.front();
}

}  // namespace

torch::OrderedDict<std::string, at::Tensor> FSDPCore::fullStateDict() {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  std::unordered_map<c10::TensorImpl*, at::Tensor> values;
  for (auto& unit : s.units) {
    // Mixed precision: the parameters are gathered in paramDtype; the state dict holds the master's
    // values, gathered from the shards apart.
    bool plain = false;
    for (const auto& flat : unit->flats) plain = plain || !flat.mixed();
    const bool was = unit->gathered;
    if (plain) s.ensureGathered(*unit);
    for (auto& flat : unit->flats) {
      if (flat.mixed()) {
        const auto whole = s.gatherMaster(flat);
        for (std::size_t i = 0; i < flat.params.size(); ++i)
          values[flat.params[i].unsafeGetTensorImpl()] =
              whole.narrow(0, flat.offsets[i], flat.params[i].numel()).view(flat.params[i].sizes()).clone();
      } else {
        for (auto& p : flat.params) values[p.unsafeGetTensorImpl()] = p.detach().clone();
      }
    }
    if (plain && !was) s.reshard(*unit);
  }
  torch::OrderedDict<std::string, at::Tensor> state;
  for (const auto& p : s.root->named_parameters()) state.insert(p.key(), values.at(p.value().unsafeGetTensorImpl()));
  for (const auto& b : s.root->named_buffers()) state.insert(b.key(), b.value().detach().clone());
  return state;
}

void FSDPCore::summonFullParameters(const std::function<void()>& fn) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  for (auto& unit : s.units) s.startGather(*unit);
  // Mixed precision: fn sees the master's values (the shards gathered as they are), in the master's
  // dtype; the parameters view the paramDtype buffers again before those are freed.
  bool mixed = false;
  auto restore = [&] {
    if (!mixed) return;
    for (auto& unit : s.units)
      for (auto& flat : unit->flats)
        if (flat.mixed()) Impl::pointParametersAt(flat, flat.full);
    s.relinkAccumulators();
  };
  try {
    for (auto& unit : s.units) s.ensureGathered(*unit);
    for (auto& unit : s.units)
      for (auto& flat : unit->flats)
        if (flat.mixed()) {
          const auto whole = s.gatherMaster(flat);
          mixed = true;
          Impl::pointParametersAt(flat, whole);
        }
    fn();
  } catch (...) {
    restore();
    for (auto& unit : s.units) s.reshard(*unit);
    throw;
  }
  restore();
  for (auto& unit : s.units) s.reshard(*unit);
}

void FSDPCore::loadFullStateDict(const torch::OrderedDict<std::string, at::Tensor>& state) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  std::unordered_map<c10::TensorImpl*, at::Tensor> byImpl;
  for (const auto& p : s.root->named_parameters()) {
    const auto* value = state.find(p.key());
    if (value == nullptr) throw ConfigError("loadFullStateDict: the state dict has no parameter '" + p.key() + "'");
    if (!value->sizes().equals(p.value().sizes()))
      throw ConfigError("loadFullStateDict: parameter '" + p.key() + "' has shape " + c10::str(value->sizes()) +
                        ", the model's is " + c10::str(p.value().sizes()));
    byImpl[p.value().unsafeGetTensorImpl()] = *value;
  }
  for (auto& b : s.root->named_buffers()) {
    const auto* value = state.find(b.key());
    if (value == nullptr) throw ConfigError("loadFullStateDict: the state dict has no buffer '" + b.key() + "'");
    b.value().copy_(*value);
  }
  for (auto& unit : s.units)
    for (auto& flat : unit->flats) {
      auto whole = at::zeros({flat.shardNumel * s.world}, flat.shard.options().requires_grad(false));
      for (std::size_t i = 0; i < flat.params.size(); ++i)
        whole.narrow(0, flat.offsets[i], flat.params[i].numel()).copy_(byImpl.at(flat.params[i].unsafeGetTensorImpl()).reshape({-1}));
      flat.shard.copy_(whole.narrow(0, s.rank * flat.shardNumel, flat.shardNumel));
      if (unit->gathered) flat.full.copy_(whole);
    }
}

ItemDict FSDPCore::shardStateDict() const {
  const auto& s = *impl_;
  ItemDict out = newItemDict();
  // Which parameter lies where in each flat buffer, so that the shards alone (offline, without the
  // model: ctorch-snapshot consolidate) give back the whole state dict; and the parameters' order.
  std::unordered_map<c10::TensorImpl*, std::string> names;
  c10::impl::GenericList order(c10::StringType::get());
  for (const auto& p : s.root->named_parameters()) {
    names[p.value().unsafeGetTensorImpl()] = p.key();
    order.push_back(p.key());
  }
  c10::impl::GenericDict flats(c10::StringType::get(), c10::AnyType::get());
  for (const auto& unit : s.units)
    for (const auto& flat : unit->flats) {
      const std::int64_t begin = std::min<std::int64_t>(s.rank * flat.shardNumel, flat.numel);
      const std::int64_t end = std::min<std::int64_t>(begin + flat.shardNumel, flat.numel);
      c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
      entry.insert("numel", flat.numel);
      entry.insert("begin", begin);
      entry.insert("data", flat.shard.detach().narrow(0, 0, end - begin).clone());
      c10::impl::GenericList layout(c10::AnyType::get());
      for (std::size_t i = 0; i < flat.params.size(); ++i) {
        c10::impl::GenericDict piece(c10::StringType::get(), c10::AnyType::get());
        const auto found = names.find(flat.params[i].unsafeGetTensorImpl());
        piece.insert("name", found == names.end() ? std::string() : found->second);
        piece.insert("offset", flat.offsets[i]);
        piece.insert("shape", flat.params[i].sizes().vec());
        layout.push_back(piece);
      }
      entry.insert("layout", layout);
      flats.insert(flat.name, entry);
    }
  out.insert("flat_parameters", flats);
  out.insert("parameter_order", order);
  c10::impl::GenericDict buffers(c10::StringType::get(), c10::AnyType::get());
  for (const auto& b : s.root->named_buffers()) buffers.insert(b.key(), b.value().detach().clone());
  out.insert("buffers", buffers);
  out.insert("world_size", static_cast<std::int64_t>(s.world));
  out.insert("rank", static_cast<std::int64_t>(s.rank));
  // Hybrid sharding: which node's set of shards this is (every node holds an equal one).
  out.insert("replica", static_cast<std::int64_t>(s.replicaRank));
  out.insert("replicas", static_cast<std::int64_t>(s.replicas));
  return out;
}

void FSDPCore::loadShardStateDicts(const std::vector<ItemDict>& allShards) {
  auto& s = *impl_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  torch::NoGradGuard noGrad;
  if (allShards.empty()) throw ConfigError("loadShardStateDicts: no shards given");
  const auto shards = firstReplica(allShards);
  std::vector<at::Tensor> assembled;  // everything checked before anything changes
  for (auto& unit : s.units)
    for (auto& flat : unit->flats) {
      const auto [begin, end] = ownRange(flat, s.rank);
      std::vector<std::pair<std::int64_t, at::Tensor>> pieces;
      for (const auto& shard : shards) {
        const auto entry = entryOf(shard, "flat_parameters", flat);
        pieces.emplace_back(entry.at("begin").toInt(), entry.at("data").toTensor());
      }
      auto mine = at::zeros({flat.shardNumel}, flat.shard.options().requires_grad(false));
      assemble(mine, begin, end, pieces, flat.numel, flat.name, s.rank);
      assembled.push_back(mine);
    }
  // Buffers are replicated; rank 0's are the ones the next forward broadcasts.
  const auto& first = rankZeroOf(shards);
  if (!first.contains("buffers")) throw ConfigError("loadShardStateDicts: a shard holds no buffers");
  const auto buffers = first.at("buffers").toGenericDict();
  for (auto& b : s.root->named_buffers())
    if (!buffers.contains(b.key())) throw ConfigError("loadShardStateDicts: the shards hold no buffer '" + b.key() + "'");
  std::size_t next = 0;
  for (auto& unit : s.units)
    for (auto& flat : unit->flats) flat.shard.copy_(assembled[next++]);
  for (auto& b : s.root->named_buffers()) b.value().copy_(buffers.at(b.key()).toTensor());
}

ItemDict FSDPCore::optimizerShardStateDict(const torch::optim::Optimizer& optimizer) const {
  const auto& s = *impl_;
  std::string type;
  const ItemDict whole = captureOptimizerState(optimizer, &type);
  const auto perParameter = whole.at("state").toGenericDict();
  const auto indices = optimizerIndices(s, optimizer);
  c10::impl::GenericDict flats(c10::StringType::get(), c10::AnyType::get());
  std::size_t i = 0;
  for (const auto& unit : s.units)
    for (const auto& flat : unit->flats) {
      const std::int64_t index = indices[i++];
      const auto [begin, end] = ownRange(flat, s.rank);
      c10::impl::GenericDict pieces(c10::StringType::get(), c10::AnyType::get());
      c10::impl::GenericDict scalars(c10::StringType::get(), c10::AnyType::get());
      const bool has = index >= 0 && perParameter.contains(index);
      if (has)
        for (const auto& item : perParameter.at(index).toGenericDict()) {
          const auto& key = item.key().toStringRef();
          const auto& value = item.value();
          // Per-element state (momentum, Adam's moments) is cut like the parameters; the rest
          // (Adam's step) is the same on every rank.
          if (value.isTensor() && key != "step" && value.toTensor().sizes().equals(flat.shard.sizes()))
            pieces.insert(key, value.toTensor().narrow(0, 0, end - begin).clone());
          else
            scalars.insert(key, value);
        }
      c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
      entry.insert("numel", flat.numel);
      entry.insert("begin", begin);
      entry.insert("index", index);  // the flat buffer's place among the optimizer's parameters (-1: none)
      entry.insert("has_state", has);
      entry.insert("pieces", pieces);
      entry.insert("scalars", scalars);
      flats.insert(flat.name, entry);
    }
  ItemDict out = newItemDict();
  out.insert("optimizer_type", type);
  out.insert("param_groups", whole.at("param_groups"));
  out.insert("flat_state", flats);
  out.insert("world_size", static_cast<std::int64_t>(s.world));
  out.insert("rank", static_cast<std::int64_t>(s.rank));
  out.insert("replica", static_cast<std::int64_t>(s.replicaRank));
  out.insert("replicas", static_cast<std::int64_t>(s.replicas));
  return out;
}

void FSDPCore::loadOptimizerShardStateDicts(torch::optim::Optimizer& optimizer, const std::vector<ItemDict>& allShards) {
  const auto& s = *impl_;
  torch::NoGradGuard noGrad;
  if (allShards.empty()) throw ConfigError("loadOptimizerShardStateDicts: no shards given");
  const auto shards = firstReplica(allShards);
  const auto& first = rankZeroOf(shards);
  if (!first.contains("optimizer_type") || !first.contains("param_groups"))
    throw ConfigError("loadOptimizerShardStateDicts: a shard holds no optimizer state");
  const auto indices = optimizerIndices(s, optimizer);
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  std::size_t i = 0;
  for (const auto& unit : s.units)
    for (const auto& flat : unit->flats) {
      const std::int64_t index = indices[i++];
      const auto entry = entryOf(first, "flat_state", flat);
      if (index < 0 || !entry.at("has_state").toBool()) continue;
      c10::impl::GenericDict own(c10::StringType::get(), c10::AnyType::get());
      for (const auto& item : entry.at("scalars").toGenericDict()) own.insert(item.key(), item.value());
      const auto [begin, end] = ownRange(flat, s.rank);
      for (const auto& item : entry.at("pieces").toGenericDict()) {
        const auto& key = item.key().toStringRef();
        std::vector<std::pair<std::int64_t, at::Tensor>> pieces;
        for (const auto& shard : shards) {
          const auto other = entryOf(shard, "flat_state", flat);
          const auto held = other.at("pieces").toGenericDict();
          if (held.contains(key)) pieces.emplace_back(other.at("begin").toInt(), held.at(key).toTensor());
        }
        // The saved dtype, on this run's device (a snapshot written on CUDA may resume on the CPU).
        auto mine = at::zeros({flat.shardNumel}, item.value().toTensor().options().device(flat.shard.device()));
        assemble(mine, begin, end, pieces, flat.numel, flat.name + " " + key, s.rank);
        own.insert(key, mine);
      }
      state.insert(index, own);
    }
  ItemDict whole = newItemDict();
  whole.insert("state", state);
  whole.insert("param_groups", first.at("param_groups"));
  const auto errors = restoreOptimizerState(optimizer, first.at("optimizer_type").toStringRef(), whole);
  if (!errors.empty()) throw ConfigError("loadOptimizerShardStateDicts: " + errors.front());
}

} // namespace ctorch::detail
