// The pieces the shards of a snapshot hold of one flat buffer (FSDP's parameters, or one of its
// optimizer's per-element states), checked before anything is copied out of them: one dtype, each
// inside the buffer, and together they tile it exactly once — no element missing, none held by two
// pieces, except that a replica's piece (hybrid sharding: every node saves the same shards) may
// repeat another's range when it holds the very same bytes. A crafted set that breaks any of these
// would otherwise be read silently: cast to the first piece's dtype, or the last of two overlapping
// pieces winning (issue 58).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ctorch::detail {

// (begin, data) of each piece, as the shards hold them; data is read as one flat run of elements.
using ShardPieces = std::vector<std::pair<std::int64_t, at::Tensor>>;

// Why `pieces` cannot be buffer `what` of `numel` elements, or nothing when they tile it. With
// `replicas`, a piece whose range equals another's must hold the same bytes (and then adds nothing).
// With `partial`, elements in no piece are allowed (a rank rejoining in place gets only its own part,
// from its neighbour's copy): the pieces given must still be of one dtype, inside, and not overlap.
inline std::optional<std::string> shardPiecesProblem(const ShardPieces& pieces, std::int64_t numel, const std::string& what,
                                                     bool replicas, bool partial = false) {
  if (numel < 0) return "'" + what + "' has a negative size (" + std::to_string(numel) + ")";
  if (pieces.empty()) return "no pieces of '" + what + "'";
  const auto dtype = pieces.front().second.scalar_type();
  std::vector<std::pair<std::pair<std::int64_t, std::int64_t>, const at::Tensor*>> ranges;
  for (const auto& [begin, data] : pieces) {
    if (data.scalar_type() != dtype)
      return "the pieces of '" + what + "' are of two dtypes (" + std::string(c10::toString(dtype)) + " and " +
             c10::toString(data.scalar_type()) + "): one parameter is saved in one dtype";
    const std::int64_t n = data.numel();
    if (begin < 0 || begin > numel || n > numel - begin)
      return "a piece of '" + what + "' (elements from " + std::to_string(begin) + ", " + std::to_string(n) +
             " of them) lies outside its " + std::to_string(numel) + " elements";
    if (n > 0) ranges.push_back({{begin, begin + n}, &data});
  }
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::int64_t upTo = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const auto [from, to] = ranges[i].first;
    if (i > 0 && replicas && ranges[i].first == ranges[i - 1].first) {
      // The same range again: a replica's copy, which must be the same bytes (NaN included).
      const auto a = ranges[i - 1].second->detach().contiguous().reshape({-1}).view(at::kByte);
      const auto b = ranges[i].second->detach().contiguous().reshape({-1}).view(at::kByte);
      if (!at::equal(a, b))
        return "two pieces of '" + what + "' hold elements " + std::to_string(from) + " to " + std::to_string(to - 1) +
               " with different values: each element is saved once (or as an identical replica)";
      continue;
    }
    if (from > upTo && !partial)
      return "the shards do not cover '" + what + "' (elements " + std::to_string(upTo) + " to " + std::to_string(from - 1) +
             " of " + std::to_string(numel) + " are in no piece)";
    if (from < upTo)
      return "two pieces of '" + what + "' overlap (elements " + std::to_string(from) + " to " +
             std::to_string(std::min(upTo, to) - 1) + "): each element is saved once";
    upTo = to;
  }
  if (upTo < numel && !partial)
    return "the shards do not cover '" + what + "' (elements from " + std::to_string(upTo) + " of " + std::to_string(numel) + ")";
  return std::nullopt;
}

}  // namespace ctorch::detail
