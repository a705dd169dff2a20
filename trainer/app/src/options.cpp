// TrainOptions' one validation (validate, checkOutputs), its derived paths, the configuration a
// snapshot binds, and the names of its choices. The command line that fills it: command_line.cpp.
#include "ctorch/train/options.hpp"

#include "option_choices.hpp"

#include "ctorch/train/strategy_table.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/version.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <type_traits>

namespace ctorch::train {

using namespace choices;

namespace {

void atLeast(const char* flag, std::int64_t value, std::int64_t lo) {
  if (value < lo) bad(flag, std::to_string(value), "must be >= " + std::to_string(lo));
}

void finiteIn(const char* flag, double value, double lo, double hi, bool loOpen, bool hiOpen) {
  const bool ok = std::isfinite(value) && (loOpen ? value > lo : value >= lo) && (hiOpen ? value < hi : value <= hi);
  if (!ok) {
    std::ostringstream range;
    range << "must be in " << (loOpen ? "(" : "[") << number(lo) << ", "
          << (std::isinf(hi) ? std::string("inf") : number(hi)) << (hiOpen ? ")" : "]");
    bad(flag, number(value), range.str());
  }
}

}  // namespace

const char* toString(OptimizerKind v) { return nameOf(v, kOptimizers); }
const char* toString(LrDecay v) { return nameOf(v, kDecays); }
const char* toString(DeviceChoice v) { return nameOf(v, kDevices); }
const char* toString(BackendChoice v) { return nameOf(v, kBackends); }
const char* toString(ProgressMode v) { return nameOf(v, kProgress); }
const char* toString(AugmentChoice v) { return nameOf(v, kAugment); }
const char* toString(ShardingChoice v) { return nameOf(v, kShardings); }
const char* toString(SyncChoice v) { return nameOf(v, kSyncs); }
const char* toString(MemoryFormatChoice v) { return nameOf(v, kMemoryFormats); }

ResumeChoice ResumeChoice::parse(const std::string& text) {
  ResumeChoice r;
  if (text == "auto") {
    r.kind = Kind::kAuto;
  } else if (text == "never") {
    r.kind = Kind::kNever;
  } else if (text.empty()) {
    throw UsageError("--resume '' must be auto, never or the path of a snapshot file");
  } else {
    r.kind = Kind::kPath;
    r.path = text;
  }
  return r;
}

std::string ResumeChoice::describe() const {
  switch (kind) {
    case Kind::kAuto: return "auto";
    case Kind::kNever: return "never";
    case Kind::kPath: return path.string();
  }
  return "?";
}

namespace {

// --cuda-graphs: the step must be one static graph with no host synchronisation inside (which
// strategies' steps can be captured: the strategy table's).
void validateCudaGraphs(const TrainOptions& o) {
  auto refuse = [](const std::string& with, const std::string& why) {
    throw UsageError("--cuda-graphs with " + with + ": " + why);
  };
  if (o.device == DeviceChoice::kCpu) throw UsageError(kCudaGraphsNeedCuda);
  if (o.clipGradNorm > 0) refuse("--clip-grad-norm", "the norm is read back to the host every step");
  if (o.optimizer != OptimizerKind::kSgd)
    refuse(std::string("--optimizer ") + toString(o.optimizer), "its step counts live on the host and a replay would repeat them (use sgd)");
  if (o.gradAccumSteps > 1) refuse("--grad-accum-steps " + std::to_string(o.gradAccumSteps), "one micro-step per step only");
}

// --pipeline-stages and --micro-batches in range for every run; what a pipeline refuses is the
// strategy table's.
void validatePipelineRanges(const TrainOptions& o) {
  if (o.pipelineStages < 1 || o.pipelineStages > 1024)
    bad("--pipeline-stages", std::to_string(o.pipelineStages), "must be in [1, 1024]");
  if (o.microBatches < 1 || o.microBatches > 1 << 20) bad("--micro-batches", std::to_string(o.microBatches), "must be in [1, 1048576]");
}

}  // namespace

void TrainOptions::validate() const {
  if (std::find(kModels.begin(), kModels.end(), model) == kModels.end())
    bad("--model", model, "is not one of: " + joined(kModels));
  if (std::find(kDatasets.begin(), kDatasets.end(), dataset) == kDatasets.end())
    bad("--dataset", dataset, "is not one of: " + joined(kDatasets));
  if ((dataset == "mnist" || dataset == "cifar10") && dataDir.empty())
    throw UsageError("--dataset '" + dataset + "' needs --data-dir (the directory holding its files)");
  if (!dataDir.empty() && !std::filesystem::is_directory(dataDir))
    bad("--data-dir", dataDir.string(), "is not a directory");
  atLeast("--train-limit", trainLimit, 0);
  atLeast("--test-limit", testLimit, 0);
  atLeast("--synthetic-size", syntheticSize, 0);
  if (!syntheticShape.empty() && dataset != "synthetic-images")
    throw UsageError("--synthetic-shape applies to --dataset synthetic-images only, not '" + dataset + "'");
  if (prefetch < 0 || prefetch > 2) bad("--prefetch", std::to_string(prefetch), "must be 0, 1 or 2");

  atLeast("--epochs", epochs, 1);
  atLeast("--batch-size", batchSize, 1);
  atLeast("--grad-accum-steps", gradAccumSteps, 1);
  finiteIn("--lr", lr, 0.0, 1e6, true, false);
  finiteIn("--momentum", momentum, 0.0, 1.0, false, true);
  finiteIn("--weight-decay", weightDecay, 0.0, 1.0, false, false);
  finiteIn("--clip-grad-norm", clipGradNorm, 0.0, 1e9, false, false);
  finiteIn("--warmup-epochs", warmupEpochs, 0.0, static_cast<double>(epochs), false, false);
  finiteIn("--warmup-start-factor", warmupStartFactor, 0.0, 1.0, true, false);
  atLeast("--lr-step-epochs", lrStepEpochs, 1);
  finiteIn("--lr-gamma", lrGamma, 0.0, 1.0, true, false);
  finiteIn("--min-lr", minLr, 0.0, lr, false, false);
  atLeast("--seed", seed, 0);
  atLeast("--max-steps", maxSteps, 0);

  atLeast("--eval-every", evalEvery, 0);
  atLeast("--eval-batch-size", evalBatchSize, 1);
  atLeast("--log-interval", logInterval, 1);

  if (auto problem = snapshotPathProblem(snapshotPath, "--snapshot-path")) throw UsageError(*problem);
  atLeast("--save-every", saveEvery, 0);
  atLeast("--save-every-steps", saveEverySteps, 0);
  if (keepSnapshots < 0 || keepSnapshots > 100)
    bad("--keep-snapshots", std::to_string(keepSnapshots), "must be in [0, 100]");
  if (resume.kind == ResumeChoice::Kind::kPath && !std::filesystem::exists(resume.path))
    bad("--resume", resume.path.string(), "does not exist (use auto, never, or an existing snapshot file)");
  if (modelFilename.empty() || modelFilename.find('/') != std::string::npos || modelFilename == "." ||
      modelFilename == "..")
    bad("--model-filename", modelFilename, "must be a plain file name (the directory is --model-dir)");
  atLeast("--checkpoint-every", checkpointEvery, 0);
  if (keepCheckpoints < 1 || keepCheckpoints > 1000)
    bad("--keep-checkpoints", std::to_string(keepCheckpoints), "must be in [1, 1000]");

  if (device == DeviceChoice::kCpu && backend == BackendChoice::kNccl)
    throw UsageError("--backend 'nccl' needs CUDA tensors, but --device is 'cpu' (use --backend gloo or auto)");
  if (ampDtype != "auto" && ampDtype != "float16" && ampDtype != "bfloat16")
    bad("--amp-dtype", ampDtype, "must be auto, float16 or bfloat16");
  if (device == DeviceChoice::kCpu && amp && ampDtype == "float16" && !amp::autocastSupported(torch::kCPU, torch::kHalf))
    throw UsageError("--amp with float16 needs CUDA, but --device is 'cpu' (use --amp-dtype bfloat16 on the CPU, or --device cuda)");
  if (shardCopies < 0 || shardCopies > 1) bad("--shard-copies", std::to_string(shardCopies), "must be 0 or 1");
  validatePipelineRanges(*this);
  // What the strategies the flags ask for do not do (strategy_table.cpp), then what a captured step
  // cannot hold.
  checkStrategy(*this);
  if (cudaGraphs) validateCudaGraphs(*this);
  if (timeout.count() < 1 || timeout.count() > 7 * 24 * 3600)
    bad("--timeout", std::to_string(timeout.count()), "must be in [1, 604800] seconds");
  if (threads < 0 || threads > 1024) bad("--threads", std::to_string(threads), "must be in [0, 1024]");
  finiteIn("--bucket-cap-mb", bucketCapMb, 0.0, 1e6, true, false);
  if (stepDelay.count() < 0 || stepDelay.count() > 60000)
    bad("--step-delay-ms", std::to_string(stepDelay.count()), "must be in [0, 60000]");
  if (holdAfterStep < 0) bad("--hold-after-step", std::to_string(holdAfterStep), "must be 0 (never) or a global step");
  if ((holdAfterStep > 0) != !holdFile.empty())
    throw UsageError(holdAfterStep > 0 ? "--hold-after-step needs --hold-file (the file it waits for)"
                                       : "--hold-file '" + holdFile.string() + "' needs --hold-after-step");
}

namespace {

// `dir` exists (made if missing) and a file can be created in it. `what` names the flag and value.
void checkWritableDirectory(const std::string& what, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path d = dir.empty() ? fs::path(".") : dir;
  if (fs::exists(d, ec) && !fs::is_directory(d, ec))
    throw UsageError(what + ": '" + d.string() + "' is not a directory");
  fs::create_directories(d, ec);
  if (ec) throw UsageError(what + ": cannot create the directory '" + d.string() + "': " + ec.message());
  // access(W_OK) says yes to root on a read-only mount: create a file for real.
  const fs::path probe = d / (".ctorch-write-check-" + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    const int err = errno;
    throw UsageError(what + ": cannot write in '" + d.string() + "': " + std::strerror(err));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

// Whether an output may be a symbolic link. The files the run only writes are replaced by a rename
// (the link, not its target) or written through it as the user asked; the metrics file is also read
// back on resume, and a link there lets another place (/dev/zero, someone else's file) feed it.
enum class Links { kAllowed, kRefused };

// `file` is absent or a regular file (never a directory, FIFO or device) or, when `links` allows,
// a symbolic link; in a writable directory.
void checkOutputFile(const std::string& flag, const std::filesystem::path& file, const std::string& example,
                     Links links = Links::kAllowed) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::symlink_status(file, ec);
  const std::string what = flag + " '" + file.string() + "'";
  if (!ec && fs::exists(st)) {
    if (fs::is_directory(st))
      throw UsageError(what + " is a directory: name a file in it (e.g. " + flag + " " +
                       (file / example).string() + ")");
    if (fs::is_symlink(st) && links == Links::kRefused) {
      const auto target = fs::read_symlink(file, ec);
      throw UsageError(what + " is a symbolic link" + (ec ? "" : " (to '" + target.string() + "')") +
                       ": this file is read back on resume and rewritten, so it must be a regular file (move the "
                       "link away, or name another file)");
    }
    if (!fs::is_regular_file(st) && !fs::is_symlink(st))
      throw UsageError(what + " is not a regular file (a FIFO, socket or device): name a file");
  }
  checkWritableDirectory(what, file.has_parent_path() ? file.parent_path() : fs::path("."));
}

}  // namespace

void TrainOptions::resolveAmpDtype(bool cuda) {
  if (ampDtype == "auto") ampDtype = cuda ? "float16" : "bfloat16";
}

void TrainOptions::checkOutputs() const {
  // The slot's own rule (ctorch::snapshotPathProblem, as validate() asked it), then its directory.
  if (auto problem = snapshotPathProblem(snapshotPath, "--snapshot-path")) throw UsageError(*problem);
  checkWritableDirectory("--snapshot-path '" + snapshotPath.string() + "'",
                         snapshotPath.has_parent_path() ? snapshotPath.parent_path() : std::filesystem::path("."));
  checkWritableDirectory("--model-dir '" + outputDir().string() + "'", outputDir());
  checkOutputFile("--model-filename", finalModelPath(), "model.pt");
  if (const auto metrics = metricsPath())
    checkOutputFile("--metrics-file", *metrics, "metrics.jsonl", Links::kRefused);
  if (!tensorboardDir.empty())
    checkWritableDirectory("--tensorboard-dir '" + tensorboardDir.string() + "'", tensorboardDir);
  if (profileFirst > 0) checkOutputFile("--profile-file", profilePath(0), "trace.json");
}

std::filesystem::path TrainOptions::profilePath(int rank) const {
  if (profileFile.empty()) return outputDir() / ("trace-rank" + std::to_string(rank) + ".json");
  std::string p = profileFile.string();
  for (auto at = p.find("{rank}"); at != std::string::npos; at = p.find("{rank}"))
    p.replace(at, 6, std::to_string(rank));
  return p;
}

std::filesystem::path TrainOptions::outputDir() const {
  if (!modelDir.empty()) return modelDir;
  return snapshotPath.has_parent_path() ? snapshotPath.parent_path() : std::filesystem::path(".");
}

std::optional<std::filesystem::path> TrainOptions::metricsPath() const {
  if (!metricsFile) return outputDir() / "metrics.jsonl";
  if (metricsFile->empty()) return std::nullopt;
  return *metricsFile;
}

std::map<std::string, std::string> TrainOptions::bindingConfig() const {
  std::map<std::string, std::string> c;
  c["model"] = model;
  c["dataset"] = dataset;
  c["train_limit"] = std::to_string(trainLimit);
  c["synthetic_size"] = std::to_string(syntheticSize);
  // Only when given, so that snapshots written before the flag existed still match.
  if (!syntheticShape.empty()) {
    std::string shape;
    for (auto v : syntheticShape) shape += (shape.empty() ? "" : ",") + std::to_string(v);
    c["synthetic_shape"] = shape;
  }
  c["augment"] = toString(augment);
  c["batch_size"] = std::to_string(batchSize);
  c["grad_accum_steps"] = std::to_string(gradAccumSteps);
  c["optimizer"] = toString(optimizer);
  c["lr"] = number(lr);
  c["weight_decay"] = number(weightDecay);
  if (clipGradNorm > 0) c["clip_grad_norm"] = number(clipGradNorm);  // only when on: older snapshots match
  if (optimizer == OptimizerKind::kSgd) c["momentum"] = number(momentum);
  c["warmup_epochs"] = number(warmupEpochs);
  if (warmupEpochs > 0) c["warmup_start_factor"] = number(warmupStartFactor);
  c["lr_decay"] = toString(lrDecay);
  if (lrDecay == LrDecay::kStep) {
    c["lr_step_epochs"] = std::to_string(lrStepEpochs);
    c["lr_gamma"] = number(lrGamma);
  }
  // A cosine, linear or one-cycle schedule spans the whole run: its length shapes every step's rate.
  if (lrDecay == LrDecay::kCosine || lrDecay == LrDecay::kLinear || lrDecay == LrDecay::kOneCycle) {
    c["min_lr"] = number(minLr);
    c["epochs"] = std::to_string(epochs);
  }
  c["seed"] = std::to_string(seed);
  c["amp"] = amp ? ampDtype : "off";
  // Only when set (older snapshots match): a lower precision changes every step's result.
  if (!fsdpParamDtype.empty()) c["fsdp_param_dtype"] = fsdpParamDtype;
  if (!fsdpReduceDtype.empty()) c["fsdp_reduce_dtype"] = fsdpReduceDtype;
  // Only with a pipeline (older snapshots match): the stages' shards and the micro-batches' seeds and
  // sums (the schedule does not change a step's result).
  if (pipelineStages > 1) {
    c["pipeline_stages"] = std::to_string(pipelineStages);
    c["micro_batches"] = std::to_string(microBatches);
  }
  // Only with a parameter server (older snapshots match): the servers do not read data, so the same
  // world size splits the data another way.
  if (sync == SyncChoice::kParameterServer) {
    c["sync"] = toString(sync);
    c["ps_servers"] = std::to_string(psServers);
  }
  return c;
}

std::string TrainOptions::describe() const {
  std::ostringstream os;
  os << "model " << model << ", dataset " << dataset;
  if (trainLimit > 0) os << " (first " << trainLimit << ")";
  os << ", " << epochs << " epochs, batch " << batchSize << " per rank";
  if (gradAccumSteps > 1) os << " x " << gradAccumSteps << " micro-steps";
  os << ", " << toString(optimizer) << " lr " << number(lr);
  if (optimizer == OptimizerKind::kSgd) os << " momentum " << number(momentum);
  if (optimizerKernels != optim::Kernels::kAuto) os << " (" << optim::toString(optimizerKernels) << " kernels)";
  if (weightDecay > 0) os << " weight decay " << number(weightDecay);
  if (warmupEpochs > 0) os << ", warmup " << number(warmupEpochs) << " epochs from x" << number(warmupStartFactor);
  if (lrDecay != LrDecay::kNone) os << ", " << toString(lrDecay) << " decay";
  if (clipGradNorm > 0) os << ", gradients clipped to norm " << number(clipGradNorm);
  if (amp) os << ", " << ampDtype << " autocast" << (ampDtype == "float16" ? " with loss scaling" : "");
  if (sharding == ShardingChoice::kOptimizer) os << ", optimizer state sharded over the ranks (ZeRO-1)";
  if (sharding == ShardingChoice::kGradOp) os << ", gradients and optimizer state sharded over the ranks (FSDP SHARD_GRAD_OP)";
  if (sharding == ShardingChoice::kFull) os << ", parameters, gradients and optimizer state sharded over the ranks (FSDP FULL_SHARD)";
  if (sharding == ShardingChoice::kHybrid)
    os << ", parameters, gradients and optimizer state sharded over each node's ranks, replicated across nodes (FSDP HYBRID_SHARD)";
  if (sharding == ShardingChoice::kHybridGradOp)
    os << ", gradients and optimizer state sharded over each node's ranks, replicated across nodes (FSDP _HYBRID_SHARD_ZERO2)";
  if (!fsdpParamDtype.empty() || !fsdpReduceDtype.empty())
    os << ", gathered in " << (fsdpParamDtype.empty() ? "float32" : fsdpParamDtype) << " and reduced in "
       << (!fsdpReduceDtype.empty() ? fsdpReduceDtype : fsdpParamDtype.empty() ? "float32" : fsdpParamDtype);
  if (sync == SyncChoice::kParameterServer)
    os << ", parameter server on the last " << psServers << (psServers == 1 ? " rank" : " ranks");
  if (pipelineStages > 1)
    os << ", a pipeline of " << pipelineStages << " stages, " << microBatches << " micro-batches per batch ("
       << (pipelineSchedule == PipelineScheduleKind::kGPipe ? "GPipe" : "1F1B") << ")";
  os << ", seed " << seed << ", snapshot " << snapshotPath.string();
  return os.str();
}

}  // namespace ctorch::train
