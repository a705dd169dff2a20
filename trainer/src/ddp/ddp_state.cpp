// DistributedDataParallel as a checkpoint sees it (ctorch/stateful.hpp): the whole model in rank 0's
// snapshot, and DDP's gradient buckets beside it (USER_STATE["ddp_buckets"]: the parameter indices
// of each bucket, in reduction order), which a resumed run rebuilds its Reducer with before its
// first forward, so that it reduces in the same order as the run it continues (bit-identical with
// more than two ranks). In place, DDP lets go of the failed group and joins the re-formed one.
#include "ctorch/ddp.hpp"

#include "resilience/shard_files.hpp"

namespace ctorch {
namespace {

using BucketLayout = std::vector<std::vector<std::size_t>>;

c10::IValue bucketsValue(const BucketLayout& buckets) {
  c10::impl::GenericList list(c10::ListType::create(c10::ListType::ofInts()));
  for (const auto& bucket : buckets) {
    c10::List<int64_t> indices;
    for (size_t i : bucket) indices.push_back(static_cast<int64_t>(i));
    list.push_back(indices);
  }
  return list;
}

// The layout in `userState` (none when it has no entry); SnapshotCorrupt naming `source` when the
// entry is malformed.
std::optional<BucketLayout> bucketsOf(const ItemDict& userState, const std::filesystem::path& source) {
  if (!userState.contains(detail::kDdpBucketsKey)) return std::nullopt;
  const auto value = userState.at(detail::kDdpBucketsKey);
  if (!value.isList()) throw SnapshotCorrupt(source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets is not a list");
  BucketLayout buckets;
  for (const auto& bucket : value.toList()) {
    const c10::IValue b = bucket;
    if (!b.isList()) throw SnapshotCorrupt(source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets holds a non-list");
    buckets.emplace_back();
    for (const auto& item : b.toList()) {
      const c10::IValue index = item;
      if (!index.isInt() || index.toInt() < 0)
        throw SnapshotCorrupt(source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets holds a bad parameter index");
      buckets.back().push_back(static_cast<size_t>(index.toInt()));
    }
  }
  return buckets;
}

std::optional<BucketLayout> bucketsOf(const ItemDict* userState) {
  if (!userState) return std::nullopt;
  return bucketsOf(*userState, "(the state the run continues from)");
}

} // namespace

std::string detail::DDPCore::stateName() const { return "DistributedDataParallel"; }

torch::nn::Module* detail::DDPCore::trackedModule() { return &module(); }

void detail::DDPCore::saveEntries(ItemDict& userState) const {
  userState.insert(kDdpBucketsKey, bucketsValue(bucketAssignment()));
}

std::vector<std::string> detail::DDPCore::entryNames() const { return {kDdpBucketsKey}; }

void detail::DDPCore::checkEntries(const Snapshot& snapshot) const { (void)bucketsOf(snapshot.userState, snapshot.source); }

// The bucket layout the snapshot's run reduced with (and gradients defined, for
// gradientAsBucketView) before any forward of this process.
void detail::DDPCore::prepareLoad(const ItemDict* userState) { resetReducer(bucketsOf(userState)); }

// A regrouping due after this process's first step happens now rather than in the next forward,
// so that a snapshot of this step records the layout the next step uses.
void detail::DDPCore::stepEnded() { rebuildBuckets(); }

std::string detail::DDPCore::whyNotInPlace() const { return {}; }

void detail::DDPCore::leaveGroup() { releaseGroup(); }

void detail::DDPCore::joinGroup(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const ItemDict* userState) {
  rejoin(group, bucketsOf(userState));
}

} // namespace ctorch
