// Private: every file name derived from a snapshot slot's path, in one place (docs/snapshot.md). For
// the slot run/snapshot.pt:
//   run/snapshot.pt              the newest snapshot
//   run/snapshot.pt.1 ... .K     the previous ones, newest first                (keptFile)
//   run/snapshot-epoch.pt        the epoch-boundary slot, a slot of its own      (boundarySlot)
//   run/snapshot.pt.lock         the lock rank 0 holds for the run              (lockFile)
//   <file>.shards/rank<r>.pt     rank r's shard of a sharded run's snapshot <file> (shardFile), with
//                                its own previous ones (rank<r>.pt.1 ...): every shard in one folder
//   <file>.optim-rank<r>         the same, as ctorch named it before (legacyShardFile): still read
//   <file>.unusable              a damaged snapshot set aside, never read again  (unusableFile)
//   <slot name>.tmp-*            a write in progress; a stale one is removed     (temporaryPrefix)
#pragma once

#include <filesystem>
#include <string>

namespace ctorch::detail {

inline std::filesystem::path keptFile(const std::filesystem::path& slot, int n) {
  return std::filesystem::path(slot.string() + "." + std::to_string(n));
}

inline std::filesystem::path boundarySlot(const std::filesystem::path& slot) {
  return slot.parent_path() / (slot.stem().string() + "-epoch" + slot.extension().string());
}

inline std::filesystem::path lockFile(const std::filesystem::path& slot) {
  return std::filesystem::path(slot.string() + ".lock");
}

// The folder of `file`'s shards.
inline std::filesystem::path shardDirectory(const std::filesystem::path& file) {
  return file.parent_path() / (file.filename().string() + ".shards");
}

inline std::filesystem::path shardFile(const std::filesystem::path& file, int rank) {
  return shardDirectory(file) / ("rank" + std::to_string(rank) + ".pt");
}

// Before issue 42 a shard lay beside its snapshot, named as if it held only optimizer state: what
// every such file of `file` starts with (its name, then this, then the rank).
inline std::string legacyShardPrefix(const std::filesystem::path& file) {
  return file.filename().string() + ".optim-rank";
}

inline std::filesystem::path legacyShardFile(const std::filesystem::path& file, int rank) {
  return file.parent_path() / (legacyShardPrefix(file) + std::to_string(rank));
}

inline std::filesystem::path unusableFile(const std::filesystem::path& file) {
  return std::filesystem::path(file.string() + ".unusable");
}

// The name a temporary file of a write into `file` starts with (a link's staging name, a copy's, a
// new snapshot's): "<name>.tmp-".
inline std::string temporaryPrefix(const std::filesystem::path& file) {
  return file.filename().string() + ".tmp-";
}

} // namespace ctorch::detail
