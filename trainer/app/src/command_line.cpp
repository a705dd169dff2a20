// ctorch-train's command line: argv checked for its shape (argument_check.cpp: unknown flags with a
// "did you mean", missing or non-numeric values), parsed by CLI11 into TrainOptions, then
// TrainOptions::validate.
// Python's counterpart: torchrun scripts' argparse.
#include "ctorch/train/options.hpp"

#include "argument_check.hpp"
#include "option_choices.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/version.hpp>

#include <CLI/CLI.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <type_traits>

namespace ctorch::train {

using namespace choices;

namespace {

// --batch_size -> --batch-size (only the flag name, not a value after '=').
std::string kebab(const std::string& arg) {
  if (arg.rfind("--", 0) != 0) return arg;
  const auto eq = arg.find('=');
  std::string name = arg.substr(0, eq);
  std::replace(name.begin() + 2, name.end(), '_', '-');
  return eq == std::string::npos ? name : name + arg.substr(eq);
}

// "3,32,32" -> {3, 32, 32}.
std::vector<std::int64_t> parseShape(const std::string& text) {
  std::vector<std::int64_t> shape;
  std::size_t start = 0;
  while (true) {
    const auto comma = text.find(',', start);
    const std::string part = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!isWholeNumber(part, ValueKind::kInt64)) shape.clear(), shape.push_back(-1);
    else shape.push_back(std::strtoll(part.c_str(), nullptr, 10));
    if (comma == std::string::npos || shape.back() < 0) break;
    start = comma + 1;
  }
  const bool ok = shape.size() == 3 && std::all_of(shape.begin(), shape.end(), [](std::int64_t v) { return v >= 1; }) &&
                  shape[0] <= 64 && shape[1] <= 4096 && shape[2] <= 4096;
  if (!ok)
    bad("--synthetic-shape", text,
        "must be C,H,W: channels 1-64, height and width 1-4096 (e.g. 3,32,32 for CIFAR-shaped images)");
  return shape;
}

std::string lowerCase(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// A choice by its name, in any case ("Adam", "SGD"), or by Python's spelling of it (`python`:
// "FULL_SHARD" for full); otherwise one line listing the names, and Python's where it has them.
template <class E>
E pick(const char* flag, const std::string& value, const std::vector<std::pair<std::string, E>>& choices,
       const std::vector<std::pair<std::string, E>>& python = {}) {
  std::vector<std::string> names;
  for (const auto& [name, e] : choices) {
    if (lowerCase(name) == lowerCase(value)) return e;
    names.push_back(name);
  }
  std::string spellings;
  for (const auto& [name, e] : python) {
    if (lowerCase(name) == lowerCase(value)) return e;
    spellings += std::string(spellings.empty() ? " (Python's " : ", ") + name + " is " + nameOf(e, choices);
  }
  bad(flag, value, "is not one of: " + joined(names) + (spellings.empty() ? "" : spellings + ")"));
}

// Where trainer.md is: beside an installed ctorch-train (<prefix>/<docdir>/docs, found from the
// program's own path, so that a moved prefix still finds it), else in the sources.
std::string documentation() {
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto doc = exe.parent_path().parent_path() / CTORCH_INSTALL_DOCDIR / "docs" / "trainer.md";
    if (std::filesystem::is_regular_file(doc, ec)) return doc.lexically_normal().string();
  }
  return "docs/trainer.md in ctorch's sources";
}

std::string epilog() {
  std::ostringstream os;
  os << "Exit codes: 0 done; " << contract::kExitUsage << " bad command line or configuration; "
     << contract::kExitPreempted
     << " stopped by SIGTERM/SIGUSR1/SIGINT after writing a snapshot (run again to resume); "
     << contract::kExitFailure << " any other failure (recorded in TORCHELASTIC_ERROR_FILE when set).\n"
     << "Run it under ctorchrun (ctorchrun --standalone --nproc-per-node 2 ctorch-train ...), torchrun, plain\n"
     << "srun, or alone (a world of 1). Every flag also accepts its underscore spelling (--batch_size).\n"
     << "Documentation: " << documentation() << ".";
  return os.str();
}


// The flags whose text becomes a TrainOptions field only after a check or a conversion (after
// parsing); the others are parsed straight into TrainOptions.
struct FlagTexts {
  explicit FlagTexts(const TrainOptions& o)
      : optimizer(toString(o.optimizer)),
        optimizerImpl(optim::toString(o.optimizerKernels)),
        lrDecay(toString(o.lrDecay)),
        device(toString(o.device)),
        backend(toString(o.backend)),
        progress(toString(o.progress)),
        augment(toString(o.augment)),
        commHook(nameOf(o.commHook, kCommHooks)),
        gradientReduction(nameOf(o.gradientReduction, kReductions)),
        sharding(toString(o.sharding)),
        sync(toString(o.sync)),
        snapshotPath(o.snapshotPath.string()),
        timeoutS(o.timeout.count()) {}

  std::string optimizer, optimizerImpl, lrDecay, device, backend, progress, augment, commHook, gradientReduction, sharding, resume = "auto",
      metrics;
  std::string sync;
  std::string pipelineSchedule = "1f1b";
  std::string dataDir, snapshotPath, modelDir, syntheticShape, tensorboardDir;
  std::int64_t timeoutS, stepDelayMs = 0;
  std::string holdFile;
  bool noBucketView = false;
  std::string profileSteps, profileFile;
  std::string memoryFormat = "auto";
  std::string fsdpParamDtype, fsdpReduceDtype;
};

// CLI11's app as options are added to it, remembering what kind of value each flag takes (for
// checkArguments, which runs before CLI11 parses).
class FlagTable {
 public:
  explicit FlagTable(CLI::App& app) : app_(app) {}

  template <class T>
  CLI::Option* option(const std::string& name, T& target, const std::string& help) {
    if constexpr (std::is_integral_v<T>)
      kinds_[name] = sizeof(T) > sizeof(int) ? ValueKind::kInt64 : ValueKind::kInt32;
    else if constexpr (std::is_floating_point_v<T>)
      kinds_[name] = ValueKind::kNumber;
    else
      kinds_[name] = ValueKind::kText;
    return app_.add_option(name, target, help);
  }
  CLI::Option* flag(const std::string& name, bool& target, const std::string& help) {
    kinds_[name] = ValueKind::kFlag;
    return app_.add_flag(name, target, help);
  }
  const FlagKinds& kinds() const { return kinds_; }

 private:
  CLI::App& app_;
  FlagKinds kinds_{{"--help", ValueKind::kFlag}, {"-h", ValueKind::kFlag}, {"--version", ValueKind::kFlag}};
};

void addDataFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kData = "Data and model";
  f.option("--model", o.model, "model: " + joined(kModels))->group(kData)->capture_default_str();
  f.option("--dataset", o.dataset, "dataset: " + joined(kDatasets))->group(kData)->capture_default_str();
  f.option("--data-dir", t.dataDir, "directory of the dataset's files (default: fashion-mnist's Debian package)")
      ->group(kData);
  f.option("--train-limit", o.trainLimit, "use the first N training samples (0: all)")->group(kData)->capture_default_str();
  f.option("--test-limit", o.testLimit, "use the first N test samples (0: all)")->group(kData)->capture_default_str();
  f.option("--synthetic-size", o.syntheticSize, "synthetic datasets: training samples (0: 2048)")->group(kData)->capture_default_str();
  f.option("--synthetic-shape", t.syntheticShape,
           "synthetic-images: sample shape C,H,W (default 1,28,28; 3,32,32 is CIFAR-shaped)")
      ->group(kData);
  f.option("--augment", t.augment, "random crop + flip: auto (when the dataset recommends it), on, off")
      ->group(kData)->capture_default_str();
  f.option("--prefetch", o.prefetch, "batches prepared ahead on a background thread (0-2)")->group(kData)->capture_default_str();
}

void addOptimisationFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kOpt = "Optimisation";
  f.option("--epochs", o.epochs, "epochs to train")->group(kOpt)->capture_default_str();
  f.option("--batch-size", o.batchSize, "samples per rank per (micro-)step")->group(kOpt)->capture_default_str();
  f.option("--grad-accum-steps", o.gradAccumSteps,
           "micro-steps per optimizer step; gradients are all-reduced on the last only")
      ->group(kOpt)->capture_default_str();
  f.option("--optimizer", t.optimizer, "sgd, adam, adamw (decoupled weight decay), rmsprop or adagrad (Python's defaults otherwise)")
      ->group(kOpt)->capture_default_str();
  f.option("--optimizer-impl", t.optimizerImpl,
           "how sgd, adam and adamw step: auto (fused kernels on CUDA where this LibTorch has them, "
           "multi-tensor ones elsewhere), fused (on the CPU too: faster, but sharded runs no longer equal DDP), foreach (torch::optim's arithmetic, bit for bit) or per-parameter "
           "(torch::optim's own step)")
      ->group(kOpt)->capture_default_str();
  f.option("--lr", o.lr, "peak learning rate")->group(kOpt)->capture_default_str();
  f.option("--momentum", o.momentum, "SGD momentum")->group(kOpt)->capture_default_str();
  f.option("--weight-decay", o.weightDecay, "L2 weight decay (adamw: decoupled, 0.01 unless given, as Python's)")->group(kOpt)->capture_default_str();
  f.option("--clip-grad-norm", o.clipGradNorm,
           "clip the gradients to this global L2 norm before each update (0: off; after DDP's average, before the "
           "optimizer; with --amp float16, of the unscaled gradients)")
      ->group(kOpt)->capture_default_str();
  f.option("--warmup-epochs", o.warmupEpochs,
           "linear warmup from lr x warmup-start-factor to lr over this many (fractional) epochs")
      ->group(kOpt)->capture_default_str();
  f.option("--warmup-start-factor", o.warmupStartFactor, "first warmup learning rate, as a fraction of lr")
      ->group(kOpt)->capture_default_str();
  f.option("--lr-decay", t.lrDecay,
           "after warmup: none, cosine or linear (to --min-lr at the last epoch), step; or onecycle: a cosine rise from "
           "lr x warmup-start-factor to lr over --warmup-epochs (30% of the run when 0), then a cosine fall to --min-lr")
      ->group(kOpt)->capture_default_str();
  f.option("--lr-step-epochs", o.lrStepEpochs, "step decay: epochs between decays")->group(kOpt)->capture_default_str();
  f.option("--lr-gamma", o.lrGamma, "step decay: factor per decay")->group(kOpt)->capture_default_str();
  f.option("--min-lr", o.minLr, "cosine, linear and onecycle decay: final learning rate")->group(kOpt)->capture_default_str();
  f.option("--seed", o.seed, "seed of weights, data order, dropout and augmentation")->group(kOpt)->capture_default_str();
  f.option("--max-steps", o.maxSteps, "stop after this many optimizer steps in all (0: no limit); writes a snapshot")
      ->group(kOpt)->capture_default_str();
}

void addEvaluationFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kEval = "Evaluation and output";
  f.option("--eval-every", o.evalEvery, "epochs between test-set evaluations (0: after the last epoch only)")
      ->group(kEval)->capture_default_str();
  f.option("--eval-batch-size", o.evalBatchSize, "samples per evaluation batch")->group(kEval)->capture_default_str();
  f.option("--log-interval", o.logInterval, "steps between progress lines and metrics records")
      ->group(kEval)->capture_default_str();
  f.option("--progress", t.progress, "auto (a bar when stdout is a terminal, else lines), bar, lines, none")
      ->group(kEval)->capture_default_str();
  f.option("--metrics-file", t.metrics, "JSONL metrics (default: <model-dir>/metrics.jsonl; 'none': off)")
      ->group(kEval);
  f.option("--tensorboard-dir", t.tensorboardDir,
           "also write the metrics as TensorBoard scalars in this directory (tensorboard --logdir DIR; default: off)")
      ->group(kEval);
}

void addSnapshotFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kSnap = "Snapshots and weights";
  f.option("--snapshot-path", t.snapshotPath, "the snapshot slot (previous ones kept as PATH.1, PATH.2, ...)")
      ->group(kSnap)->capture_default_str();
  f.option("--save-every", o.saveEvery, "epochs between snapshots (0: none at epoch ends)")->group(kSnap)->capture_default_str();
  f.option("--save-every-steps", o.saveEverySteps, "also a snapshot every N optimizer steps (0: off)")
      ->group(kSnap)->capture_default_str();
  f.option("--keep-snapshots", o.keepSnapshots, "previous snapshots kept next to the newest")->group(kSnap)->capture_default_str();
  f.flag("--log-saves", o.logSaves,
         "a 'snapshot written' line for every save (default: only at epoch ends, a stop and the end)")
      ->group(kSnap);
  f.option("--resume", t.resume, "auto (newest valid snapshot, if any), never, or a snapshot file")
      ->group(kSnap)->capture_default_str();
  f.flag("--allow-config-change", o.allowConfigChange,
         "resume even if the snapshot's configuration differs (the model must be the same)")
      ->group(kSnap);
  f.option("--model-dir", t.modelDir,
           "directory of the final weights, checkpoints and metrics (default: the --snapshot-path's directory)")
      ->group(kSnap);
  f.option("--model-filename", o.modelFilename, "final weights (a state dict torch.load opens)")
      ->group(kSnap)->capture_default_str();
  f.option("--checkpoint-every", o.checkpointEvery, "epochs between checkpoint_epoch_N.pt files (0: none)")
      ->group(kSnap)->capture_default_str();
  f.option("--keep-checkpoints", o.keepCheckpoints, "checkpoint files kept (the newest)")->group(kSnap)->capture_default_str();
}

// Devices, communication, DDP, the profiler, and the testing aid.
void addSystemFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kSys = "Devices, communication, DDP";
  f.option("--device", t.device, "auto (cuda when available), cpu, cuda")->group(kSys)->capture_default_str();
  f.option("--backend", t.backend, "auto (gloo on cpu, nccl on cuda), gloo, nccl")->group(kSys)->capture_default_str();
  f.flag("--cuda-graphs", o.cudaGraphs,
         "capture the whole step (forward, backward, DDP's allreduce, optimizer) in a CUDA graph after 11 warm-up "
         "steps and replay it; steps of other shapes run eagerly (CUDA, SGD, DDP on NCCL)")->group(kSys);
  f.flag("--amp", o.amp, "automatic mixed precision: autocast to --amp-dtype (float16 adds dynamic loss scaling)")->group(kSys);
  f.option("--amp-dtype", o.ampDtype,
           "auto (as torch.autocast: float16 on CUDA, bfloat16 on the CPU), float16 (CUDA) or bfloat16")->group(kSys)->capture_default_str();
  f.option("--timeout", t.timeoutS, "seconds any collective may wait for a peer before the run fails")
      ->group(kSys)->capture_default_str();
  f.option("--threads", o.threads, "intra-op threads per rank (0: OMP_NUM_THREADS if set, else CPUs / ranks on this node)")
      ->group(kSys)->capture_default_str();
  f.option("--bucket-cap-mb", o.bucketCapMb, "DDP gradient bucket size")->group(kSys)->capture_default_str();
  f.option("--comm-hook", t.commHook,
           "how DDP averages gradients: shared-memory (through one shared segment when every rank is on this "
           "host, else as none), none (the Reducer's Gloo/NCCL allreduce), allreduce, fp16")
      ->group(kSys)->capture_default_str();
  f.option("--gradient-reduction", t.gradientReduction,
           "when the shared-memory hook averages the gradient buckets: overlapped (each as soon as it is ready, on "
           "a helper thread, while the backward pass goes on), after-backward (all at its end, on the computing "
           "thread: one meeting of the ranks per step); the same bits either way")
      ->group(kSys)->capture_default_str();
  f.option("--sharding", t.sharding,
           "none (DDP: every rank holds the whole model and optimizer state), optimizer (ZeRO-1: each rank holds "
           "and steps its share of the optimizer state, then broadcasts its parameters; bit-identical to none), "
           "grad-op (FSDP SHARD_GRAD_OP: parameters, gradients and optimizer state sharded, each layer's "
           "parameters gathered from its forward to its backward) or full (FSDP FULL_SHARD: gathered for the "
           "forward and again for the backward); grad-op and full are bit-identical to none at 2 ranks; "
           "hybrid and hybrid-grad-op (HYBRID_SHARD, _HYBRID_SHARD_ZERO2) shard as full and grad-op over each "
           "node's LOCAL_WORLD_SIZE ranks and replicate across nodes (only a shard of the gradient, 1/LOCAL_WORLD_SIZE "
           "of it, is averaged between nodes); one node is plain full or grad-op")
      ->group(kSys)->capture_default_str();
  f.option("--shard-copies", o.shardCopies,
           "with --sharding optimizer|grad-op|full under ctorchrun --recovery in-place: 1 keeps a copy of each rank's "
           "shard (parameters and optimizer state) in the next rank's memory, refreshed at every step, so that a lost "
           "rank's replacement takes its shard from that neighbour and the other ranks keep theirs (no file read, no "
           "step redone; costs one more shard of memory per rank and one shard sent per step); 0: a lost rank of a "
           "sharded run restarts the group from the snapshot files")
      ->group(kSys)->capture_default_str();
  f.option("--fsdp-param-dtype", t.fsdpParamDtype,
           "FSDP mixed precision (Python FSDP2's MixedPrecisionPolicy param_dtype): bf16, fp16 or fp32; each "
           "rank's float32 shard is cast to it before the all-gather (bf16: half the bytes) and the forward and "
           "backward compute with it; shards, optimizer, snapshots and model.pt stay float32 (--sharding "
           "grad-op|full|hybrid|hybrid-grad-op only)")
      ->group(kSys);
  f.option("--fsdp-reduce-dtype", t.fsdpReduceDtype,
           "FSDP mixed precision (reduce_dtype): the dtype gradients are reduce-scattered (and all-reduced "
           "across nodes) in, bf16, fp16 or fp32 (default: --fsdp-param-dtype); the averaged shard is cast back "
           "to float32")
      ->group(kSys);
  f.flag("--find-unused-parameters", o.findUnusedParameters, "DDP: search for parameters without gradient")
      ->group(kSys);
  f.flag("--no-gradient-as-bucket-view", t.noBucketView,
         "DDP: keep gradients apart from the allreduce buckets (by default they are views into them, "
         "which saves a copy)")
      ->group(kSys);
  f.option("--memory-format", t.memoryFormat,
           "layout of a convolutional model's weights and input batches: auto (channels-last on CUDA for a model "
           "with convolutions, contiguous on the CPU and for other models), contiguous, channels-last (NHWC; "
           "not with --sharding grad-op|full; a no-op, said once, for a model without convolutions)")
      ->group(kSys)->capture_default_str();

  f.option("--profile-steps", t.profileSteps,
           "A:B (or A): a Chrome trace of global steps A to B by LibTorch's profiler, one file per rank "
           "(open it in chrome://tracing or ui.perfetto.dev)")
      ->group(kSys);
  f.option("--profile-file", t.profileFile, "where --profile-steps writes (default: <model-dir>/trace-rank<R>.json; "
                                            "{rank} is replaced by the rank)")
      ->group(kSys);

  f.option("--step-delay-ms", t.stepDelayMs, "testing aid: sleep after every step")->group("Testing");
  f.option("--hold-after-step", o.holdAfterStep,
           "testing aid: after global step N every rank says so and waits until --hold-file exists (or a stop "
           "signal comes), so that a test acts at a known step")
      ->group("Testing");
  f.option("--hold-file", t.holdFile, "testing aid: the file --hold-after-step waits for")->group("Testing");
}

// How the replicas are kept in step (docs/parameter-server.md).
void addSyncFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kSync = "Synchronisation";
  f.option("--sync", t.sync,
           "allreduce (DDP: every rank computes, gradients averaged by an allreduce) or parameter-server (the "
           "last --ps-servers ranks hold the weights and the optimizer; the others compute, push gradients and "
           "pull weights; synchronous)")
      ->group(kSync)->capture_default_str();
  f.option("--ps-servers", o.psServers,
           "with --sync parameter-server: how many ranks serve (the last ones; parameters spread over them by size)")
      ->group(kSync)->capture_default_str();
  f.option("--pipeline-stages", o.pipelineStages,
           "cut the model into this many stages, one per rank of each group of consecutive ranks (a pipeline; "
           "the world holds world / S pipelines, data parallel); 1: no pipeline")
      ->group(kSync)->capture_default_str();
  f.option("--micro-batches", o.microBatches, "with --pipeline-stages: micro-batches each batch is split into")
      ->group(kSync)->capture_default_str();
  f.option("--schedule", t.pipelineSchedule,
           "with --pipeline-stages: 1f1b (at most S micro-batches' activations held) or gpipe (all forwards, then "
           "all backwards)")
      ->group(kSync)->capture_default_str();
}

// The app with every flag of ctorch-train, in --help's order; the kinds of their values.
FlagKinds addFlags(CLI::App& app, TrainOptions& o, FlagTexts& t) {
  app.set_version_flag("--version", versionString());
  app.footer(epilog());
  app.get_formatter()->column_width(34);
  // A repeated flag takes its last value, as Python's argparse does (scripts that append overrides).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  FlagTable table(app);
  addDataFlags(table, o, t);
  addOptimisationFlags(table, o, t);
  addEvaluationFlags(table, o, t);
  addSnapshotFlags(table, o, t);
  addSystemFlags(table, o, t);
  addSyncFlags(table, o, t);
  return table.kinds();
}

// --profile-steps A:B or A into o.profileFirst and o.profileLast.
void parseProfileSteps(const std::string& text, TrainOptions& o) {
  const auto colon = text.find(':');
  auto step = [&](const std::string& part) {
    std::size_t used = 0;
    std::int64_t v = 0;
    try {
      v = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != part.size() || v < 1)
      bad("--profile-steps", text, "must be A:B or A, global steps counted from 1 (e.g. 10:12)");
    return v;
  };
  o.profileFirst = step(text.substr(0, colon));
  o.profileLast = colon == std::string::npos ? o.profileFirst : step(text.substr(colon + 1));
  if (o.profileLast < o.profileFirst) bad("--profile-steps", text, "ends before it starts (A:B needs B >= A)");
}

// After parsing: the flags' texts into TrainOptions (choices looked up, paths, durations, shapes).
// Throws UsageError for a value that is not one the flag takes.
void applyFlagTexts(const CLI::App& app, const FlagTexts& t, TrainOptions& o) {
  o.optimizer = pick("--optimizer", t.optimizer, kOptimizers);
  if (const auto kernels = optim::kernelsFromString(t.optimizerImpl)) o.optimizerKernels = *kernels;
  else bad("--optimizer-impl", t.optimizerImpl, "must be auto, fused, foreach or per-parameter");
  // Python's AdamW decays by 0.01 unless told otherwise; the flag's 0 is for the others.
  if (o.optimizer == OptimizerKind::kAdamW && app.count("--weight-decay") == 0) o.weightDecay = 0.01;
  o.lrDecay = pick("--lr-decay", t.lrDecay, kDecays);
  o.device = pick("--device", t.device, kDevices);
  o.backend = pick("--backend", t.backend, kBackends);
  o.progress = pick("--progress", t.progress, kProgress);
  o.augment = pick("--augment", t.augment, kAugment);
  o.commHook = pick("--comm-hook", t.commHook, kCommHooks);
  o.gradientReduction = pick("--gradient-reduction", t.gradientReduction, kReductions);
  o.sharding = pick("--sharding", t.sharding, kShardings, kPythonShardings);
  o.sync = pick("--sync", t.sync, kSyncs);
  if (!t.fsdpParamDtype.empty()) o.fsdpParamDtype = pick("--fsdp-param-dtype", t.fsdpParamDtype, kFsdpDtypes);
  if (!t.fsdpReduceDtype.empty()) o.fsdpReduceDtype = pick("--fsdp-reduce-dtype", t.fsdpReduceDtype, kFsdpDtypes);
  o.memoryFormat = pick("--memory-format", t.memoryFormat, kMemoryFormats, kPythonMemoryFormats);
  if (app.count("--ps-servers") && o.sync != SyncChoice::kParameterServer)
    bad("--ps-servers", std::to_string(o.psServers), "needs --sync parameter-server");
  o.pipelineSchedule = pick("--schedule", t.pipelineSchedule, kPipelineSchedules);
  if (app.count("--micro-batches") && o.pipelineStages == 1)
    bad("--micro-batches", std::to_string(o.microBatches), "needs --pipeline-stages 2 or more");
  if (app.count("--schedule") && o.pipelineStages == 1) bad("--schedule", t.pipelineSchedule, "needs --pipeline-stages 2 or more");
  o.resume = ResumeChoice::parse(t.resume);
  o.dataDir = t.dataDir;
  o.snapshotPath = t.snapshotPath;
  o.modelDir = t.modelDir;
  o.tensorboardDir = t.tensorboardDir;
  if (app.count("--synthetic-shape")) o.syntheticShape = parseShape(t.syntheticShape);
  if (app.count("--metrics-file"))
    o.metricsFile = t.metrics == "none" ? std::filesystem::path() : std::filesystem::path(t.metrics);
  o.timeout = std::chrono::seconds(t.timeoutS);
  o.stepDelay = std::chrono::milliseconds(t.stepDelayMs);
  o.holdFile = t.holdFile;
  if (app.count("--profile-steps")) parseProfileSteps(t.profileSteps, o);
  o.profileFile = t.profileFile;
  o.gradientAsBucketView = !t.noBucketView;
  try {  // bf16, BFloat16, fp16, half: the canonical name, which the binding configuration records
    if (lowerCase(o.ampDtype) == "auto") o.ampDtype = "auto";
    else o.ampDtype = amp::dtypeName(amp::parseDtype(o.ampDtype));
  } catch (const std::invalid_argument&) {
    bad("--amp-dtype", o.ampDtype, "must be auto, float16 or bfloat16");
  }
  // With the device named, auto is known now (and what float16 rules out is refused here).
  if (o.device != DeviceChoice::kAuto) o.resolveAmpDtype(o.device == DeviceChoice::kCuda);
  if (t.timeoutS < 1) bad("--timeout", std::to_string(t.timeoutS), "must be in [1, 604800] seconds");
}

// `message`: the line after "ctorch-train: error: ", with its newline.
ParsedCommandLine usageError(const std::string& message) {
  ParsedCommandLine result;
  result.exitCode = contract::kExitUsage;
  result.message = "ctorch-train: error: " + message;
  result.toStderr = true;
  return result;
}

}  // namespace

ParsedCommandLine parseCommandLine(int argc, const char* const* argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return parseCommandLine(args);
}

// The shape of the command line first (checkArguments: its messages name the flag and say what to
// type), then CLI11, then the values into TrainOptions and their one validation.
ParsedCommandLine parseCommandLine(const std::vector<std::string>& rawArgs) {
  TrainOptions o;
  FlagTexts texts(o);
  CLI::App app{"ctorch-train: data-parallel training of the seeds' models (LibTorch, DDP on c10d), resumable "
               "from crash-safe snapshots.\nDefaults train the MNIST CNN on Fashion-MNIST from " +
                   std::string("/usr/share/datasets/fashion-mnist."),
               "ctorch-train"};
  const FlagKinds kinds = addFlags(app, o, texts);

  std::vector<std::string> args;
  for (const auto& a : rawArgs) args.push_back(kebab(a));
  try {
    checkArguments(rawArgs, args, kinds);
  } catch (const UsageError& e) {
    return usageError(std::string(e.what()) + "\n");
  }
  std::reverse(args.begin(), args.end());  // CLI11 consumes a reversed vector
  ParsedCommandLine result;
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    result.message = app.help();
    return result;
  } catch (const CLI::CallForVersion&) {
    result.message = versionString() + "\n";
    return result;
  } catch (const CLI::ParseError& e) {
    return usageError(std::string(e.what()) + " (see ctorch-train --help)\n");
  }
  try {
    applyFlagTexts(app, texts, o);
    o.validate();
  } catch (const UsageError& e) {
    return usageError(std::string(e.what()) + "\n");
  }
  result.options = std::move(o);
  return result;
}

}  // namespace ctorch::train
