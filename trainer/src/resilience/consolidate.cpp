// A sharded snapshot's whole state in one snapshot (sharded_snapshot.hpp): the shards found as a
// resume finds them (shard_files.cpp), ZeRO's optimizer shards merged by their global parameter
// indices, FSDP's flat buffers gathered from every rank's piece and cut back into parameters by the
// layout each shard records.
#include "ctorch/sharded_snapshot.hpp"

#include "core/exception_text.hpp"
#include "snapshot/shard_pieces.hpp"
#include "resilience/shard_files.hpp"
#include "resilience/tracked_state.hpp"
#include "snapshot/generic_dict.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <sstream>

namespace ctorch {

std::vector<SnapshotShard> findSnapshotShards(const Snapshot& snapshot) {
  std::vector<SnapshotShard> out;
  if (shardingOf(snapshot) == SnapshotSharding::kNone) return out;
  const int world = detail::shardWorld(snapshot);
  const auto slots = detail::slotsOf(snapshot.source);
  for (int rank = 0; rank < world; ++rank) {
    auto found = detail::lookForShard(snapshot, world, rank, slots, {});
    SnapshotShard shard;
    shard.rank = rank;
    shard.file = found.file;
    shard.usable = found.found.has_value();
    if (!shard.usable) shard.problem = found.why;
    out.push_back(std::move(shard));
  }
  return out;
}

namespace {

using detail::kShardedModelKey;
using detail::kZeroShardsKey;

[[noreturn]] void bad(const Snapshot& snapshot, const std::string& what) {
  throw SnapshotCorrupt(snapshot.source, SnapshotCorrupt::Kind::BadContent, "its shards: " + what);
}

c10::impl::GenericDict dictAt(const Snapshot& snapshot, const c10::impl::GenericDict& d, const std::string& key) {
  if (!d.contains(key) || !d.at(key).isGenericDict()) bad(snapshot, "no dict '" + key + "'");
  return d.at(key).toGenericDict();
}

// Two option values alike (exactly: a learning rate differing in its last bit is another group).
bool same(const c10::IValue& a, const c10::IValue& b) {
  if (a.isDouble() && b.isDouble()) return a.toDouble() == b.toDouble();
  if (a.isInt() && b.isInt()) return a.toInt() == b.toInt();
  if (a.isBool() && b.isBool()) return a.toBool() == b.toBool();
  if (a.isString() && b.isString()) return a.toStringRef() == b.toStringRef();
  if (a.isNone() && b.isNone()) return true;
  if ((a.isTuple() || a.isList()) && (b.isTuple() || b.isList())) {
    const auto x = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto y = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (x.size() != y.size()) return false;
    for (std::size_t i = 0; i < x.size(); ++i)
      if (!same(x[i], y[i])) return false;
    return true;
  }
  std::ostringstream x, y;
  x << a;
  y << b;
  return a.tagKind() == b.tagKind() && x.str() == y.str();
}

bool sameOptions(const c10::impl::GenericDict& a, const c10::impl::GenericDict& b) {
  std::size_t count = 0;
  for (const auto& e : a) {
    if (e.key().toStringRef() == "params") continue;
    ++count;
    if (!b.contains(e.key()) || !same(e.value(), b.at(e.key()))) return false;
  }
  for (const auto& e : b)
    if (e.key().toStringRef() != "params") --count;
  return count == 0;
}

// Param groups whose "params" are global indices, from every shard, merged by their options: one
// group per distinct set of options, its indices in order.
c10::impl::GenericList mergeGroups(const Snapshot& snapshot, const std::vector<c10::impl::GenericDict>& groups) {
  std::vector<c10::impl::GenericDict> merged;
  std::vector<std::vector<std::int64_t>> indices;
  for (const auto& group : groups) {
    if (!group.contains("params") || !group.at("params").isList()) bad(snapshot, "a param group without params");
    std::size_t k = 0;
    while (k < merged.size() && !sameOptions(merged[k], group)) ++k;
    if (k == merged.size()) {
      merged.push_back(group.copy());
      indices.emplace_back();
    }
    for (const auto& id : group.at("params").toListRef()) {
      if (!id.isInt()) bad(snapshot, "a parameter index that is not an int");
      indices[k].push_back(id.toInt());
    }
  }
  c10::impl::GenericList out(c10::AnyType::get());
  for (std::size_t k = 0; k < merged.size(); ++k) {
    std::sort(indices[k].begin(), indices[k].end());
    if (std::adjacent_find(indices[k].begin(), indices[k].end()) != indices[k].end())
      bad(snapshot, "two shards hold the same parameter");
    c10::impl::GenericList ids(c10::AnyType::get());
    for (const auto id : indices[k]) ids.push_back(id);
    merged[k].insert_or_assign("params", ids);
    out.push_back(merged[k]);
  }
  return out;
}

// ZeRO-1 / parameter server: the model is whole in the snapshot; the shards' optimizer states,
// keyed by global parameter index, are merged.
void consolidateOptimizer(Snapshot& whole, const std::vector<ItemDict>& shards) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  std::vector<c10::impl::GenericDict> groups;
  std::string type;
  for (const auto& shard : shards) {
    const auto& t = shard.at("optimizer_type");
    if (!t.isString()) bad(whole, "optimizer_type is not a string");
    if (!t.toStringRef().empty()) {
      if (!type.empty() && type != t.toStringRef()) bad(whole, "shards of two optimizers (" + type + ", " + t.toStringRef() + ")");
      type = t.toStringRef();
    }
    if (!shard.at("state").isGenericDict() || !shard.at("param_groups").isList()) bad(whole, "a shard's optimizer state is not a dict");
    for (const auto& e : shard.at("state").toGenericDict()) {
      if (!e.key().isInt()) bad(whole, "a state entry not keyed by a parameter index");
      if (state.contains(e.key())) bad(whole, "two shards hold parameter " + std::to_string(e.key().toInt()) + "'s state");
      state.insert(e.key(), e.value());
    }
    for (const auto& g : shard.at("param_groups").toListRef()) {
      if (!g.isGenericDict()) bad(whole, "a param group is not a dict");
      groups.push_back(g.toGenericDict());
    }
  }
  whole.optimizerType = type;
  whole.optimizerState = newItemDict();
  if (type.empty()) return;  // saved without an optimizer
  whole.optimizerState.insert("state", state);
  whole.optimizerState.insert("param_groups", mergeGroups(whole, groups));
}

// Pipeline stages: one shard of each stage (its replicas hold the same), the stages' parameters and
// buffers side by side (they carry the model's names: "5.weight"), and their optimizer states merged
// as ZeRO's are once each stage's indices are offset by the parameters of the stages before it.
void consolidatePipeline(Snapshot& whole, const std::vector<ItemDict>& shards) {
  const auto& saved = whole.userState.at(detail::kPipelineStageKey);
  if (!saved.isInt() || saved.toInt() < 1 || saved.toInt() > static_cast<std::int64_t>(shards.size()))
    bad(whole, "a number of stages that is not between 1 and the number of shards");
  const auto stages = static_cast<std::size_t>(saved.toInt());
  std::vector<const ItemDict*> byStage(stages, nullptr);
  std::vector<detail::PipelineStageLayout> layouts(stages);
  for (const auto& shard : shards) {
    auto layout = detail::pipelineShardLayout(whole, shard);
    if (static_cast<std::size_t>(layout.stages) != stages) bad(whole, "a shard of a pipeline of another length");
    const auto k = static_cast<std::size_t>(layout.stage);
    if (!byStage[k]) {
      byStage[k] = &shard;
      layouts[k] = std::move(layout);
    }
  }
  whole.modelState = c10::Dict<std::string, at::Tensor>();
  std::vector<ItemDict> offset;
  std::int64_t before = 0;
  for (std::size_t k = 0; k < stages; ++k) {
    if (!byStage[k]) bad(whole, "no shard holds stage " + std::to_string(k));
    const ItemDict& shard = *byStage[k];
    for (const auto& e : shard.at(detail::kPipelineModelKey).toGenericDict()) {
      if (!e.key().isString() || !e.value().isTensor()) bad(whole, "a parameter that is not a named tensor");
      if (whole.modelState.contains(e.key().toStringRef())) bad(whole, "two stages hold '" + e.key().toStringRef() + "'");
      whole.modelState.insert(e.key().toStringRef(), e.value().toTensor());
    }
    ItemDict moved = newItemDict();
    moved.insert("optimizer_type", shard.at("optimizer_type"));
    c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
    if (!shard.at("state").isGenericDict() || !shard.at("param_groups").isList()) bad(whole, "a shard's optimizer state is not a dict");
    for (const auto& e : shard.at("state").toGenericDict()) {
      if (!e.key().isInt() || e.key().toInt() < 0 || e.key().toInt() >= layouts[k].parameters)
        bad(whole, "stage " + std::to_string(k) + "'s optimizer state names a parameter it does not hold");
      state.insert(e.key().toInt() + before, e.value());
    }
    c10::impl::GenericList groups(c10::AnyType::get());
    for (const auto& g : shard.at("param_groups").toListRef()) {
      if (!g.isGenericDict()) bad(whole, "a param group is not a dict");
      auto group = g.toGenericDict().copy();
      if (!group.contains("params") || !group.at("params").isList()) bad(whole, "a param group without params");
      c10::impl::GenericList ids(c10::AnyType::get());
      for (const auto& id : group.at("params").toListRef()) {
        if (!id.isInt() || id.toInt() < 0 || id.toInt() >= layouts[k].parameters)
          bad(whole, "stage " + std::to_string(k) + "'s param group names a parameter it does not hold");
        ids.push_back(id.toInt() + before);
      }
      group.insert_or_assign("params", ids);
      groups.push_back(group);
    }
    moved.insert("state", state);
    moved.insert("param_groups", groups);
    offset.push_back(std::move(moved));
    before += layouts[k].parameters;
  }
  consolidateOptimizer(whole, offset);
}

// One flat buffer whole ([numel]) from the pieces every shard holds of it (each from "begin"): only
// when they tile it exactly once in one dtype (shard_pieces.hpp; a hybrid run's replicas hold the same).
at::Tensor gather(const Snapshot& snapshot, const std::vector<std::pair<std::int64_t, at::Tensor>>& pieces, std::int64_t numel,
                  const std::string& what) {
  // Checked before anything is allocated: a crafted size cannot make this allocate more than the pieces hold.
  if (auto problem = detail::shardPiecesProblem(pieces, numel, what, /*replicas=*/true)) bad(snapshot, *problem);
  at::Tensor whole = at::zeros({numel}, pieces.front().second.options());
  for (const auto& [begin, data] : pieces) whole.narrow(0, begin, data.numel()).copy_(data.reshape({-1}));
  return whole;
}

struct Piece {
  std::string name;
  std::int64_t offset = 0;
  std::vector<std::int64_t> shape;
  // -1 when the product would pass `limit` (a crafted shape).
  std::int64_t numel(std::int64_t limit) const {
    std::int64_t n = 1;
    for (const auto d : shape) {
      if (d != 0 && n > limit / d) return -1;
      n *= d;
    }
    return n;
  }
  std::int64_t numel() const { return numel(std::numeric_limits<std::int64_t>::max()); }
};

std::vector<Piece> layoutOf(const Snapshot& snapshot, const c10::impl::GenericDict& entry, const std::string& flat,
                            std::int64_t numel) {
  if (!entry.contains("layout"))
    throw SnapshotIncompatible(snapshot.source, {"its FSDP shards were written before they recorded which parameter lies "
                                                 "where (ctorch before issue 42): resume it with the same --sharding fsdp "
                                                 "and let it save once more"});
  std::vector<Piece> pieces;
  for (const auto& p : entry.at("layout").toListRef()) {
    const auto d = p.toGenericDict();
    Piece piece;
    piece.name = d.at("name").toStringRef();
    piece.offset = d.at("offset").toInt();
    for (const auto& dim : d.at("shape").toListRef()) {
      if (!dim.isInt() || dim.toInt() < 0 || dim.toInt() > numel) bad(snapshot, "'" + flat + "''s layout gives a parameter a dimension outside 0.." + std::to_string(numel));
      piece.shape.push_back(dim.toInt());
    }
    if (piece.name.empty() || piece.offset < 0 || piece.offset > numel || piece.numel(numel) < 0 ||
        piece.numel(numel) > numel - piece.offset)
      bad(snapshot, "'" + flat + "''s layout places '" + piece.name + "' outside its " + std::to_string(numel) + " elements");
    pieces.push_back(std::move(piece));
  }
  // The parameters tile the buffer exactly, as FSDP lays them (one after another): no element in two
  // parameters — each piece is copied out, so pieces laid over each other (400 parameters over one
  // 1 MiB buffer) would make the output hundreds of times the shards' size, and a bias laid at its
  // weight's offset would be read from the weight's elements — and none in no parameter.
  std::vector<const Piece*> byOffset;
  std::set<std::string> names;
  for (const auto& piece : pieces) {
    if (!names.insert(piece.name).second) bad(snapshot, "'" + flat + "''s layout lays '" + piece.name + "' twice");
    if (piece.numel() > 0) byOffset.push_back(&piece);
  }
  std::stable_sort(byOffset.begin(), byOffset.end(), [](const Piece* a, const Piece* b) { return a->offset < b->offset; });
  std::int64_t end = 0;
  const Piece* before = nullptr;
  for (const Piece* piece : byOffset) {
    if (before && piece->offset < end)
      bad(snapshot, "'" + flat + "''s layout lays '" + piece->name + "' (from element " + std::to_string(piece->offset) +
                        ") over '" + before->name + "' (elements " + std::to_string(before->offset) + " to " +
                        std::to_string(end - 1) + "): parameters share no elements");
    if (piece->offset > end)
      bad(snapshot, "'" + flat + "''s layout leaves elements " + std::to_string(end) + " to " + std::to_string(piece->offset - 1) +
                        " to no parameter");
    end = piece->offset + piece->numel();
    before = piece;
  }
  if (end < numel)
    bad(snapshot, "'" + flat + "''s layout leaves elements " + std::to_string(end) + " to " + std::to_string(numel - 1) +
                      " to no parameter");
  return pieces;
}

// FSDP: every flat buffer gathered from the ranks' pieces and cut into its parameters; the optimizer's
// per-element state the same way, keyed by the parameters' places in the model's order.
void consolidateFullyShardedModel(Snapshot& whole, const std::vector<ItemDict>& shards) {
  std::vector<c10::impl::GenericDict> models, optimizers;
  for (const auto& shard : shards) {
    if (!shard.contains(kShardedModelKey) || !shard.at(kShardedModelKey).isGenericDict())
      bad(whole, "a shard without its parameters");
    models.push_back(shard.at(kShardedModelKey).toGenericDict());
    if (shard.contains("fsdp_optimizer")) {
      if (!shard.at("fsdp_optimizer").isGenericDict()) bad(whole, "a shard's optimizer state is not a dict");
      optimizers.push_back(shard.at("fsdp_optimizer").toGenericDict());
    }
  }
  const auto& first = models.front();
  if (!first.contains("parameter_order")) (void)layoutOf(whole, newStringDict(), "", 0);  // refused: written before layouts
  std::map<std::string, std::int64_t> place;
  std::vector<std::string> order;
  for (const auto& name : first.at("parameter_order").toListRef()) {
    place.emplace(name.toStringRef(), static_cast<std::int64_t>(order.size()));
    order.push_back(name.toStringRef());
  }
  std::map<std::string, at::Tensor> parameters;
  std::map<std::string, std::vector<Piece>> layouts;  // by flat buffer
  const auto flats = dictAt(whole, first, "flat_parameters");
  for (const auto& flat : flats) {
    const std::string name = flat.key().toStringRef();
    const auto entry = flat.value().toGenericDict();
    const std::int64_t numel = entry.at("numel").toInt();
    std::vector<std::pair<std::int64_t, at::Tensor>> pieces;
    for (const auto& model : models) {
      const auto theirs = dictAt(whole, dictAt(whole, model, "flat_parameters"), name);
      if (theirs.at("numel").toInt() != numel) bad(whole, "the shards disagree on the size of '" + name + "'");
      pieces.emplace_back(theirs.at("begin").toInt(), theirs.at("data").toTensor());
    }
    const at::Tensor data = gather(whole, pieces, numel, name);
    layouts[name] = layoutOf(whole, entry, name, numel);
    for (const auto& piece : layouts[name]) {
      if (!place.count(piece.name)) bad(whole, "'" + piece.name + "' is in a layout but not among the parameters");
      if (parameters.count(piece.name)) bad(whole, "'" + piece.name + "' is laid in two flat buffers");
      parameters[piece.name] = data.narrow(0, piece.offset, piece.numel()).view(piece.shape).clone();
    }
  }
  whole.modelState = c10::Dict<std::string, at::Tensor>();
  for (const auto& name : order) {
    const auto it = parameters.find(name);
    if (it == parameters.end()) bad(whole, "no flat buffer holds parameter '" + name + "'");
    whole.modelState.insert(name, it->second);
  }
  for (const auto& buffer : dictAt(whole, first, "buffers")) whole.modelState.insert(buffer.key().toStringRef(), buffer.value().toTensor());

  whole.optimizerType.clear();
  whole.optimizerState = newItemDict();
  if (optimizers.empty()) return;  // saved without an optimizer
  if (optimizers.size() != models.size()) bad(whole, "some shards hold optimizer state, others none");
  const auto& own = optimizers.front();
  whole.optimizerType = own.at("optimizer_type").toStringRef();
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  std::map<std::int64_t, std::vector<std::int64_t>> paramsOfIndex;  // the optimizer's flat parameter -> the model's
  for (const auto& flat : dictAt(whole, own, "flat_state")) {
    const std::string name = flat.key().toStringRef();
    const auto entry = flat.value().toGenericDict();
    if (!entry.contains("index")) (void)layoutOf(whole, newStringDict(), name, 0);  // refused: written before layouts
    const std::int64_t index = entry.at("index").toInt();
    if (!layouts.count(name)) bad(whole, "optimizer state for '" + name + "', which holds no parameters");
    const auto& layout = layouts[name];
    if (index >= 0)
      for (const auto& piece : layout) paramsOfIndex[index].push_back(place.at(piece.name));
    if (index < 0 || !entry.at("has_state").toBool()) continue;
    const std::int64_t numel = entry.at("numel").toInt();
    std::map<std::string, at::Tensor> gathered;
    for (const auto& key : entry.at("pieces").toGenericDict()) {
      std::vector<std::pair<std::int64_t, at::Tensor>> pieces;
      for (const auto& optimizer : optimizers) {
        const auto theirs = dictAt(whole, dictAt(whole, optimizer, "flat_state"), name);
        const auto held = theirs.at("pieces").toGenericDict();
        if (held.contains(key.key())) pieces.emplace_back(theirs.at("begin").toInt(), held.at(key.key()).toTensor());
      }
      gathered[key.key().toStringRef()] = gather(whole, pieces, numel, name + " " + key.key().toStringRef());
    }
    for (const auto& piece : layout) {
      auto perParameter = newStringDict();
      for (const auto& scalar : entry.at("scalars").toGenericDict()) perParameter.insert(scalar.key(), scalar.value());
      for (const auto& [key, data] : gathered)
        perParameter.insert(key, data.narrow(0, piece.offset, piece.numel()).view(piece.shape).clone());
      state.insert(place.at(piece.name), perParameter);
    }
  }
  std::vector<c10::impl::GenericDict> groups;
  for (const auto& g : own.at("param_groups").toListRef()) {
    auto group = g.toGenericDict().copy();
    c10::impl::GenericList ids(c10::AnyType::get());
    for (const auto& id : group.at("params").toListRef())
      for (const auto param : paramsOfIndex[id.toInt()]) ids.push_back(param);
    group.insert_or_assign("params", ids);
    groups.push_back(group);
  }
  whole.optimizerState.insert("state", state);
  whole.optimizerState.insert("param_groups", mergeGroups(whole, groups));
}

// The layouts a sharded snapshot's shards come in, each named by the USER_STATE entry its writer
// (a Stateful's saveEntries()) leaves in the snapshot, and how its shards become one whole state.
// The first whose entry the snapshot holds is its layout; the last (no entry) is any other sharded
// snapshot's: an optimizer's state sharded over the ranks.
struct ShardLayout {
  SnapshotSharding kind;
  const char* entry;
  const char* description;
  void (*consolidate)(Snapshot& whole, const std::vector<ItemDict>& shards);
};

constexpr ShardLayout kShardLayouts[] = {
    {SnapshotSharding::kPipelineStages, detail::kPipelineStageKey, "model and optimizer by pipeline stage", consolidatePipeline},
    {SnapshotSharding::kFullyShardedModel, kShardedModelKey, "model and optimizer (FSDP)", consolidateFullyShardedModel},
    {SnapshotSharding::kOptimizer, nullptr, "optimizer (ZeRO-1 or parameter server)", consolidateOptimizer},
};

const ShardLayout* layoutOf(const Snapshot& snapshot) {
  if (!snapshot.userState.contains(kZeroShardsKey)) return nullptr;
  for (const ShardLayout& layout : kShardLayouts)
    if (!layout.entry || snapshot.userState.contains(layout.entry)) return &layout;
  return nullptr;
}

}  // namespace

const char* toString(SnapshotSharding sharding) {
  if (sharding == SnapshotSharding::kNone) return "none";
  for (const ShardLayout& layout : kShardLayouts)
    if (layout.kind == sharding) return layout.description;
  return "?";
}

SnapshotSharding shardingOf(const Snapshot& snapshot) {
  const ShardLayout* layout = layoutOf(snapshot);
  return layout ? layout->kind : SnapshotSharding::kNone;
}

namespace detail {

void checkFullyShardedPieces(const Snapshot& snapshot, const std::vector<ItemDict>& shards) {
  try {
    std::vector<c10::impl::GenericDict> models, optimizers;
    for (const auto& shard : shards) {
      if (!shard.contains(kShardedModelKey) || !shard.at(kShardedModelKey).isGenericDict()) return;  // not FSDP's
      models.push_back(shard.at(kShardedModelKey).toGenericDict());
      if (shard.contains("fsdp_optimizer") && shard.at("fsdp_optimizer").isGenericDict())
        optimizers.push_back(shard.at("fsdp_optimizer").toGenericDict());
    }
    if (models.empty()) return;
    for (const auto& flat : dictAt(snapshot, models.front(), "flat_parameters")) {
      const std::string name = flat.key().toStringRef();
      const std::int64_t numel = flat.value().toGenericDict().at("numel").toInt();
      ShardPieces pieces;
      for (const auto& model : models) {
        const auto theirs = dictAt(snapshot, dictAt(snapshot, model, "flat_parameters"), name);
        pieces.emplace_back(theirs.at("begin").toInt(), theirs.at("data").toTensor());
      }
      if (auto problem = shardPiecesProblem(pieces, numel, name, /*replicas=*/true)) bad(snapshot, *problem);
    }
    if (optimizers.size() != models.size()) return;  // judged where it is read
    for (const auto& flat : dictAt(snapshot, optimizers.front(), "flat_state")) {
      const std::string name = flat.key().toStringRef();
      const auto entry = flat.value().toGenericDict();
      if (!entry.contains("pieces") || !entry.contains("numel")) continue;
      for (const auto& key : entry.at("pieces").toGenericDict()) {
        ShardPieces pieces;
        for (const auto& optimizer : optimizers) {
          const auto theirs = dictAt(snapshot, dictAt(snapshot, optimizer, "flat_state"), name);
          const auto held = theirs.at("pieces").toGenericDict();
          if (held.contains(key.key())) pieces.emplace_back(theirs.at("begin").toInt(), held.at(key.key()).toTensor());
        }
        const std::string what = name + " " + key.key().toStringRef();
        if (auto problem = shardPiecesProblem(pieces, entry.at("numel").toInt(), what, /*replicas=*/true)) bad(snapshot, *problem);
      }
    }
  } catch (const SnapshotError&) {
    throw;
  } catch (const std::exception& e) {  // a value of another type than written (c10::Error)
    bad(snapshot, "unexpected content (" + messageOf(e) + ")");
  }
}

}  // namespace detail

Snapshot consolidateSnapshot(const Snapshot& snapshot) {
  const ShardLayout* layout = layoutOf(snapshot);
  if (!layout) return snapshot;
  const std::vector<ItemDict> shards = detail::findShards(snapshot, detail::slotsOf(snapshot.source), {});
  Snapshot whole = snapshot;
  whole.userState = snapshot.userState.copy();
  try {
    layout->consolidate(whole, shards);
  } catch (const SnapshotError&) {
    throw;
  } catch (const std::exception& e) {  // a value of another type than written (c10::Error)
    bad(snapshot, "unexpected content (" + detail::messageOf(e) + ")");
  }
  // A whole snapshot: no entry says its state is in shards any more.
  (void)whole.userState.erase(kZeroShardsKey);
  for (const ShardLayout& l : kShardLayouts)
    if (l.entry) (void)whole.userState.erase(l.entry);
  return whole;
}

} // namespace ctorch
