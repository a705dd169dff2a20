// Fault tolerance for any training loop: register the loop's objects once, call resume() before the
// first step and stepDone() after each, and the run survives being killed at any moment: it saves
// crash-safe snapshots on a schedule and when a stop signal arrives (all ranks agree on the step,
// then exit contract::kExitPreempted = 75 so ctorchrun / Slurm requeue it), and a restarted process
// continues from the newest valid snapshot bit-identically. docs/resilience.md has the whole story.
//
//   ctorch::installStopHandlers();                              // first thing in main: a stop during start-up is 75 too
//   ...init_process_group, model, DDP, optimizer, sampler...
//   ctorch::ResilientTraining training(ctorch::ResilienceOptions().snapshotPath("run/snapshot.pt").saveEverySteps(200));
//   training.track(ddp).track(optimizer).track(sampler).track(scheduler).track("best_loss", bestLoss);
//   const ctorch::ResumePoint start = training.resume();       // restores everything
//   if (training.stopRequested()) return training.exitCode();  // a stop during start-up: 75, nothing saved
//   for (int64_t epoch = start.epoch; epoch < epochs; ++epoch) {
//     sampler.setEpoch(epoch);                                  // keeps a restored mid-epoch position
//     while (!sampler.exhausted()) {
//       ...one optimizer step...
//       if (training.stepDone()) return training.exitCode();   // saved; 75 after a stop signal
//     }
//     scheduler.step();
//     if (training.epochDone()) return training.exitCode();
//   }
//   return training.finish();
//
// resume(), stepDone(), epochDone(), save() and finish() are collectives: every rank calls them at the
// same point of the loop. Tracked values are captured inside stepDone()/epochDone(): update them
// before the call. Every rank restores rank 0's snapshot: a tracked value must be the same on every
// rank (a rank-local value would come back as rank 0's); per-rank randomness is handled by the
// library (gathered generator states, or stepSeed).
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/sampler.hpp"
#include "ctorch/snapshot.hpp"
#include "ctorch/stateful.hpp"
#include "ctorch/stop_signal.hpp"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class LRScheduler;
}

namespace ctorch {

namespace detail {
class TrackedState;
}
namespace amp {
class GradScaler;
}

struct ResilienceOptions {
  using ConfigMap = std::map<std::string, std::string>;

  // The snapshot slot: path holds the newest snapshot, path.1 .. path.K the previous ones, and
  // <stem>-epoch<ext> (run/snapshot-epoch.pt) the newest epoch boundary, which a run with another
  // world size resumes from. Only rank 0 writes; every rank reads (a shared file system).
  TORCH_ARG(std::filesystem::path, snapshotPath) = "snapshot.pt";
  // A snapshot every N optimizer steps (0: none between epoch ends).
  TORCH_ARG(std::int64_t, saveEverySteps) = 0;
  // A snapshot every N epochs, at epochDone() (0: none there, unless saveEverySteps is on, which also
  // saves every epoch boundary). A stop signal always saves; finish() saves the final state when
  // either schedule is on.
  TORCH_ARG(std::int64_t, saveEveryEpochs) = 1;
  // Older snapshots kept next to the newest (path.1 .. path.K): fallbacks when the newest is damaged.
  TORCH_ARG(int, keepPrevious) = 2;
  // false: start from scratch whatever the slot holds (the next save replaces it).
  TORCH_ARG(bool, resume) = true;
  // Resume from this file instead of the newest valid snapshot in the slot.
  TORCH_ARG(std::optional<std::filesystem::path>, resumeFrom);
  // What makes a snapshot this run's: a snapshot of another runName is always refused; one of another
  // config (hyper-parameters, data: anything that must not change silently) is refused listing each
  // difference unless allowConfigChange, which continues from its state with this run's settings.
  TORCH_ARG(std::string, runName) = "model";
  TORCH_ARG(ConfigMap, config);
  TORCH_ARG(bool, allowConfigChange) = false;
  // Optimizer steps in one epoch at this world size (the loader's length), when known: a snapshot of
  // this run's config and world size claiming more steps into an epoch is impossible, and is skipped
  // (and set aside) like a damaged one. Unset: not checked; ignored with allowConfigChange.
  TORCH_ARG(std::optional<std::int64_t>, stepsPerEpoch);
  // Set: before every step the global generator is seeded from (stepSeed, rank, global step) (when
  // resume(), stepDone() and epochDone() return), so a step's randomness (dropout) does not depend on
  // how the run got there. Unset: every rank's generator states are gathered into each snapshot and
  // restored on resume (one small allgather per save).
  TORCH_ARG(std::optional<std::uint64_t>, stepSeed);
  // Installs the stop-signal handlers (SIGTERM, SIGUSR1, SIGINT; see stop_signal.hpp). Call
  // ctorch::installStopHandlers() yourself at the top of main as well: before it, such a signal
  // during the rendezvous or the model's set-up ends the process instead of asking it to stop.
  TORCH_ARG(bool, handleSignals) = true;
  // Snapshots are encoded and written on a background thread while training goes on (the step pays
  // only for a copy of the state); false: written before stepDone() returns.
  TORCH_ARG(bool, backgroundWrite) = true;
  // Rank 0 copies the model and optimizer state into buffers kept from the previous save (when
  // its write has finished) instead of fresh memory: no page faults and no zeroing at the step
  // that saves. Costs one snapshot's worth of memory held between saves; false frees it.
  TORCH_ARG(bool, reuseCaptureBuffers) = true;
  // A "snapshot written" line for every save. false: only for the saves at an epoch's end and for a
  // stop's (saveEverySteps(10) would otherwise print a line every 10 steps); a failed write is always said.
  TORCH_ARG(bool, logEverySave) = false;
  // Rank 0's progress lines (resume decisions, snapshots written, stops). Unset: stderr.
  TORCH_ARG(std::function<void(const std::string&)>, log);
  // Names the program on stderr lines: every rank's stop line, a failed write, the default log.
  TORCH_ARG(std::string, programName) = "ctorch";
  // The group the agreements run over. Unset: the default group (ctorch::initProcessGroup()).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, processGroup);
  // Under ctorchrun --recovery in-place (and with the default group): recover() re-forms the group
  // with the replacement of a failed rank and continues from the last completed step in memory.
  // false: recover() rethrows, and the launcher's replacement of a failed rank ends in a restart of
  // every rank from the snapshot.
  TORCH_ARG(bool, inPlaceRecovery) = true;
  // Copies of each rank's shard kept in another rank's memory, for in-place recovery of a sharded run
  // (ZeroRedundancyOptimizer, FullyShardedDataParallel on the default group). 1: at every agreed
  // step each rank sends its shard (parameters and optimizer state) to the next rank (ring buddy),
  // which keeps it; when a rank is lost its replacement takes its shard from that neighbour while the
  // survivors keep theirs: no file is read and no step is redone. Costs one more shard of memory per
  // rank and one shard sent per step (docs/sharding.md). A loss the copies cannot cover (two
  // neighbours at once, a failure after a step's update and before its copy arrived) reloads every
  // rank from the snapshot files, in place. 0: a lost rank of a sharded run restarts the group.
  TORCH_ARG(int, shardCopies) = 0;
  // How stepDone() (without sums) agrees on a stop. true: it starts the step's small allreduce and
  // reads its result at the next stepDone() (or epochDone(), finish()), so the ranks meet only in the
  // step's own collectives (DDP's gradients), not once more after every step; a stop signal then
  // ends the run one step later, still at a step every rank agreed on and saved exactly
  // (MNIST CNN, 2 ranks on 2 cores: 4-7 % more samples/s). false: every rank waits for the
  // agreement of this step before stepDone() returns. stepDone(sums) always agrees at once (it
  // returns the sums); at any one step every rank must call the same overload.
  TORCH_ARG(bool, overlapAgreement) = true;

 public:
  // Throws ConfigError naming the bad value.
  void validate() const;
};

// Where resume() left the run: continue with epoch `epoch`, whose first `stepInEpoch` steps are done
// (the sampler already stands after them).
struct ResumePoint {
  bool resumed = false;           // state restored from `file`
  bool exact = false;             // continues step for step (same world size)
  std::filesystem::path file;
  std::int64_t epoch = 0;         // completed epochs: the epoch to run now
  std::int64_t stepInEpoch = 0;
  std::int64_t globalStep = 0;
  std::string message;            // one line: what was done and why
};

// How ctorch's messages name a point of training, in the numbers ResilientTraining's epoch(),
// stepInEpoch() and globalStep() return (epochs completed, steps done in the current one):
// "1 epoch + 7 steps (global step 23)", "2 epochs (global step 32)", "7 steps (global step 7)".
std::string describeProgress(std::int64_t epochsDone, std::int64_t stepsInEpoch, std::int64_t globalStep);

// Extra files and work for one save (e.g. a checkpoint_epoch_N.pt copy and pruning old ones).
struct SaveExtras {
  bool force = false;                           // save even when no schedule asks for it
  std::vector<std::filesystem::path> alsoWriteTo;  // the same snapshot, each file alone (no kept copies)
  std::function<void()> afterWrite;             // on rank 0's writer thread, once the files are durable
};

enum class TrainingStatus {
  kRunning,
  kStopped,   // a stop signal: every rank saved this step and should exit with exitCode() (75)
  kFinished,  // finish() returned
};

// The shards a sharded run (ZeRO, FSDP, a parameter server) wrote for `snapshotFile`
// ("<file>.shards/rank<r>.pt"; "<file>.optim-rank<r>" beside it from ctorch before issue 42), every
// rank's that exists, by rank. docs/snapshot.md.
std::vector<std::filesystem::path> snapshotShardFiles(const std::filesystem::path& snapshotFile);
// Removes a snapshot file with its shards (and their folder once empty): for a loop that removes its
// own extra copies. What is not there is not an error.
void removeSnapshotFiles(const std::filesystem::path& snapshotFile);

// Rank 0 writes, every rank restores. Not copyable; one per training run.
class ResilientTraining {
 public:
  explicit ResilientTraining(ResilienceOptions options = {});
  ~ResilientTraining();  // waits for a write in flight (a failure is reported, not thrown)
  ResilientTraining(const ResilientTraining&) = delete;
  ResilientTraining& operator=(const ResilientTraining&) = delete;

  // ---- what a snapshot holds; register before resume()
  // A training object with state of its own (ctorch/stateful.hpp), each described in its header:
  //  - DistributedDataParallel: the model behind it, and DDP's bucket layout (restored so that a
  //    resumed run reduces in the same order: bit-identical with more than two ranks);
  //  - FullyShardedDataParallel (hybrid too): every rank writes its shards of the parameters and of
  //    the tracked optimizer's state (built over fsdp.parameters()) in each snapshot's shard folder
  //    ("<file>.shards/rank<r>.pt"; the snapshot itself holds neither); a resume reshards them when
  //    the world size changed;
  //  - ZeroRedundancyOptimizer, ParameterServer: the optimizer, its state in the ranks' shard files,
  //    resharded on resume (track the model too, on every rank: a parameter server's workers hold
  //    the current weights; docs/parameter-server.md);
  //  - a PipelineSchedule: its stage's parameters, buffers and the tracked optimizer's state (built
  //    over the stage's parameters), layout and step count in every rank's shard file; a resume
  //    takes each rank's stage from its own shard or another replica's; another number of stages
  //    or another partition is refused, naming both;
  //  - or a user's own Stateful.
  // In-place recovery follows a re-formed group only where every object can (whyNotInPlace());
  // a sharded run also needs ResilienceOptions::shardCopies, else a lost rank's shard comes back
  // from the files with a group restart.
  ResilientTraining& track(Stateful& object);
  // A model trained without DDP: a module holder (TORCH_MODULE) or a torch::nn::Module.
  template <typename M, typename = std::enable_if_t<std::is_base_of_v<torch::detail::ModuleHolderIndicator, M>>>
  ResilientTraining& track(M& holder) {
    return track(*holder.ptr());
  }
  ResilientTraining& track(torch::nn::Module& module);
  // SGD, Adam, AdamW, RMSprop, Adagrad: state and hyper-parameters (the learning rate included).
  ResilientTraining& track(torch::optim::Optimizer& optimizer);
  ResilientTraining& track(DistributedSampler& sampler);
  // LibTorch's schedulers (StepLR, ...): their step count, in LR_SCHEDULER_STATE.
  ResilientTraining& track(torch::optim::LRScheduler& scheduler);
  // Any other scheduler: its state as a dict of plain values, in LR_SCHEDULER_STATE.
  ResilientTraining& trackScheduler(std::function<ItemDict()> save, std::function<void(const ItemDict&)> load);
  // The loop's own values, in USER_STATE[name] (Python reads them as plain numbers and tensors).
  ResilientTraining& track(const std::string& name, double& value);
  ResilientTraining& track(const std::string& name, std::int64_t& value);
  ResilientTraining& track(const std::string& name, at::Tensor& value);  // saved as a CPU copy
  // Mixed precision's loss scale and growth count (amp.hpp), in USER_STATE ("amp_scale",
  // "amp_growth_tracker"), so a resumed float16 run goes on with the same scale.
  ResilientTraining& track(amp::GradScaler& scaler);
  // Several entries at once, straight into USER_STATE (load gets the whole dict).
  ResilientTraining& trackItems(std::function<void(ItemDict&)> save, std::function<void(const ItemDict&)> load);
  // A number each rank has its own of (a rank's running loss sum not summed over the ranks yet):
  // every rank's value is saved, USER_STATE[name] = [rank 0's, rank 1's, ...] (one small allreduce
  // per save gathers them), and each rank gets its own back under the same world size; `load` gets
  // nullopt otherwise (another world size, an older snapshot, a state sent in place). The values
  // the other track() calls save are rank 0's, which every rank restores.
  ResilientTraining& trackPerRank(const std::string& name, std::function<double()> save,
                                  std::function<void(std::optional<double>)> load);
  // Anything else: `save` returns a value (numbers, strings, tensors, lists and dicts of them);
  // `load` gets it back (not called when a snapshot lacks the name: a snapshot of an older loop).
  // `check`, when given, is called on the file's value while the snapshot is chosen, before anything
  // is restored: what it throws sets the file aside like a damaged one, and the next one resumes
  // (the typed track() calls above check their kind so).
  ResilientTraining& track(const std::string& name, std::function<c10::IValue()> save,
                           std::function<void(const c10::IValue&)> load,
                           std::function<void(const c10::IValue&)> check = {});

  // ---- the loop
  // Finds the newest valid snapshot (damaged files are named, skipped and set aside as
  // <file>.unusable; one of another run or configuration is refused with SnapshotIncompatible),
  // decides how to continue (resume_plan.hpp: exactly under the same world size, at an epoch
  // boundary under another), restores every registered object and checks that all ranks stand at
  // the same step. A stop requested during start-up makes stopRequested() true at once (and every
  // later stepDone()/epochDone() true and finish() 75, without saving anything).
  ResumePoint resume();
  // After each optimizer step, once the loop has updated what it tracks (a snapshot taken here holds
  // the values as they are now): counts it, agrees with the other ranks on whether to stop (one small
  // allreduce; with overlapAgreement, the default, stepDone() leaves it running and reads it at the
  // next call: a stop asked during step N ends the run after step N + 1), saves when due. Returns
  // true when the loop must end: a stop signal was agreed and the snapshot of exactly this step is
  // durable; return exitCode() then. A snapshot write that failed on rank 0 (a full disk, EIO) is
  // part of the same vote: every rank throws ctorch::WriteFailed at the same step (one or two steps
  // after the failure; the files written before stay intact), whose exit code is
  // contract::kExitWriteFailed (74); epochDone() and finish() do the same. `sums` are summed over the
  // ranks in this step's allreduce (e.g. the loss), which every rank then waits for: a loop that
  // logs every K steps passes them at those steps only, and calls stepDone() at the others.
  bool stepDone();
  bool stepDone(std::vector<double>& sums);
  // After an epoch's last step and its evaluation: counts the epoch, saves the epoch-boundary
  // snapshot when due, and agrees on a stop that came during the evaluation. Returns true when the
  // loop must end (snapshot durable; return exitCode()).
  bool epochDone(const SaveExtras& extras = {});
  // Saves the current state now (at a step or epoch boundary), on every rank's call.
  void save(const SaveExtras& extras = {});
  // In-place recovery (ctorchrun --recovery in-place; docs/in-place-recovery.md). Call it from the
  // handler of an exception thrown by the step (a DistributedError, or Gloo's / DDP's error through
  // loss.backward()) or by stepDone()/epochDone(): when a peer died or stopped answering, it lets go
  // of the failed group, re-forms it with the launcher's replacement,
  // agrees with the others on the last step that completed (this one if any rank finished it), and
  // the replacement (and any rank behind) receives the whole training state from a rank that holds
  // it, over the network. Afterwards every tracked object stands at the returned point (the sampler
  // too): continue the loop from there (a new batch loader where it caches the sampler's order).
  // Rethrows the exception being handled when it is not a failed collective or in-place recovery
  // is off; throws DistributedTimeout when the group does not re-form within the group's timeout
  // (1.5 x when a silent rank had to be reported for replacement: reformProcessGroup()).
  //   } catch (const std::exception&) { training.recover(); }   // then go on with the loop
  ResumePoint recover();
  // True when recover() can re-form the group (the job runs under ctorchrun --recovery in-place).
  bool canRecoverInPlace() const;
  // Waits for the snapshot write in flight; rethrows its failure.
  void wait();
  // The end of training: saves the final state if a schedule is on and it is not saved yet, waits
  // until it is durable and every rank got here. Returns 0 (the exit code); 75 after a stop.
  int finish();

  // ---- where the run stands
  std::int64_t epoch() const;        // completed epochs
  std::int64_t stepInEpoch() const;
  std::int64_t globalStep() const;
  bool stopRequested() const;        // agreed by every rank (at resume or a boundary)
  int stopSignal() const;            // this process's stop signal, 0 for a stop asked on another rank
  TrainingStatus status() const;
  // contract::kExitPreempted (75) after an agreed stop, else 0.
  int exitCode() const;
  const ResilienceOptions& options() const;

 private:
  // kOverlapped: the step's stop agreement is started and read at the next call (sums is null);
  // kNow: agreed (with `sums` summed) before it returns.
  enum class StopAgreement { kOverlapped, kNow };
  bool finishStep(StopAgreement agreement, std::vector<double>* sums);
  // What the track() calls register (resilience/tracking.cpp).
  detail::TrackedState& tracked();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace ctorch
