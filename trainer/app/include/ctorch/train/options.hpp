// Everything ctorch-train can be told, in one struct validated once (TrainOptions::validate), and
// the command line that fills it (parseCommandLine). The loop never sees argv; tests build options
// directly. docs/trainer.md lists every flag.
#pragma once

#include "ctorch/comm_hook.hpp"
#include "ctorch/optim.hpp"
#include "ctorch/pipeline.hpp"

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch::train {

using ctorch::CommHook;
using ctorch::GradientReduction;

// A value the user gave that cannot work. One line, naming the flag and quoting the value; the
// program exits with contract::kExitUsage.
class UsageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

enum class OptimizerKind { kSgd, kAdam, kAdamW, kRmsprop, kAdagrad };
enum class LrDecay { kNone, kCosine, kStep, kLinear, kOneCycle };
enum class DeviceChoice { kAuto, kCpu, kCuda };
enum class BackendChoice { kAuto, kGloo, kNccl };
enum class ProgressMode { kAuto, kBar, kLines, kNone };
enum class AugmentChoice { kAuto, kOn, kOff };
// What is sharded over the ranks: nothing (DDP), the optimizer's state (ZeRO-1; Python's
// ZeroRedundancyOptimizer), also the gradients and, between steps, the parameters (FSDP's
// SHARD_GRAD_OP), or everything, each unit's parameters gathered only around its use (FULL_SHARD);
// the hybrid ones shard as grad-op / full within a node and replicate across nodes (HYBRID_SHARD,
// _HYBRID_SHARD_ZERO2).
enum class ShardingChoice { kNone, kOptimizer, kGradOp, kFull, kHybrid, kHybridGradOp };
// FSDP holds the model (grad-op, full, hybrid, hybrid-grad-op).
inline bool shardsModel(ShardingChoice v) { return v != ShardingChoice::kNone && v != ShardingChoice::kOptimizer; }
inline bool isHybrid(ShardingChoice v) { return v == ShardingChoice::kHybrid || v == ShardingChoice::kHybridGradOp; }
// A unit's parameters freed after its forward and gathered again for its backward (FULL_SHARD).
inline bool reshardsAfterForward(ShardingChoice v) { return v == ShardingChoice::kFull || v == ShardingChoice::kHybrid; }
// How the replicas are kept in step: DDP's gradient allreduce, or a parameter server (the last
// --ps-servers ranks hold the weights and the optimizer; the others compute).
enum class SyncChoice { kAllreduce, kParameterServer };
// The layout of a convolutional model's weights and input batches (--memory-format): auto is
// channels-last on CUDA for a model with 4-D weights, contiguous otherwise (chooseMemoryFormat).
enum class MemoryFormatChoice { kAuto, kContiguous, kChannelsLast };

const char* toString(OptimizerKind v);
const char* toString(LrDecay v);
const char* toString(DeviceChoice v);
const char* toString(BackendChoice v);
const char* toString(ProgressMode v);
const char* toString(AugmentChoice v);
const char* toString(ShardingChoice v);
const char* toString(SyncChoice v);
const char* toString(MemoryFormatChoice v);

// Where to resume from: the newest valid snapshot of the slot (auto), nothing (never), or one file.
struct ResumeChoice {
  enum class Kind { kAuto, kNever, kPath } kind = Kind::kAuto;
  std::filesystem::path path;  // kPath only
  static ResumeChoice parse(const std::string& text);  // "auto", "never", anything else is a path
  std::string describe() const;
};

struct TrainOptions {
  // ---- data and model
  std::string model = "mnist-cnn";
  std::string dataset = "fashion-mnist";
  std::filesystem::path dataDir;     // empty: the dataset's default (fashion-mnist: Debian's package)
  std::int64_t trainLimit = 0;       // first N training samples (0: all)
  std::int64_t testLimit = 0;        // first N test samples (0: all)
  std::int64_t syntheticSize = 0;    // synthetic datasets: training samples (0: the dataset's default)
  std::vector<std::int64_t> syntheticShape;  // synthetic-images: C, H, W (empty: 1, 28, 28)
  AugmentChoice augment = AugmentChoice::kAuto;  // crop + flip; auto: when the dataset recommends it
  int prefetch = 0;                  // batches prepared ahead on a background thread (0..2)

  // ---- optimisation
  std::int64_t epochs = 3;
  std::int64_t batchSize = 64;       // per rank, per micro-step
  std::int64_t gradAccumSteps = 1;   // micro-steps per optimizer step (no allreduce but on the last)
  OptimizerKind optimizer = OptimizerKind::kSgd;
  // SGD, Adam and AdamW: fused kernels on CUDA where this LibTorch has them, multi-tensor
  // (foreach) kernels elsewhere (ctorch/optim.hpp); rmsprop and adagrad step per parameter.
  optim::Kernels optimizerKernels = optim::Kernels::kAuto;
  double lr = 0.05;                  // peak learning rate
  double momentum = 0.9;             // SGD momentum
  double weightDecay = 0.0;
  double clipGradNorm = 0.0;         // > 0: gradients clipped to this global L2 norm before each update
  double warmupEpochs = 0.0;         // linear warmup from lr * warmupStartFactor to lr
  double warmupStartFactor = 0.1;
  // After warmup. The default is the seeds' MNIST example: StepLR(step_size=1, gamma=0.7).
  LrDecay lrDecay = LrDecay::kStep;
  std::int64_t lrStepEpochs = 1;     // step decay: multiply by lrGamma every this many epochs
  double lrGamma = 0.7;
  double minLr = 0.0;                // cosine decay ends here
  std::int64_t seed = 1;
  std::int64_t maxSteps = 0;         // stop (with a snapshot) after this many optimizer steps (0: no limit)

  // ---- evaluation and output
  std::int64_t evalEvery = 1;        // epochs between evaluations (0: only after the last epoch)
  std::int64_t evalBatchSize = 100;  // not the seeds' 1000: its activations overflow the CPU's caches (docs/performance.md)
  std::int64_t logInterval = 10;     // steps between progress lines / metrics records
  ProgressMode progress = ProgressMode::kAuto;
  std::optional<std::filesystem::path> metricsFile;  // unset: <outputDir()>/metrics.jsonl; empty: none
  std::filesystem::path tensorboardDir;  // --tensorboard-dir: TensorBoard event files (empty: none)

  // ---- snapshots, checkpoints, final weights
  std::filesystem::path snapshotPath = "snapshot.pt";
  std::int64_t saveEvery = 1;        // epochs between snapshots (0: none at epoch ends)
  std::int64_t saveEverySteps = 0;   // also every N optimizer steps (0: off)
  int keepSnapshots = 2;             // previous snapshots kept next to the newest
  bool logSaves = false;             // a "snapshot written" line for every save, not only epoch ends and stops
  ResumeChoice resume;
  bool allowConfigChange = false;    // resume a snapshot whose configuration differs
  // Final weights, checkpoints and metrics; empty: beside the snapshot (one directory per run).
  std::filesystem::path modelDir;
  std::string modelFilename = "model.pt";
  std::int64_t checkpointEvery = 0;  // epochs between checkpoint_epoch_N.pt files (0: none)
  int keepCheckpoints = 3;

  // ---- devices, communication, DDP
  DeviceChoice device = DeviceChoice::kAuto;
  BackendChoice backend = BackendChoice::kAuto;
  bool cudaGraphs = false;           // --cuda-graphs: capture the whole step once warmed up, replay it (CUDA)
  bool amp = false;                  // automatic mixed precision (autocast; float16 adds loss scaling)
  // --amp-dtype: float16 (CUDA) or bfloat16 (CUDA or CPU); auto is torch.autocast's default for the
  // device: float16 on CUDA, bfloat16 on the CPU (made concrete by resolveAmpDtype).
  std::string ampDtype = "auto";
  std::chrono::seconds timeout{300}; // every collective; a stuck peer becomes an error exit
  int threads = 0;                   // intra-op threads (0: OMP_NUM_THREADS, else CPUs / local ranks)
  double bucketCapMb = 25.0;
  // How DDP moves gradients: through shared memory where every rank shares it (one host, CPU),
  // else the Reducer's allreduce.
  CommHook commHook = CommHook::kSharedMemory;                           // --comm-hook
  GradientReduction gradientReduction = GradientReduction::kOverlapped;  // --gradient-reduction
  ShardingChoice sharding = ShardingChoice::kNone;  // --sharding (bit-identical either way)
  int shardCopies = 0;  // --shard-copies: a copy of each rank's shard on the next rank (in-place recovery)
  // --fsdp-param-dtype / --fsdp-reduce-dtype: FSDP's mixed precision (ctorch::MixedPrecisionPolicy),
  // "float32", "bfloat16" or "float16"; empty: unset (the parameters' own dtype; reduce: the param's).
  std::string fsdpParamDtype, fsdpReduceDtype;
  bool findUnusedParameters = false;
  bool gradientAsBucketView = true;
  SyncChoice sync = SyncChoice::kAllreduce;  // --sync
  int psServers = 1;                         // --ps-servers: how many of the last ranks serve
  // --pipeline-stages S: the model cut into S stages over each S consecutive ranks (a pipeline; the
  // world holds world / S of them, data parallel over the replicas of each stage), each batch run as
  // --micro-batches M under --schedule (docs/pipeline.md). 1: no pipeline.
  int pipelineStages = 1;
  int microBatches = 4;
  PipelineScheduleKind pipelineSchedule = PipelineScheduleKind::k1F1B;
  // --memory-format. Not in bindingConfig: snapshots hold contiguous copies, so a run resumes in
  // either layout (the trajectories differ only by the convolutions' rounding).
  MemoryFormatChoice memoryFormat = MemoryFormatChoice::kAuto;

  // ---- profiling: a Chrome trace (LibTorch's profiler) of global steps [profileFirst, profileLast]
  std::int64_t profileFirst = 0;  // 0: off
  std::int64_t profileLast = 0;
  std::filesystem::path profileFile;  // empty: <outputDir()>/trace-rank<R>.json
  std::filesystem::path profilePath(int rank) const;

  // ---- testing aids
  std::chrono::milliseconds stepDelay{0};  // sleep after every step (a run that lasts)
  // After global step holdAfterStep (0: never) every rank waits until holdFile exists or a stop
  // signal comes: a test kills or stops the run at a known step, however loaded the machine.
  std::int64_t holdAfterStep = 0;
  std::filesystem::path holdFile;

  // Throws UsageError naming the first bad value.
  void validate() const;
  // --amp-dtype auto becomes the device's autocast type (float16 on CUDA, bfloat16 on the CPU);
  // validate() again after it for what float16 rules out. Nothing when the type was given.
  void resolveAmpDtype(bool cuda);
  // The files the run will write (snapshot slot, --model-dir, metrics, --tensorboard-dir, final
  // weights), checked on the file system before anything is loaded: each directory made and
  // writable, no directory or FIFO where a file goes. Throws UsageError naming the flag and the
  // path. Rank 0 writes them.
  void checkOutputs() const;

  // The metrics file to write, or nullopt for none.
  std::optional<std::filesystem::path> metricsPath() const;
  // --model-dir when given, else the snapshot's directory ("." for a bare file name).
  std::filesystem::path outputDir() const;
  std::filesystem::path finalModelPath() const { return outputDir() / modelFilename; }

  // The settings that shape the training trajectory, as text: stored in snapshots, compared on
  // resume (a change is refused unless allowConfigChange). Logging, paths and limits are not in it.
  std::map<std::string, std::string> bindingConfig() const;
  // One line for the start-up log.
  std::string describe() const;
};

// Accepts kebab-case flags and torchrun-style underscore spellings (--batch_size).
struct ParsedCommandLine {
  std::optional<TrainOptions> options;  // set when training should run
  int exitCode = 0;                     // otherwise: the exit code (0 after --help / --version)
  std::string message;                  // text to print (help, version, or the one-line error)
  bool toStderr = false;
};

ParsedCommandLine parseCommandLine(int argc, const char* const* argv);
// The same from a vector (tests); args excludes the program name.
ParsedCommandLine parseCommandLine(const std::vector<std::string>& args);

}  // namespace ctorch::train
