// Crash-safe training snapshots: everything needed to continue a run exactly (model, optimizer,
// scheduler, progress, sampler, RNG states, user items) in a file Python's torch.load also reads,
// written atomically with the previous K kept, and verified (magic, version, digest) on load.
// docs/snapshot.md describes the file format, naming and rotation.
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/sampler.hpp"
#include "ctorch/state_dict.hpp"

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ctorch {

inline constexpr const char* kSnapshotMagic = "ctorch-snapshot";
inline constexpr std::int64_t kSnapshotFormatVersion = 1;

// ---- Content -------------------------------------------------------------------------------------
struct SnapshotHeader {
  std::string magic = kSnapshotMagic;
  std::int64_t formatVersion = kSnapshotFormatVersion;
  std::int64_t worldSize = 1;
  std::string modelName;
  // The training configuration the run considers binding (hyper-parameters, data, model shape),
  // as text. Its hash identifies the run; the entries let a refusal say what changed.
  std::map<std::string, std::string> config;
  std::string configHash;          // contentDigest(config); set by captureSnapshot
  std::chrono::system_clock::time_point createdAt{};
  std::string ctorchVersion;       // versionString() of the writer
  std::string torchVersion;        // LibTorch of the writer
  std::string contentDigest;       // set by encodeSnapshot / checked by decodeSnapshot
  // The save this file belongs to ("<run id>-<global step>"): a sharded run's snapshot and each of
  // its shard files carry the same, so that a shard of another save is never taken for one of this
  // save's. Empty: written without one (an older ctorch, or a file saved outside ResilientTraining).
  std::string saveId;
};

struct RngState {
  at::Tensor cpu;                  // torch.get_rng_state() layout (uint8)
  std::vector<at::Tensor> cuda;    // one per visible CUDA device when CUDA was available
};

struct Snapshot {
  SnapshotHeader header;
  c10::Dict<std::string, at::Tensor> modelState;        // MODEL_STATE, like state_dict()
  std::string optimizerType;                            // OPTIMIZER_TYPE: SGD, Adam, ... or ""
  ItemDict optimizerState = newItemDict();              // OPTIMIZER_STATE, like Python's
  ItemDict schedulerState = newItemDict();              // LR_SCHEDULER_STATE, filled by the trainer
  std::int64_t epochsRun = 0;                           // EPOCHS_RUN: completed epochs
  std::int64_t stepInEpoch = 0;                         // STEP_IN_EPOCH: steps done in epochsRun
  std::int64_t globalStep = 0;                          // GLOBAL_STEP: steps since the start
  std::optional<SamplerState> sampler;                  // SAMPLER_STATE
  RngState rng;                                         // RNG_STATE: the writer's (rank 0's)
  // RNG_STATE["ranks"]: every rank's states, index = rank, when the trainer gathered them (ranks
  // seeded differently, e.g. seed + rank, draw different streams); empty otherwise.
  std::vector<RngState> rankRng;
  ItemDict userState = newItemDict();                   // USER_STATE: the trainer's own items
  std::filesystem::path source;                         // file it was loaded from (not stored)
};

// ---- Capture and restore -------------------------------------------------------------------------
// The training objects a snapshot is taken from and restored into. Only `model` is required.
struct TrainingObjects {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;  // SGD, Adam, AdamW, RMSprop or Adagrad
  DistributedSampler* sampler = nullptr;
};

struct SnapshotIdentity {
  std::string modelName;
  std::int64_t worldSize = 1;
  std::map<std::string, std::string> config;
};

struct TrainingProgress {
  std::int64_t epochsRun = 0;
  std::int64_t stepInEpoch = 0;
  std::int64_t globalStep = 0;
};

// Copies (CPU, detached) of the state of `objects` plus the RNG states, ready to save. The trainer
// adds schedulerState and userState before saving.
Snapshot captureSnapshot(const TrainingObjects& objects, const SnapshotIdentity& identity,
                         const TrainingProgress& progress);

struct RestoreOptions {
  bool model = true;
  bool optimizer = true;
  bool rng = true;
  bool sampler = true;
  // This process's rank: restores rankRng[rank] when the snapshot has it, else `rng` (also when
  // the world size changed). -1: always `rng`.
  std::int64_t rank = -1;
};

// Restores into `objects` in place: parameters and buffers (names, shapes and dtypes must match),
// optimizer state and hyper-parameters, RNG states, sampler position. Throws SnapshotIncompatible
// listing what does not fit; checks everything before changing anything.
void restoreSnapshot(const Snapshot& snapshot, const TrainingObjects& objects,
                     const RestoreOptions& options = {});

// The pieces on their own.
c10::Dict<std::string, at::Tensor> captureModelState(const torch::nn::Module& model);
// Returns the differences (missing, unexpected, shape or dtype) instead of throwing; empty on
// success. Nothing is copied unless everything fits.
std::vector<std::string> restoreModelState(torch::nn::Module& model,
                                           const c10::Dict<std::string, at::Tensor>& state);
// Python's optimizer.state_dict() layout: {"state": {index: {...}}, "param_groups": [{..., "params": [...]}]}.
ItemDict captureOptimizerState(const torch::optim::Optimizer& optimizer,
                               std::string* typeName = nullptr);
std::vector<std::string> restoreOptimizerState(torch::optim::Optimizer& optimizer,
                                               const std::string& typeName, const ItemDict& state);
RngState captureRngState();
std::vector<std::string> restoreRngState(const RngState& state);  // returns notes, not errors

// ---- Encoding ------------------------------------------------------------------------------------
// The bytes of a snapshot file (torch.save / pickle_save zip format). Sets header.contentDigest.
std::vector<char> encodeSnapshot(Snapshot& snapshot);
// Checks the archive (zip structure, CRC-32 of every record), the header (magic, version, fields)
// and the content digest; `file` names the origin in messages. Throws SnapshotCorrupt or
// SnapshotIncompatible (newer format version).
Snapshot decodeSnapshot(const std::vector<char>& bytes, const std::filesystem::path& file);

// What the run expects of a snapshot it resumes from; empty/unset fields are not checked.
struct SnapshotExpectation {
  std::string modelName;
  std::optional<std::map<std::string, std::string>> config;
  std::optional<std::int64_t> worldSize;
  // Steps in one epoch of this run at world size stepsPerEpochWorldSize (the loader's length). A
  // snapshot of that world size (and of this config, when `config` is set) that claims more steps
  // into an epoch is impossible for this run: loadSnapshot refuses it as corrupt (SnapshotCorrupt,
  // bad content), so loadNewestValid goes on to the next file. Unset: not checked.
  std::optional<std::int64_t> stepsPerEpoch;
  std::int64_t stepsPerEpochWorldSize = 1;
};
// The differences between a header and an expectation (empty when compatible).
std::vector<std::string> compareWithExpectation(const SnapshotHeader& header,
                                                const SnapshotExpectation& expect);

// ---- Files ---------------------------------------------------------------------------------------
// The slot `path` (e.g. run/snapshot.pt) holds the newest snapshot; path.1 .. path.K the K
// previous ones, newest first. Temporary files are path.tmp-*; nothing else is touched.
enum class SnapshotWriteStep {
  TempSynced,       // new content complete in a temporary file, fsync'ed and closed
  Rotated,          // path.1.. shifted one place up (path.K dropped)
  PreviousLinked,   // the current path also reachable as path.1
  Renamed,          // temporary file renamed over path
  DirectorySynced,  // directory fsync'ed: the new snapshot is durable
};
const char* writeStepName(SnapshotWriteStep step);

// The one check of a snapshot slot's path, which every layer that takes one asks in its own terms
// (SnapshotSlotOptions: "snapshot path", ResilienceOptions::snapshotPath, ctorch-train's
// --snapshot-path): nullopt when `path` can be a slot, else one line naming `who` and the path. The path
// must name a file ("", "run/", "." and ".." do not), and what is there already must be a regular file
// or a symbolic link, not a directory, FIFO, socket or device. Every name derived from a slot (kept
// snapshots, the epoch slot, the lock, shard files) is docs/snapshot.md's table.
std::optional<std::string> snapshotPathProblem(const std::filesystem::path& path, const std::string& who);

struct SnapshotSlotOptions {
  std::filesystem::path path;
  int keepPrevious = 2;  // K: how many older snapshots are kept next to the newest
  // Called after each step of a write; tests use it to simulate a crash between steps.
  std::function<void(SnapshotWriteStep)> onWriteStep;
  // Called before the write touches the file system and again just before it rotates the kept
  // files and puts the new one in place: throwing stops the write there (its temporary file
  // removed, the slot as it was). A fencing check: ResilientTraining refuses the writes of a process
  // its group went on without (a later rendezvous round holds the slot's lock).
  std::function<void()> fence;

  void validate() const;  // throws std::invalid_argument naming the bad value
};

// Writes `snapshot` into the slot crash-safely (call on one rank only, e.g. rank 0): temporary
// file in the same directory, fsync, rotate, link the current one as path.1, rename the temporary
// over path, fsync the directory. At no instant is `path` missing once it existed.
// Returns the number of bytes written. System call failures throw std::system_error.
std::size_t saveSnapshot(Snapshot& snapshot, const SnapshotSlotOptions& options);

// The module's state dict (parameters and buffers, in Python's state_dict order) as a file that
// Python opens with a plain `torch.load(path)` (weights-only in PyTorch 2.6+) and
// `model.load_state_dict(...)`: the final weights of a run (model.pt). Written crash-safely like a
// snapshot (temporary file, fsync, rename, directory fsync): `path` holds the old or the new file,
// never a partial one. Returns the bytes written; system call failures throw std::system_error.
std::size_t saveStateDict(const torch::nn::Module& module, const std::filesystem::path& path);

// Reads and verifies one file (see decodeSnapshot), then checks `expect`.
Snapshot loadSnapshot(const std::filesystem::path& file, const SnapshotExpectation& expect = {});

// path, path.1, path.2, ... that exist, newest first (by number, gaps allowed).
std::vector<std::filesystem::path> listSnapshotFiles(const std::filesystem::path& slot);

struct SkippedSnapshot {
  std::filesystem::path file;
  std::string reason;
};

struct SnapshotSearch {
  std::optional<Snapshot> snapshot;     // the newest valid one, if any
  std::vector<SkippedSnapshot> skipped; // newer files that were passed over, and why
  // "skipped run/snapshot.pt: ...; skipped run/snapshot.pt.1: ..." (empty when none skipped)
  std::string describeSkipped() const;
};

struct LoadNewestOptions {
  SnapshotExpectation expect;
  // By default an incompatible snapshot stops the search with SnapshotIncompatible: resuming an
  // older snapshot of a different run, or starting fresh, must be the user's decision. When set,
  // incompatible files are skipped like corrupt ones.
  bool skipIncompatible = false;
  // Called on each valid candidate; a SnapshotError it throws skips that file like a damaged one
  // (e.g. a snapshot whose per-rank optimizer shards are not all there).
  std::function<void(const Snapshot&)> accept;
};

// Walks listSnapshotFiles(slot) newest first and returns the first valid one, reporting each file
// it skipped and why. No file at all gives an empty result with nothing skipped.
SnapshotSearch loadNewestValid(const std::filesystem::path& slot,
                               const LoadNewestOptions& options = {});

// Renames each skipped file to `<file>.unusable` (never read again; kept as evidence) and returns a
// line per file saying what was done. Left in place, a corrupt newest file would be rotated by the
// next saveSnapshot into the kept ones (`snapshot.pt.1`) in place of a good fallback. Call it on
// one process, after every process that reads the slot has read it. Never throws for a failed
// rename (the line says so).
std::vector<std::string> setAsideSkipped(const std::vector<SkippedSnapshot>& skipped);

} // namespace ctorch
