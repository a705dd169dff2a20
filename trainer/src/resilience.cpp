// ResilientTraining: the registered objects, the run's position, and the three moments a loop
// gives it (resume, step done, epoch done). Decisions about what to resume from are pure
// (resume_plan.cpp); the files are crash-safe slots (snapshot_file.cpp) written on a background
// thread (snapshot_writer.cpp); every agreement between ranks is one small allreduce.
#include "ctorch/resilience.hpp"
#include "ctorch/amp.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/snapshot_writer.hpp"
#include "capture_pool.hpp"
#include "slot_lock.hpp"
#include "error_text.hpp"

#include <atomic>
#include <ctorch/contract/worker_contract.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/utils.h>
#include <torch/types.h>

#include <cstring>
#include <iostream>
#include <sstream>

namespace ctorch {

namespace {

// User-state keys of the library's own (names a loop cannot register).
constexpr const char* kEpochComplete = "epoch_complete";
constexpr const char* kDdpBuckets = "ddp_buckets";

std::uint64_t splitMix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// The seed of one rank's step: a pure function of (seed, rank, step), the same mixing as the
// data pipeline's augmentation draws (ctorch::data::mixBits).
std::uint64_t stepSeedFor(std::uint64_t seed, int rank, std::int64_t step) {
  return splitMix64(splitMix64(splitMix64(seed) ^ static_cast<std::uint64_t>(rank)) ^
                    static_cast<std::uint64_t>(step));
}

// LibTorch's LRScheduler keeps its step count protected and offers no state_dict: reach it through
// a derived class's member pointer (well-defined: the member is named in the derived class's scope).
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& stepCount(torch::optim::LRScheduler& s) { return s.*(&SchedulerAccess::step_count_); }
};

SnapshotPoint pointOf(const Snapshot& s) {
  SnapshotPoint p;
  p.file = s.source;
  p.worldSize = s.header.worldSize;
  p.epochsRun = s.epochsRun;
  p.stepInEpoch = s.stepInEpoch;
  p.globalStep = s.globalStep;
  if (s.userState.contains(kEpochComplete)) p.epochComplete = s.userState.at(kEpochComplete).toBool();
  return p;
}

c10::IValue bucketsValue(const std::vector<std::vector<size_t>>& buckets) {
  c10::impl::GenericList list(c10::ListType::create(c10::ListType::ofInts()));
  for (const auto& bucket : buckets) {
    c10::List<int64_t> indices;
    for (size_t i : bucket) indices.push_back(static_cast<int64_t>(i));
    list.push_back(indices);
  }
  return list;
}

std::optional<std::vector<std::vector<size_t>>> bucketsOf(const Snapshot& snap) {
  if (!snap.userState.contains(kDdpBuckets)) return std::nullopt;
  const auto value = snap.userState.at(kDdpBuckets);
  if (!value.isList()) throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets is not a list");
  std::vector<std::vector<size_t>> buckets;
  for (const auto& bucket : value.toList()) {
    const c10::IValue b = bucket;
    if (!b.isList()) throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets holds a non-list");
    buckets.emplace_back();
    for (const auto& item : b.toList()) {
      const c10::IValue index = item;
      if (!index.isInt() || index.toInt() < 0)
        throw SnapshotCorrupt(snap.source, SnapshotCorrupt::Kind::BadContent, "ddp_buckets holds a bad parameter index");
      buckets.back().push_back(static_cast<size_t>(index.toInt()));
    }
  }
  return buckets;
}

// "epoch 2, step 120 (global step 589)" / "the end of epoch 2 (global step 600)", from 1.
std::string describePoint(std::int64_t epoch, std::int64_t stepInEpoch, std::int64_t globalStep) {
  if (stepInEpoch == 0 && epoch > 0)
    return "the end of epoch " + std::to_string(epoch) + " (global step " + std::to_string(globalStep) + ")";
  return "global step " + std::to_string(globalStep) + " (epoch " + std::to_string(epoch + 1) + ", step " +
         std::to_string(stepInEpoch) + ")";
}

// One rank's generator states as one byte tensor: [count][len, bytes]... (CPU first, then CUDA).
at::Tensor packRng(const RngState& s) {
  std::vector<at::Tensor> parts{s.cpu};
  parts.insert(parts.end(), s.cuda.begin(), s.cuda.end());
  std::vector<std::uint8_t> bytes;
  auto put = [&](std::int64_t v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof v);
  };
  put(static_cast<std::int64_t>(parts.size()));
  for (const auto& t : parts) {
    const auto c = t.contiguous().to(torch::kCPU);
    put(c.numel());
    const auto* d = c.data_ptr<std::uint8_t>();
    bytes.insert(bytes.end(), d, d + c.numel());
  }
  return torch::from_blob(bytes.data(), {static_cast<std::int64_t>(bytes.size())}, torch::kUInt8).clone();
}

RngState unpackRng(const at::Tensor& packed) {
  const auto c = packed.contiguous().to(torch::kCPU);
  const auto* d = c.data_ptr<std::uint8_t>();
  const std::int64_t size = c.numel();
  std::int64_t at = 0;
  auto get = [&]() {
    std::int64_t v = 0;
    if (at + static_cast<std::int64_t>(sizeof v) > size) throw DistributedError("a rank sent a malformed generator state");
    std::memcpy(&v, d + at, sizeof v);
    at += sizeof v;
    return v;
  };
  RngState s;
  const std::int64_t count = get();
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t n = get();
    if (n < 0 || at + n > size) throw DistributedError("a rank sent a malformed generator state");
    auto t = torch::empty({n}, torch::kUInt8);
    std::memcpy(t.data_ptr<std::uint8_t>(), d + at, static_cast<size_t>(n));
    at += n;
    if (i == 0) s.cpu = t;
    else s.cuda.push_back(t);
  }
  return s;
}

}  // namespace

void ResilienceOptions::validate() const {
  if (snapshotPath_.empty()) throw ConfigError("ResilienceOptions::snapshotPath is empty");
  if (std::filesystem::is_directory(snapshotPath_))
    throw ConfigError("ResilienceOptions::snapshotPath '" + snapshotPath_.string() +
                      "' is a directory; name the snapshot file (e.g. '" + (snapshotPath_ / "snapshot.pt").string() + "')");
  if (saveEverySteps_ < 0)
    throw ConfigError("ResilienceOptions::saveEverySteps must be >= 0, got " + std::to_string(saveEverySteps_));
  if (saveEveryEpochs_ < 0)
    throw ConfigError("ResilienceOptions::saveEveryEpochs must be >= 0, got " + std::to_string(saveEveryEpochs_));
  if (keepPrevious_ < 0 || keepPrevious_ > 100)
    throw ConfigError("ResilienceOptions::keepPrevious must be between 0 and 100, got " + std::to_string(keepPrevious_));
  if (runName_.empty()) throw ConfigError("ResilienceOptions::runName is empty");
}

struct ResilientTraining::Impl {
  struct Items {
    std::function<void(ItemDict&)> save;
    std::function<void(const ItemDict&)> load;
  };

  ResilienceOptions o;
  torch::nn::Module* model = nullptr;
  detail::DDPCore* ddp = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  DistributedSampler* sampler = nullptr;
  std::function<ItemDict()> schedulerSave;
  std::function<void(const ItemDict&)> schedulerLoad;
  std::vector<std::string> names;  // registered user-state names
  std::vector<Items> items;

  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0;
  int world = 1;
  bool nccl = false;
  std::filesystem::path slot, boundarySlot;

  std::int64_t epoch = 0, stepInEpoch = 0, globalStep = 0;
  std::int64_t savedAt = -1;  // global step of the newest snapshot submitted (-1: none this process)
  bool savedBoundary = false; // ... and whether it was the epoch-boundary one
  bool resumed = false;
  bool stop = false;
  TrainingStatus status = TrainingStatus::kRunning;
  // In-place recovery: where the last agreement left this rank (recover() goes back to it when the
  // step in progress did not reach the optimizer), and whether an agreement is in progress.
  bool inPlace = false;
  enum class Phase { kLoop, kStepAgreement, kEpochAgreement } phase = Phase::kLoop;
  SamplerState committedSampler;
  std::int64_t committedVersions = 0;
  // The module's buffers as agreed (BatchNorm statistics move in a forward that may be abandoned).
  std::vector<at::Tensor> committedBuffers;
  std::unique_ptr<SnapshotWriter> writer;
  detail::SlotLock slotLock;  // rank 0: "<slot>.lock", held for the run's life
  // Rank 0: the failed write's error, taken from the writer (its wait() hands it out once), and the
  // global step of the newest snapshot known durable.
  std::exception_ptr writeError;
  std::atomic<std::int64_t> durableAt{-1};
  detail::CapturePool capturePool;  // rank 0's copies, reused from save to save
  // A small allreduce of doubles that was started and not yet waited for.
  struct Reduction {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor values;
    std::string during;  // names it when it fails
  };
  // overlapAgreement: the stop agreement that stepDone() started, read at the next stepDone(),
  // epochDone() or finish(). Its allreduce runs while the next step computes.
  std::optional<Reduction> pending;

  void say(const std::string& line) const {
    if (rank != 0) return;
    if (o.log()) o.log()(line);
    else std::cerr << o.programName() << ": " << line << std::endl;
  }

  torch::Device commDevice() const {
    if (!nccl) return torch::kCPU;
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
  }

  // A failed collective becomes one line naming the rank and the moment.
  [[noreturn]] void throwCollectiveFailure(const std::exception& e, const std::string& during) const {
    const std::string message = detail::messageOf(e);
    detail::throwDistributed("rank " + std::to_string(rank) + ": " + during + " failed: " + message, message);
  }

  // 1.0 when this process was asked to stop: summed over the ranks, whether any was.
  static double stopFlag() { return ctorch::stopSignal() != 0 ? 1.0 : 0.0; }
  // 1.0 when a snapshot write failed here (rank 0): voted with the stop flag, so that every rank
  // stops at the same step with WriteFailed.
  double writeFlag() const { return writeError || writer->failed() ? 1.0 : 0.0; }

  // Rank 0: takes "<slot>.lock". False (with `holder` naming it) when another job holds it; a slot
  // that cannot be locked here (a read-only directory, no locks on this file system) is said once
  // and not refused.
  bool lockSlot(std::string& holder) {
    const char* id = std::getenv(contract::env::kRunId);
    std::string runId = id ? std::string(id).substr(0, 200) : std::string();
    for (char& c : runId)
      if (c == ' ' || c < 0x20 || c > 0x7e) c = '_';
    std::string detail;
    switch (slotLock.acquire(slot, runId, std::chrono::seconds(10), detail)) {
      case detail::SlotLock::Result::kHeld: return true;
      case detail::SlotLock::Result::kUnavailable:
        say("warning: " + detail + "; running without the check that no other job uses this snapshot slot");
        return true;
      case detail::SlotLock::Result::kInUse: holder = detail; return false;
    }
    return true;
  }

  [[noreturn]] void refuseBusySlot(const std::string& holder) const {
    if (rank == 0)
      throw ConfigError("snapshot slot " + slot.string() + " is in use by another job (" + holder + "; lock " +
                        slotLock.path().string() + "): two jobs on one slot would mix their snapshots; stop that "
                        "job, or give this one another snapshot path");
    throw ConfigError("rank " + std::to_string(rank) + ": snapshot slot " + slot.string() +
                      " is in use by another job (rank 0's error names it)");
  }

  // Rank 0: waits for the write in flight and keeps its WriteFailed (the writer hands it out once);
  // the library's other errors (an item that cannot be encoded) propagate as they are.
  void collectWriteError() {
    if (rank != 0 || writeError) return;
    try {
      writer->wait();
    } catch (const WriteFailed&) {
      writeError = std::current_exception();
    }
  }

  // Every rank, once the vote said a write failed: rank 0 rethrows its error with where the run
  // stands; the others say that rank 0 could not write.
  [[noreturn]] void throwWriteFailed() {
    const std::string at = "global step " + std::to_string(globalStep);
    if (rank != 0)
      throw WriteFailed("rank " + std::to_string(rank) + ": stopped at " + at +
                        " with every rank: rank 0 could not write the snapshot (its error names the file)");
    collectWriteError();
    try {
      if (writeError) std::rethrow_exception(writeError);
    } catch (const WriteFailed& e) {
      const std::int64_t durable = durableAt.load();
      throw WriteFailed(std::string(e.what()) + "; " + slot.string() +
                        (durable >= 0 ? " holds the last snapshot written (global step " + std::to_string(durable) + ")"
                                      : " keeps what it held before") +
                        "; every rank stopped at " + at + " (exit code " + std::to_string(contract::kExitWriteFailed) +
                        "): free space and run the same command again to resume");
    }
    throw WriteFailed("a snapshot write failed; every rank stopped at " + at);
  }

  // At a point where every rank waits for rank 0's snapshot (a stop, the end): the write finishes,
  // and its success or failure is agreed instead of a plain barrier.
  void settleWrites(const std::string& during) {
    collectWriteError();
    if (allReduce({writeFlag()}, c10d::ReduceOp::SUM, during)[0] > 0) throwWriteFailed();
  }

  Reduction startAllReduce(const std::vector<double>& values, c10d::ReduceOp op, std::string during) {
    try {
      std::vector<at::Tensor> t{torch::tensor(values, torch::kFloat64).to(commDevice())};
      c10d::AllreduceOptions options;
      options.reduceOp = op;
      auto work = group->allreduce(t, options);
      return {std::move(work), t[0], std::move(during)};
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throwCollectiveFailure(e, during);
    }
  }

  std::vector<double> finishAllReduce(Reduction& r) {
    try {
      r.work->wait();
      const auto cpu = r.values.cpu();
      return {cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel()};
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throwCollectiveFailure(e, r.during);
    }
  }

  std::vector<double> allReduce(std::vector<double> values, c10d::ReduceOp op, const std::string& during) {
    if (world == 1) return values;
    Reduction r = startAllReduce(values, op, during);
    return finishAllReduce(r);
  }

  // Starts this step's stop agreement without waiting for it (overlapAgreement).
  void startAgreement() {
    pending = startAllReduce({stopFlag(), writeFlag()}, c10d::ReduceOp::SUM,
                             "step " + std::to_string(globalStep) + "'s agreement");
  }

  // What the ranks agreed: some rank asked to stop; rank 0's snapshot write failed.
  struct Vote {
    bool stop = false;
    bool writeFailed = false;
  };

  // Waits for the agreement startAgreement() left running.
  Vote finishAgreement() {
    if (!pending) return {};
    Reduction r = std::move(*pending);
    pending.reset();
    const auto v = finishAllReduce(r);
    return {v[0] > 0, v[1] > 0};
  }

  // Every rank's generator states, index = rank (for snapshots without stepSeed).
  std::vector<RngState> gatherRng() {
    const at::Tensor mine = packRng(captureRngState());
    if (world == 1) return {unpackRng(mine)};
    const auto longest = static_cast<std::int64_t>(
        allReduce({static_cast<double>(mine.numel())}, c10d::ReduceOp::MAX, "gathering generator states")[0]);
    try {
      auto padded = torch::zeros({longest}, torch::kUInt8);
      padded.narrow(0, 0, mine.numel()).copy_(mine);
      std::vector<at::Tensor> input{padded.to(commDevice())};
      std::vector<std::vector<at::Tensor>> output(1);
      for (int r = 0; r < world; ++r) output[0].push_back(torch::empty_like(input[0]));
      group->allgather(output, input)->wait();
      std::vector<RngState> states;
      for (const auto& t : output[0]) states.push_back(unpackRng(t));
      return states;
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throwCollectiveFailure(e, "gathering generator states");
    }
  }

  void seedStep() const {
    if (o.stepSeed()) torch::manual_seed(stepSeedFor(*o.stepSeed(), rank, globalStep));
  }

  // ---- saving ----------------------------------------------------------------------------------
  enum class Kind { kMidEpoch, kEpochComplete, kEpochBoundary };

  Kind currentKind() const {
    if (stepInEpoch == 0) return Kind::kEpochBoundary;
    return sampler && sampler->exhausted() ? Kind::kEpochComplete : Kind::kMidEpoch;
  }

  // Every rank calls it (the generator states are gathered); rank 0 captures a copy and hands it to
  // the writer: into the slot (and the boundary slot at an epoch boundary) and extras.alsoWriteTo, or
  // (Targets::kExtrasOnly) into extras.alsoWriteTo alone.
  enum class Targets { kSlotAndExtras, kExtrasOnly };
  void save(Kind kind, const SaveExtras& extras, Targets targets) {
    const bool onlyExtras = targets == Targets::kExtrasOnly;
    std::vector<RngState> rankRng;
    if (!o.stepSeed()) rankRng = gatherRng();
    if (rank != 0) {
      if (!onlyExtras) {
        savedAt = globalStep;
        savedBoundary = kind == Kind::kEpochBoundary;
      }
      return;
    }
    if (!model) throw ConfigError("ResilientTraining: no model registered (track(ddp) or track(model) before resume())");
    const TrainingObjects objects{model, optimizer, sampler};
    Snapshot s = [&] {
      detail::CapturePoolScope reuse(o.reuseCaptureBuffers() ? &capturePool : nullptr);
      return captureSnapshot(objects, SnapshotIdentity{o.runName(), world, o.config()},
                             TrainingProgress{epoch, stepInEpoch, globalStep});
    }();
    s.rankRng = std::move(rankRng);
    if (schedulerSave) s.schedulerState = schedulerSave();
    for (const auto& item : items) item.save(s.userState);
    s.userState.insert(kEpochComplete, kind == Kind::kEpochComplete);
    if (ddp) s.userState.insert(kDdpBuckets, bucketsValue(ddp->bucketAssignment()));

    SnapshotJob job;
    job.snapshot = std::move(s);
    auto add = [&job](const std::filesystem::path& path, int keep) {
      SnapshotSlotOptions slotOptions;
      slotOptions.path = path;
      slotOptions.keepPrevious = keep;
      job.slots.push_back(slotOptions);
    };
    if (!onlyExtras) {
      add(slot, o.keepPrevious());
      if (kind == Kind::kEpochBoundary) add(boundarySlot, 1);
    }
    for (const auto& extra : extras.alsoWriteTo) add(extra, 0);
    if (job.slots.empty()) return;
    job.afterWrite = extras.afterWrite;
    job.report = [this](const std::string& line) { say(line); };
    job.reportError = [this](const std::string& line) {
      std::cerr << o.programName() << ": " << line << std::endl;
    };
    job.label = kind == Kind::kEpochBoundary && epoch > 0
                    ? "end of epoch " + std::to_string(epoch)
                    : "epoch " + std::to_string(epoch + 1) + ", step " + std::to_string(stepInEpoch);
    job.label += ", global step " + std::to_string(globalStep);
    if (!onlyExtras) {
      auto after = std::move(job.afterWrite);
      job.afterWrite = [this, after = std::move(after), step = globalStep] {
        if (after) after();
        durableAt = step;
      };
    }
    // After a failed write nothing more is written: the agreed stop comes at the next agreement.
    if (!writeError && !writer->failed()) {
      try {
        writer->submit(std::move(job));
      } catch (const WriteFailed& e) {
        // This write (run now: said here) or the background one before it (said when it failed).
        writeError = std::current_exception();
        if (!o.backgroundWrite()) std::cerr << o.programName() << ": " << e.what() << std::endl;
      }
    }
    if (!onlyExtras) {
      savedAt = globalStep;
      savedBoundary = kind == Kind::kEpochBoundary;
    }
  }

  bool saved() const { return savedAt == globalStep && (stepInEpoch != 0 || savedBoundary); }

  // An agreed stop: the snapshot of exactly this point is durable on rank 0 before anyone leaves.
  bool stopHere() {
    if (!saved()) save(currentKind(), {}, Targets::kSlotAndExtras);
    settleWrites("the stop's barrier");
    status = TrainingStatus::kStopped;
    const int signo = ctorch::stopSignal();
    const std::string at = describePoint(epoch, stepInEpoch, globalStep);
    std::cerr << o.programName() << ": rank " << rank << "/" << world << " stopped after " << at << ": "
              << (signo != 0 ? std::string(strsignal(signo)) + " here" : std::string("a stop signal on another rank"))
              << std::endl;
    say("stopped on request after " + at + "; snapshot " + slot.string() +
        " written; run the same command again to resume (exit code " + std::to_string(contract::kExitPreempted) + ")");
    return true;
  }

  void checkFinished(const char* call) const {
    if (status == TrainingStatus::kFinished)
      throw ConfigError(std::string("ResilientTraining::") + call + "() after finish()");
  }

  // ---- in-place recovery -----------------------------------------------------------------------
  // The sum of the parameters' version counters: an optimizer step (in-place updates) changes it.
  std::int64_t parameterVersions() const {
    std::int64_t sum = 0;
    if (model)
      for (const auto& p : model->parameters()) sum += static_cast<std::int64_t>(p._version());
    return sum;
  }

  // A point every rank agreed on: what recover() returns to when a step fails before its update.
  void commit() {
    phase = Phase::kLoop;
    if (!inPlace) return;
    if (sampler) committedSampler = sampler->state();
    committedVersions = parameterVersions();
    if (!model) return;
    torch::NoGradGuard noGrad;
    const auto buffers = model->buffers();
    if (committedBuffers.size() != buffers.size()) {
      committedBuffers.clear();
      for (const auto& b : buffers) committedBuffers.push_back(b.detach().clone());
    } else {
      for (std::size_t i = 0; i < buffers.size(); ++i) committedBuffers[i].copy_(buffers[i]);
    }
  }

  // The counters (and the sampler) moved to what this rank's state holds after a failure: the step
  // in progress counts when its update ran (the gradient allreduce completed here, so the update is
  // the one every rank makes), else the loop goes back to the last agreed point.
  void settleAfterFailure() {
    if (phase != Phase::kLoop) return;  // an agreement failed: the counters already include the step/epoch
    if (parameterVersions() != committedVersions) {
      ++stepInEpoch;
      ++globalStep;
    } else {
      // Abandoned before its update: the position and the buffers go back to the agreement.
      if (sampler) sampler->loadState(committedSampler);
      if (model) {
        torch::NoGradGuard noGrad;
        const auto buffers = model->buffers();
        if (buffers.size() == committedBuffers.size())
          for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(committedBuffers[i]);
      }
    }
  }

  // This rank's whole training state as bytes (the snapshot format, without the files).
  std::vector<char> encodeState(const std::optional<std::vector<std::vector<size_t>>>& buckets) {
    const TrainingObjects objects{model, optimizer, sampler};
    Snapshot snap = captureSnapshot(objects, SnapshotIdentity{o.runName(), world, o.config()},
                                    TrainingProgress{epoch, stepInEpoch, globalStep});
    if (schedulerSave) snap.schedulerState = schedulerSave();
    for (const auto& item : items) item.save(snap.userState);
    snap.userState.insert(kEpochComplete, currentKind() == Kind::kEpochComplete);
    if (buckets) snap.userState.insert(kDdpBuckets, bucketsValue(*buckets));
    return encodeSnapshot(snap);
  }

  // The collectives a replacement and the survivors run together once the group re-formed: agree on
  // the newest state any rank holds (`heldStep`: this rank's global step, -1 for none), the lowest
  // such rank sends it to all, DDP joins the new group with its bucket layout. False when no rank
  // holds any state (every rank is new): the caller resumes from the snapshot files instead.
  bool joinWithState(std::int64_t heldStep, std::optional<std::vector<std::vector<size_t>>> buckets) {
    // One MAX over (global step, epoch counted, lowest rank): the newest state, where an epoch's end
    // counted by epochDone() comes after the same step before it, and among its holders the lowest rank.
    const std::int64_t counted = heldStep >= 0 && stepInEpoch == 0 && epoch > 0 ? 1 : 0;
    const std::int64_t mine = heldStep < 0 ? -1 : (heldStep * 2 + counted) * world + (world - 1 - rank);
    std::int64_t code = -1;
    try {
      std::vector<at::Tensor> t{torch::tensor({mine}, torch::kInt64).to(commDevice())};
      c10d::AllreduceOptions max;
      max.reduceOp = c10d::ReduceOp::MAX;
      group->allreduce(t, max)->wait();
      code = t[0].cpu().item<std::int64_t>();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throwCollectiveFailure(e, "in-place recovery (agreeing on the newest state)");
    }
    if (code < 0) {
      if (ddp) ddp->rejoin(group, std::nullopt);
      return false;
    }
    const int donor = world - 1 - static_cast<int>(code % world);
    std::vector<char> bytes;
    if (rank == donor) bytes = encodeState(buckets);
    try {
      std::vector<at::Tensor> size{torch::tensor({static_cast<std::int64_t>(bytes.size())}, torch::kInt64).to(commDevice())};
      c10d::BroadcastOptions from;
      from.rootRank = donor;
      group->broadcast(size, from)->wait();
      const std::int64_t n = size[0].cpu().item<std::int64_t>();
      if (n <= 0) throw DistributedError("rank " + std::to_string(donor) + " sent an empty training state");
      auto payload = rank == donor ? torch::from_blob(bytes.data(), {n}, torch::kUInt8).clone() : torch::empty({n}, torch::kUInt8);
      std::vector<at::Tensor> data{payload.to(commDevice())};
      group->broadcast(data, from)->wait();
      if (rank != donor) {
        const auto cpu = data[0].cpu().contiguous();
        bytes.assign(reinterpret_cast<const char*>(cpu.data_ptr<std::uint8_t>()),
                     reinterpret_cast<const char*>(cpu.data_ptr<std::uint8_t>()) + n);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throwCollectiveFailure(e, "receiving the training state from rank " + std::to_string(donor));
    }
    if (rank != donor) {
      const Snapshot snap = decodeSnapshot(bytes, "rank " + std::to_string(donor) + "'s training state");
      buckets = bucketsOf(snap);
      restore(snap, /*rng=*/false);
      savedAt = -1;  // nothing on disk holds this point
    } else if (sampler) {
      // As on the ranks that restored it: the loop's setEpoch(epoch) keeps this position.
      sampler->loadState(sampler->state());
    }
    if (ddp) ddp->rejoin(group, buckets);
    say("in-place recovery: continuing from " + describePoint(epoch, stepInEpoch, globalStep) + " with rank " +
        std::to_string(donor) + "'s state (group generation " + std::to_string(groupGeneration()) + ")");
    commit();
    seedStep();
    return true;
  }

  // Where an in-place recovery left this rank (the state came from memory, step for step).
  ResumePoint pointFromMemory(const std::string& what) const {
    ResumePoint point;
    point.resumed = true;
    point.exact = true;
    point.epoch = epoch;
    point.stepInEpoch = stepInEpoch;
    point.globalStep = globalStep;
    point.message = what + describePoint(epoch, stepInEpoch, globalStep);
    return point;
  }

  // ---- resuming --------------------------------------------------------------------------------
  struct Found {
    std::optional<Snapshot> snapshot;
    std::vector<SkippedSnapshot> skipped;
  };

  Found loadSlot(const std::filesystem::path& path, const LoadNewestOptions& load, bool allowNothingValid) {
    auto search = loadNewestValid(path, load);
    if (!search.skipped.empty()) say("resume: " + search.describeSkipped());
    if (!search.snapshot && !search.skipped.empty() && !allowNothingValid)
      throw ResumeRefused("no usable snapshot in " + path.string() + " (" + search.describeSkipped() +
                          "); remove the files, or start over from scratch");
    return Found{std::move(search.snapshot), std::move(search.skipped)};
  }

  // The snapshot to continue from (every rank reads the files itself); `unusable` gets the slot
  // files that were skipped as damaged.
  std::optional<Snapshot> chooseResumeSource(ResumePoint& point, std::vector<SkippedSnapshot>& unusable) {
    if (!o.resume()) {
      point.message = "resuming is off: starting from scratch";
      return std::nullopt;
    }
    LoadNewestOptions load;
    load.expect.modelName = o.runName();  // another model's state never fits: always refused
    if (!o.allowConfigChange()) load.expect.config = o.config();
    Found newest;
    if (o.resumeFrom()) newest.snapshot = loadSnapshot(*o.resumeFrom(), load.expect);
    else newest = loadSlot(slot, load, /*allowNothingValid=*/false);
    unusable = newest.skipped;

    std::optional<SnapshotPoint> newestPoint, boundaryPoint;
    if (newest.snapshot) newestPoint = pointOf(*newest.snapshot);
    Found boundary;
    if (needsEpochBoundary(newestPoint, world)) {
      boundary = loadSlot(boundarySlot, load, /*allowNothingValid=*/true);
      unusable.insert(unusable.end(), boundary.skipped.begin(), boundary.skipped.end());
      if (boundary.snapshot) boundaryPoint = pointOf(*boundary.snapshot);
    }
    const ResumePlan plan = planResume(newestPoint, boundaryPoint, world, boundarySlot);
    point.message = plan.message;
    point.exact = plan.exact;
    switch (plan.source) {
      case ResumeSource::kNone: return std::nullopt;
      case ResumeSource::kNewest: return std::move(newest.snapshot);
      case ResumeSource::kBoundary: return std::move(boundary.snapshot);
    }
    return std::nullopt;
  }

  // `rng`: the generator states too (from a file; a state sent in place carries the sender's only,
  // and each rank keeps its own).
  void restore(const Snapshot& snap, bool rng = true) {
    RestoreOptions restore;
    restore.rng = rng && !o.stepSeed();
    restore.rank = rank;
    restoreSnapshot(snap, TrainingObjects{model, optimizer, sampler}, restore);
    if (schedulerLoad) schedulerLoad(snap.schedulerState);
    for (const auto& item : items) item.load(snap.userState);
    const SnapshotPoint p = pointOf(snap);
    epoch = p.epochsRun;
    stepInEpoch = p.stepInEpoch;
    globalStep = p.globalStep;
    // What this process would save now is what the file holds.
    savedAt = globalStep;
    savedBoundary = stepInEpoch == 0;
  }
};

ResilientTraining::ResilientTraining(ResilienceOptions options) : impl_(std::make_unique<Impl>()) {
  options.validate();
  Impl& s = *impl_;
  s.o = std::move(options);
  s.group = s.o.processGroup() ? s.o.processGroup() : getDefaultGroup();
  s.rank = s.group->getRank();
  s.world = s.group->getSize();
  s.nccl = s.o.processGroup() ? s.group->getBackendName() == "nccl" : getBackendName() == "nccl";
  s.slot = s.o.snapshotPath();
  s.boundarySlot = boundarySlotFor(s.slot);
  s.writer = std::make_unique<SnapshotWriter>(s.o.backgroundWrite());
  s.inPlace = s.o.inPlaceRecovery() && !s.o.processGroup() && inPlaceRecoveryEnabled();
  if (s.o.handleSignals()) installStopHandlers();
}

ResilientTraining::~ResilientTraining() = default;

ResilientTraining& ResilientTraining::trackModule(torch::nn::Module& module, detail::DDPCore* ddp) {
  if (impl_->model) throw ConfigError("ResilientTraining: a model is already registered (one model per run)");
  impl_->model = &module;
  impl_->ddp = ddp;
  return *this;
}

ResilientTraining& ResilientTraining::track(torch::optim::Optimizer& optimizer) {
  if (impl_->optimizer) throw ConfigError("ResilientTraining: an optimizer is already registered (one per run)");
  impl_->optimizer = &optimizer;
  return *this;
}

ResilientTraining& ResilientTraining::track(DistributedSampler& sampler) {
  if (impl_->sampler) throw ConfigError("ResilientTraining: a sampler is already registered (one per run)");
  impl_->sampler = &sampler;
  return *this;
}

ResilientTraining& ResilientTraining::trackScheduler(std::function<ItemDict()> save,
                                                     std::function<void(const ItemDict&)> load) {
  if (impl_->schedulerSave) throw ConfigError("ResilientTraining: a scheduler is already registered (one per run)");
  if (!save || !load) throw ConfigError("ResilientTraining::trackScheduler needs both a save and a load function");
  impl_->schedulerSave = std::move(save);
  impl_->schedulerLoad = std::move(load);
  return *this;
}

ResilientTraining& ResilientTraining::track(torch::optim::LRScheduler& scheduler) {
  torch::optim::LRScheduler* s = &scheduler;
  return trackScheduler(
      [s] {
        ItemDict d = newItemDict();
        d.insert("last_epoch", static_cast<std::int64_t>(SchedulerAccess::stepCount(*s)));
        return d;
      },
      [s](const ItemDict& d) {
        if (!d.contains("last_epoch") || !d.at("last_epoch").isInt())
          throw ConfigError("the snapshot's LR_SCHEDULER_STATE has no step count (last_epoch): it was saved by "
                            "another kind of scheduler");
        const auto count = d.at("last_epoch").toInt();
        if (count < 0) throw ConfigError("the snapshot's scheduler step count is negative: " + std::to_string(count));
        SchedulerAccess::stepCount(*s) = static_cast<unsigned>(count);
      });
}

ResilientTraining& ResilientTraining::trackItems(std::function<void(ItemDict&)> save,
                                                 std::function<void(const ItemDict&)> load) {
  if (!save || !load) throw ConfigError("ResilientTraining::trackItems needs both a save and a load function");
  impl_->items.push_back(Impl::Items{std::move(save), std::move(load)});
  return *this;
}

ResilientTraining& ResilientTraining::track(amp::GradScaler& scaler) {
  auto* s = &scaler;
  return trackItems([s](ItemDict& d) { s->saveTo(d); }, [s](const ItemDict& d) { s->loadFrom(d); });
}

ResilientTraining& ResilientTraining::track(const std::string& name, std::function<c10::IValue()> save,
                                            std::function<void(const c10::IValue&)> load) {
  if (name.empty()) throw ConfigError("ResilientTraining::track: the name of a value is empty");
  if (name == kEpochComplete || name == kDdpBuckets)
    throw ConfigError("ResilientTraining::track: '" + name + "' is a name the library keeps for itself");
  for (const auto& n : impl_->names)
    if (n == name) throw ConfigError("ResilientTraining::track: '" + name + "' is registered twice");
  if (!save || !load) throw ConfigError("ResilientTraining::track('" + name + "'): needs a save and a load function");
  impl_->names.push_back(name);
  return trackItems([name, save](ItemDict& d) { d.insert(name, save()); },
                    [name, load](const ItemDict& d) {
                      if (d.contains(name)) load(d.at(name));
                    });
}

ResilientTraining& ResilientTraining::track(const std::string& name, double& value) {
  double* v = &value;
  return track(name, [v] { return c10::IValue(*v); },
               [v, name](const c10::IValue& x) {
                 if (!x.isDouble() && !x.isInt())
                   throw ConfigError("the snapshot's USER_STATE['" + name + "'] is not a number");
                 *v = x.isDouble() ? x.toDouble() : static_cast<double>(x.toInt());
               });
}

ResilientTraining& ResilientTraining::track(const std::string& name, std::int64_t& value) {
  std::int64_t* v = &value;
  return track(name, [v] { return c10::IValue(*v); },
               [v, name](const c10::IValue& x) {
                 if (!x.isInt()) throw ConfigError("the snapshot's USER_STATE['" + name + "'] is not an integer");
                 *v = x.toInt();
               });
}

ResilientTraining& ResilientTraining::track(const std::string& name, at::Tensor& value) {
  at::Tensor* v = &value;
  return track(name, [v] { return c10::IValue(v->defined() ? v->detach().to(torch::kCPU).clone() : at::Tensor()); },
               [v, name](const c10::IValue& x) {
                 if (!x.isTensor()) throw ConfigError("the snapshot's USER_STATE['" + name + "'] is not a tensor");
                 const auto t = x.toTensor();
                 if (v->defined() && t.defined()) {
                   if (v->sizes() != t.sizes() || v->scalar_type() != t.scalar_type())
                     throw ConfigError("the snapshot's USER_STATE['" + name + "'] has another shape or dtype than the "
                                       "registered tensor");
                   torch::NoGradGuard noGrad;
                   v->copy_(t);
                 } else {
                   *v = t;
                 }
               });
}

ResumePoint ResilientTraining::resume() {
  Impl& s = *impl_;
  if (s.resumed) throw ConfigError("ResilientTraining::resume() called twice");
  if (!s.model) throw ConfigError("ResilientTraining: register the model (track(ddp) or track(model)) before resume()");
  s.resumed = true;
  ResumePoint point;
  if (detail::joiningInPlace()) {
    // A replacement: the survivors send the state they hold (no snapshot is read). A new rank 0
    // takes the slot's lock over from the one it replaces (gone, so the lock is free).
    std::string holder;
    if (s.rank == 0 && !s.lockSlot(holder))
      std::cerr << s.o.programName() << ": warning: snapshot slot " << s.slot.string() << " is locked by " << holder
                << std::endl;
    const bool joined = s.joinWithState(-1, std::nullopt);
    detail::joinedInPlace();
    if (joined) return s.pointFromMemory("joined the running group in place of a failed rank at ");
  }
  // One job per slot: rank 0 locks it before reading it; a slot in use is refused on every rank
  // (agreed below) before anything is read, rotated or set aside.
  std::string holder;
  const bool slotBusy = s.rank == 0 && !s.lockSlot(holder);
  if (s.allReduce({slotBusy ? 1.0 : 0.0}, c10d::ReduceOp::MAX, "resume (the slot's lock)")[0] > 0)
    s.refuseBusySlot(holder);
  std::vector<SkippedSnapshot> unusable;
  const std::optional<Snapshot> snap = s.chooseResumeSource(point, unusable);
  // DDP first: the bucket layout the snapshot's run reduced with (and gradients defined, for
  // gradientAsBucketView) before any forward of this process.
  if (s.ddp) s.ddp->resetReducer(snap ? bucketsOf(*snap) : std::nullopt);
  if (snap) {
    try {
      s.restore(*snap);
    } catch (const SnapshotIncompatible& e) {
      // Said before anything claims to resume: the model (or another tracked object) no longer
      // fits the snapshot, and what the loop can do about it.
      throw SnapshotIncompatible(e.file(), e.differences(),
                                 "to go on: ResilienceOptions::resume(false) starts over (the next save replaces "
                                 "the slot), resumeFrom(<file>) continues from another snapshot, or another "
                                 "snapshotPath keeps this one");
    }
    point.resumed = true;
    point.file = snap->source;
  }
  // Only now that the state is restored: "resuming ... exactly where it stopped" is true.
  s.say("resume: " + point.message);
  point.epoch = s.epoch;
  point.stepInEpoch = s.stepInEpoch;
  point.globalStep = s.globalStep;

  // Every rank read the files itself: all must stand at the same step. A stop requested while
  // starting up is agreed here too.
  const double g = static_cast<double>(s.globalStep);
  const auto agreed = s.allReduce({g, -g, s.stopFlag()}, c10d::ReduceOp::MAX, "resume");
  if (agreed[0] != -agreed[1])
    throw DistributedError("ranks resumed from different points (global steps " + std::to_string(-agreed[1]) + " to " +
                           std::to_string(agreed[0]) + "): every rank must see the same snapshot files (a shared file system)");
  if (agreed[2] > 0) {
    s.stop = true;
    s.status = TrainingStatus::kStopped;
    s.say("stopped on request before the first step; nothing new to save; run the same command again to start (exit code " +
          std::to_string(contract::kExitPreempted) + ")");
  }
  // Damaged files are set aside now that every rank has read the slot: left in place, the next save
  // would rotate one into the place of a good fallback.
  if (s.rank == 0)
    for (const auto& line : setAsideSkipped(unusable)) s.say("resume: " + line);
  s.commit();
  s.seedStep();
  return point;
}

bool ResilientTraining::stepDone() {
  std::vector<double> none;
  // One rank has nobody to agree with: its own stop flag is read at once.
  return impl_->o.overlapAgreement() && impl_->world > 1 ? finishStep(StopAgreement::kOverlapped, nullptr)
                                                         : finishStep(StopAgreement::kNow, &none);
}

bool ResilientTraining::stepDone(std::vector<double>& sums) { return finishStep(StopAgreement::kNow, &sums); }

bool ResilientTraining::finishStep(StopAgreement agreement, std::vector<double>* sums) {
  if (agreement == StopAgreement::kNow && !sums) throw std::logic_error("finishStep: an agreement now needs sums");
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before the first step");
  s.checkFinished("stepDone");
  if (s.stop) return true;  // stopped at start-up (or the loop went on after a stop): nothing new is saved
  // A bucket regrouping due after this process's first step happens now rather than in the next
  // forward, so that a snapshot of this step records the layout the next step uses.
  if (s.ddp) s.ddp->rebuildBuckets();
  ++s.stepInEpoch;
  ++s.globalStep;
  s.phase = Impl::Phase::kStepAgreement;
  // The previous step's agreement, when it was left running (long finished by now, unless a rank
  // is slower): a stop asked before that step ends the run at this one.
  Impl::Vote vote = s.finishAgreement();
  if (agreement == StopAgreement::kNow) {
    std::vector<double> values{s.stopFlag(), s.writeFlag()};
    values.insert(values.end(), sums->begin(), sums->end());
    values = s.allReduce(std::move(values), c10d::ReduceOp::SUM, "step " + std::to_string(s.globalStep));
    std::copy(values.begin() + 2, values.end(), sums->begin());
    vote.stop = vote.stop || values[0] > 0;
    vote.writeFailed = vote.writeFailed || values[1] > 0;
  }
  // A failed snapshot write stops every rank here: no training on without snapshots.
  if (vote.writeFailed) s.throwWriteFailed();
  const bool stopAgreed = vote.stop;
  if (stopAgreed) {
    s.stop = true;
    return s.stopHere();
  }
  if (agreement == StopAgreement::kOverlapped) s.startAgreement();
  const bool epochEnds = s.sampler && s.sampler->exhausted();  // epochDone() saves that one
  if (s.o.saveEverySteps() > 0 && s.globalStep % s.o.saveEverySteps() == 0 && !epochEnds)
    s.save(Impl::Kind::kMidEpoch, {}, Impl::Targets::kSlotAndExtras);
  s.commit();
  s.seedStep();
  return false;
}

bool ResilientTraining::epochDone(const SaveExtras& extras) {
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before the first step");
  s.checkFinished("epochDone");
  if (s.stop) return true;
  ++s.epoch;
  s.stepInEpoch = 0;
  s.phase = Impl::Phase::kEpochAgreement;
  const Impl::Vote vote = s.finishAgreement();  // the epoch's last step's, when left running
  const bool due = extras.force || s.o.saveEverySteps() > 0 ||
                   (s.o.saveEveryEpochs() > 0 && s.epoch % s.o.saveEveryEpochs() == 0);
  if (due) s.save(Impl::Kind::kEpochBoundary, extras, Impl::Targets::kSlotAndExtras);
  else if (!extras.alsoWriteTo.empty()) s.save(Impl::Kind::kEpochBoundary, extras, Impl::Targets::kExtrasOnly);
  // A stop requested during the evaluation (or the last step's agreement) ends the run here; a
  // failed snapshot write stops every rank with WriteFailed.
  const auto agreed = s.allReduce({s.stopFlag(), s.writeFlag()}, c10d::ReduceOp::SUM, "end of epoch " + std::to_string(s.epoch));
  if (agreed[1] > 0 || vote.writeFailed) s.throwWriteFailed();
  if (agreed[0] > 0 || vote.stop) {
    s.stop = true;
    return s.stopHere();
  }
  s.commit();
  s.seedStep();
  return false;
}

ResumePoint ResilientTraining::recover() {
  Impl& s = *impl_;
  const std::exception_ptr failure = std::current_exception();
  if (!failure) throw ConfigError("ResilientTraining::recover() must be called while handling the exception of a failed step");
  if (!s.inPlace || !s.resumed || s.status != TrainingStatus::kRunning || s.stop) std::rethrow_exception(failure);
  std::string cause;
  bool communication = false;
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    // Gloo's and the Reducer's own errors reach the loop through autograd as c10::Error.
    communication = isLostPeer(e);
    cause = detail::messageOf(e);
  } catch (...) {
  }
  if (!communication) std::rethrow_exception(failure);
  std::cerr << s.o.programName() << ": rank " << s.rank << "/" << s.world << ": in-place recovery after: " << cause
            << std::endl;
  s.settleAfterFailure();
  s.pending.reset();  // an agreement left running on the failed group ends with it (a stop signal is asked again)
  // Every reference to the failed group goes, so that its connections close now (peers still waiting
  // on this rank fail at once and come to re-form too).
  std::optional<std::vector<std::vector<size_t>>> buckets;
  if (s.ddp) {
    buckets = s.ddp->bucketAssignment();
    s.ddp->releaseGroup();
  }
  s.group.reset();
  s.group = reformProcessGroup();
  s.joinWithState(s.globalStep, buckets);
  return s.pointFromMemory("recovered in place at ");
}

bool ResilientTraining::canRecoverInPlace() const { return impl_->inPlace; }

void ResilientTraining::save(const SaveExtras& extras) {
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before save()");
  s.checkFinished("save");
  if (s.stop) throw ConfigError("ResilientTraining::save() after the run stopped on request: return exitCode() from the loop");
  s.save(s.currentKind(), extras, Impl::Targets::kSlotAndExtras);
}

void ResilientTraining::wait() { impl_->writer->wait(); }

int ResilientTraining::finish() {
  Impl& s = *impl_;
  if (!s.resumed) throw ConfigError("ResilientTraining: call resume() before finish()");
  s.checkFinished("finish");
  if (s.stop) return s.writer->wait(), contract::kExitPreempted;  // stopped at start-up: nothing to save
  // The last step's agreement, when left running: the training is complete, so a stop asked during
  // that step changes nothing (the final state is saved and the run ends with 0).
  s.finishAgreement();
  const bool scheduled = s.o.saveEverySteps() > 0 || s.o.saveEveryEpochs() > 0;
  if (scheduled && !s.saved()) s.save(s.currentKind(), {}, Impl::Targets::kSlotAndExtras);
  s.settleWrites("the final barrier");  // nobody exits before rank 0's snapshot is durable (or failed)
  s.status = TrainingStatus::kFinished;
  return contract::kExitSuccess;
}

std::int64_t ResilientTraining::epoch() const { return impl_->epoch; }
std::int64_t ResilientTraining::stepInEpoch() const { return impl_->stepInEpoch; }
std::int64_t ResilientTraining::globalStep() const { return impl_->globalStep; }
bool ResilientTraining::stopRequested() const { return impl_->stop; }
int ResilientTraining::stopSignal() const { return ctorch::stopSignal(); }
TrainingStatus ResilientTraining::status() const { return impl_->status; }
int ResilientTraining::exitCode() const {
  return impl_->stop ? contract::kExitPreempted : contract::kExitSuccess;
}
const ResilienceOptions& ResilientTraining::options() const { return impl_->o; }

} // namespace ctorch
