// The training loop of ctorch-train. runTraining() reads top to bottom; the helpers above it each
// do one thing (build the data, the model, resume, take a step, write a snapshot).
//
// Determinism (what makes a resumed run bit-identical to an uninterrupted one on CPU, same world
// size): the data order is the DistributedSampler's (seed + epoch) and its position is in the
// snapshot; augmentation is a pure function of (seed, epoch, sample index); the random generator
// is re-seeded before every step from (seed, rank, global step), so dropout needs no saved RNG
// state; the learning rate is a pure function of (epoch, step); optimizer state, parameters and
// buffers come from the snapshot.
#include "ctorch/train/trainer.hpp"

#include "ctorch/train/grad_scaler.hpp"
#include "ctorch/train/memory_check.hpp"
#include "ctorch/train/process_tuning.hpp"
#include "ctorch/train/report.hpp"
#include "ctorch/train/resume.hpp"
#include "ctorch/train/schedule.hpp"
#include "ctorch/train/snapshot_writer.hpp"
#include "ctorch/train/stop_signal.hpp"

#include <ctorch/compat.hpp>
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/data/loader.hpp>
#include <ctorch/data/registry.hpp>
#include <ctorch/data/transforms.hpp>
#include <ctorch/ddp.hpp>
#include <ctorch/distributed.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/sampler.hpp>
#include <ctorch/snapshot.hpp>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <regex>
#include <sstream>
#include <thread>

namespace ctorch::train {

int RunResult::exitCode() const {
  return status == RunStatus::kPreempted ? contract::kExitPreempted : contract::kExitSuccess;
}

namespace {

using Clock = std::chrono::steady_clock;
using Model = models::Model;
using DDP = DistributedDataParallel<std::shared_ptr<Model>>;

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// CPU time of this process, all threads (what a step costs, independent of other processes' load).
double processCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

std::string withThousands(std::int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

std::string shapeText(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string percent(double fraction) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.2f%%", 100.0 * fraction);
  return buffer;
}

// ---- devices and the process group ----------------------------------------------------------------

torch::Device chooseDevice(const TrainOptions& o) {
  const bool cuda = torch::cuda::is_available();
  if (o.device == DeviceChoice::kCuda && !cuda)
    throw UsageError("--device 'cuda' but no CUDA device is available to this LibTorch");
  const bool useCuda = o.device == DeviceChoice::kCuda || (o.device == DeviceChoice::kAuto && cuda);
  if (!useCuda) {
    if (o.amp) throw UsageError("--amp needs CUDA, and this run uses the CPU");
    if (o.backend == BackendChoice::kNccl)
      throw UsageError("--backend 'nccl' needs CUDA tensors, and this run uses the CPU");
    return torch::kCPU;
  }
  return torch::Device(torch::kCUDA);  // the index is chosen once the local rank is known
}

ProcessGroupOptions processGroupOptions(const TrainOptions& o, const torch::Device& device) {
  Backend backend = Backend::kGloo;
  if (device.is_cuda()) backend = o.backend == BackendChoice::kGloo ? Backend::kGloo : Backend::kNccl;
  return ProcessGroupOptions().backend(backend).timeout(o.timeout);
}

// cuda:LOCAL_RANK (cuda:0 when each rank sees one GPU), made the current device.
torch::Device bindDevice(const torch::Device& device) {
  if (!device.is_cuda()) return device;
  const auto count = static_cast<int>(torch::cuda::device_count());
  const int index = count == 1 ? 0 : getLocalRank();
  if (index >= count)
    throw ConfigError("LOCAL_RANK " + std::to_string(getLocalRank()) + " has no GPU: " + std::to_string(count) +
                      " CUDA devices are visible");
  const torch::Device bound(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(bound);
  return bound;
}

// The default process group for the duration of the run.
class ProcessGroupScope {
 public:
  explicit ProcessGroupScope(const ProcessGroupOptions& options) { group_ = initProcessGroup(options); }
  ~ProcessGroupScope() {
    try {
      destroyProcessGroup();
    } catch (...) {
    }
  }
  ProcessGroupScope(const ProcessGroupScope&) = delete;
  ProcessGroupScope& operator=(const ProcessGroupScope&) = delete;
  c10d::ProcessGroup& group() { return *group_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
};

// Small collectives on the tensors' device the backend serves.
std::vector<double> allReduceSum(c10d::ProcessGroup& group, const std::vector<double>& values,
                                 const torch::Device& commDevice) {
  std::vector<at::Tensor> t{torch::tensor(values, torch::kFloat64).to(commDevice)};
  group.allreduce(t)->wait();
  const auto cpu = t[0].cpu();
  return {cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel()};
}

std::vector<double> allReduceMax(c10d::ProcessGroup& group, const std::vector<double>& values,
                                 const torch::Device& commDevice) {
  std::vector<at::Tensor> t{torch::tensor(values, torch::kFloat64).to(commDevice)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group.allreduce(t, options)->wait();
  const auto cpu = t[0].cpu();
  return {cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel()};
}

// ---- data and model ----------------------------------------------------------------------------------

struct TrainData {
  std::shared_ptr<const data::InMemoryDataset> train, test;
  std::shared_ptr<const data::BatchPipeline> trainPipeline, testPipeline;
  bool augmented = false;
};

TrainData loadData(const TrainOptions& o) {
  auto options = [&](data::Split split, std::int64_t limit) {
    data::DatasetOptions d;
    d.name = o.dataset;
    d.root = o.dataDir;
    d.split = split;
    d.limit = limit;
    d.seed = static_cast<std::uint64_t>(o.seed);
    d.syntheticSize = split == data::Split::Train ? o.syntheticSize : 0;
    if (!o.syntheticShape.empty()) d.imageShape = o.syntheticShape;
    return d;
  };
  TrainData d;
  try {
    d.train = std::make_shared<const data::InMemoryDataset>(data::loadDataset(options(data::Split::Train, o.trainLimit)));
    d.test = std::make_shared<const data::InMemoryDataset>(data::loadDataset(options(data::Split::Test, o.testLimit)));
  } catch (const data::DataFileError& e) {
    // Unlike Fashion-MNIST (Debian's package), CIFAR-10 is not installed anywhere: say where it comes from.
    if (o.dataset != "cifar10") throw;
    throw data::DataFileError(std::string(e.what()) +
                              "; --dataset cifar10 reads the CIFAR-10 binary version: download cifar-10-binary.tar.gz "
                              "from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it, and pass the directory "
                              "holding data_batch_1.bin ... data_batch_5.bin and test_batch.bin as --data-dir");
  }
  data::PipelineOptions trainOptions;
  d.augmented = o.augment == AugmentChoice::kOn ||
                (o.augment == AugmentChoice::kAuto && d.train->info().recommendsCropFlip);
  if (d.augmented) {
    data::AugmentOptions augment;
    augment.seed = static_cast<std::uint64_t>(o.seed);
    trainOptions.augment = augment;
  }
  d.trainPipeline = std::make_shared<const data::BatchPipeline>(d.train, trainOptions);
  d.testPipeline = std::make_shared<const data::BatchPipeline>(d.test, data::PipelineOptions{});
  return d;
}

models::ModelOptions modelOptionsFor(const TrainOptions& o, const data::InMemoryDataset& train) {
  models::ModelOptions m;
  m.name = o.model;
  const auto shape = train.sampleShape();
  const bool regression = train.info().task == data::Task::Regression;
  if (o.model == "linear") {
    if (!regression || shape.size() != 1)
      throw UsageError("--model 'linear' needs regression data with feature vectors, but --dataset '" + o.dataset +
                       "' has samples of shape " + shapeText(shape) + " and " +
                       (regression ? "regression" : "class") + " targets");
    m.inFeatures = shape[0];
    m.outFeatures = train.targets().dim() > 1 ? train.targets().size(1) : 1;
    return m;
  }
  if (regression || shape.size() != 3 || shape[1] != shape[2])
    throw UsageError("--model '" + o.model + "' needs square images [C, H, W] with class labels, but --dataset '" +
                     o.dataset + "' has samples of shape " + shapeText(shape));
  m.inChannels = shape[0];
  m.imageSize = shape[1];
  m.numClasses = train.info().numClasses;
  return m;
}

// Heap bytes one sample's forward pass keeps for backward, measured on a throw-away copy of the model
// with a few zero samples before the real one is seeded and built. CPU only (on a GPU the activations
// are not on this heap); 0 when it cannot be measured.
std::int64_t measureActivationBytes(const models::ModelOptions& options, const std::vector<std::int64_t>& sampleShape) {
  constexpr std::int64_t kSamples = 8;
  const auto probe = models::createModel(options);
  probe->train();
  std::vector<std::int64_t> shape{kSamples};
  shape.insert(shape.end(), sampleShape.begin(), sampleShape.end());
  const auto input = torch::zeros(shape);
  probe->forward(input.narrow(0, 0, 2));  // one-time allocations (thread pools, kernel caches) first
  const auto before = heapBytesInUse();
  const auto output = probe->forward(input);
  const auto after = heapBytesInUse();
  if (!before || !after || *after <= *before) return 0;
  return (*after - *before) / kSamples;
}

std::int64_t sampleBytes(const std::vector<std::int64_t>& shape) {
  std::int64_t n = static_cast<std::int64_t>(sizeof(float));
  for (auto d : shape) n *= d;
  return n;
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const TrainOptions& o, const std::vector<torch::Tensor>& params) {
  if (o.optimizer == OptimizerKind::kAdam)
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr).weight_decay(o.weightDecay));
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weightDecay));
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

// Dropout draws from the global generator: re-seeding it from (seed, rank, step) makes every step's
// randomness independent of how the run got there (fresh, resumed, restarted).
void seedStep(std::int64_t seed, int rank, std::int64_t globalStep) {
  torch::manual_seed(data::mixBits(static_cast<std::uint64_t>(seed), static_cast<std::uint64_t>(rank),
                                   static_cast<std::uint64_t>(globalStep)));
}

std::int64_t ceilDiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// A step that failed in LibTorch or Gloo (a peer died, stopped or went away; a collective timed
// out) becomes one line saying where, with the hang guard's bound.
[[noreturn]] void stepFailed(const std::exception& e, int rank, std::int64_t globalStep, std::chrono::seconds timeout) {
  std::string text;
  if (const auto* c10 = dynamic_cast<const c10::Error*>(&e)) text = c10->what_without_backtrace();
  else text = e.what();
  if (const auto cut = text.find('\n'); cut != std::string::npos) text.resize(cut);
  const std::string message = "rank " + std::to_string(rank) + ": step " + std::to_string(globalStep + 1) +
                              " failed: " + text + " (collectives give up on a silent peer after --timeout " +
                              std::to_string(timeout.count()) + " s)";
  for (const char* needle : {"imed out", "imeout"})
    if (text.find(needle) != std::string::npos) throw DistributedTimeout(message);
  throw DistributedError(message);
}

// ---- where the run stands ----------------------------------------------------------------------------

struct RunState {
  std::int64_t epoch = 0;        // the epoch in progress (== completed epochs)
  std::int64_t stepInEpoch = 0;  // optimizer steps done in it
  std::int64_t globalStep = 0;
  double trainSecondsBefore = 0; // training time of earlier processes of this run
  double bestAccuracy = -1.0;
};

struct Names {
  std::filesystem::path slot, boundarySlot;
};

// ---- snapshots ---------------------------------------------------------------------------------------

constexpr const char* kEpochComplete = "epoch_complete";
constexpr const char* kTrainSeconds = "train_seconds";
constexpr const char* kBestAccuracy = "best_accuracy";
constexpr const char* kDdpBuckets = "ddp_buckets";

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

struct Loaded {
  std::optional<Snapshot> snapshot;
  std::string skipped;  // what was passed over, for the log
  std::vector<SkippedSnapshot> skippedFiles;
};

Loaded loadFromSlot(const std::filesystem::path& slot, const LoadNewestOptions& options, bool allowNothingValid) {
  auto search = loadNewestValid(slot, options);
  Loaded out;
  out.skipped = search.describeSkipped();
  out.skippedFiles = search.skipped;
  if (!search.snapshot && !search.skipped.empty() && !allowNothingValid)
    throw ConfigError("no usable snapshot in " + slot.string() + " (" + out.skipped +
                      "); remove the files or start over with --resume never");
  out.snapshot = std::move(search.snapshot);
  return out;
}

// Finds the snapshot to resume from (every rank reads the files itself) and says what it does.
// `unusable` receives the slot files that were skipped as corrupt.
std::optional<Snapshot> findResumePoint(const TrainOptions& o, const SnapshotIdentity& identity, const Names& names,
                                        Console& console, std::int64_t worldSize,
                                        std::vector<SkippedSnapshot>& unusable) {
  if (o.resume.kind == ResumeChoice::Kind::kNever) {
    console.line("resume: --resume never: starting from scratch");
    return std::nullopt;
  }
  LoadNewestOptions load;
  // --allow-config-change lets hyper-parameters differ, never the model: another model's weights
  // cannot fit, and the refusal should name both models rather than fail later in DDP or restore.
  load.expect.modelName = identity.modelName;
  if (!o.allowConfigChange) load.expect.config = identity.config;

  Loaded newest;
  if (o.resume.kind == ResumeChoice::Kind::kPath)
    newest.snapshot = loadSnapshot(o.resume.path, load.expect);
  else
    newest = loadFromSlot(names.slot, load, /*allowNothingValid=*/false);
  if (!newest.skipped.empty()) console.line("resume: " + newest.skipped);
  unusable = newest.skippedFiles;

  std::optional<SnapshotPoint> newestPoint, boundaryPoint;
  if (newest.snapshot) newestPoint = pointOf(*newest.snapshot);
  Loaded boundary;
  if (needsEpochBoundary(newestPoint, worldSize)) {
    boundary = loadFromSlot(names.boundarySlot, load, /*allowNothingValid=*/true);
    if (!boundary.skipped.empty()) console.line("resume: " + boundary.skipped);
    unusable.insert(unusable.end(), boundary.skippedFiles.begin(), boundary.skippedFiles.end());
    if (boundary.snapshot) boundaryPoint = pointOf(*boundary.snapshot);
  }
  const ResumePlan plan = planResume(newestPoint, boundaryPoint, worldSize, names.boundarySlot);
  console.line("resume: " + plan.message);
  switch (plan.source) {
    case ResumeSource::kNone: return std::nullopt;
    case ResumeSource::kNewest: return std::move(newest.snapshot);
    case ResumeSource::kBoundary: return std::move(boundary.snapshot);
  }
  return std::nullopt;
}

// A snapshot of another configuration is refused naming each difference; this adds the ways on.
[[noreturn]] void refuseSnapshot(const SnapshotIncompatible& e, const TrainOptions& o) {
  throw ConfigError(std::string(e.what()) + "; to go on, pass --resume never (start over, replacing " +
                    o.snapshotPath.string() + ")" +
                    (o.allowConfigChange ? "" : ", --allow-config-change (continue from its weights with this run's settings)") +
                    " or another --snapshot-path (keep that run)");
}

// The DDP bucket layout the snapshot's run used (absent in snapshots of other writers).
std::optional<std::vector<std::vector<size_t>>> bucketsOf(const std::optional<Snapshot>& snap) {
  if (!snap || !snap->userState.contains(kDdpBuckets)) return std::nullopt;
  std::vector<std::vector<size_t>> buckets;
  for (const auto& bucket : snap->userState.at(kDdpBuckets).toList()) {
    buckets.emplace_back();
    for (const auto& index : bucket.get().toList()) buckets.back().push_back(static_cast<size_t>(index.get().toInt()));
  }
  return buckets;
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

// Restores the snapshot into the live objects and returns where the run stands.
RunState restoreFrom(const Snapshot& snap, const TrainingObjects& objects, GradScaler& scaler) {
  RestoreOptions restore;
  restore.rng = false;  // re-seeded every step (seedStep)
  restoreSnapshot(snap, objects, restore);
  scaler.loadFrom(snap.userState);
  const SnapshotPoint p = pointOf(snap);
  RunState state;
  state.epoch = p.epochsRun;
  state.stepInEpoch = p.stepInEpoch;
  state.globalStep = p.globalStep;
  if (snap.userState.contains(kTrainSeconds)) state.trainSecondsBefore = snap.userState.at(kTrainSeconds).toDouble();
  if (snap.userState.contains(kBestAccuracy)) state.bestAccuracy = snap.userState.at(kBestAccuracy).toDouble();
  return state;
}

std::vector<std::filesystem::path> checkpointFiles(const std::filesystem::path& dir) {
  static const std::regex pattern(R"(checkpoint_epoch_(\d+)\.pt)");
  std::vector<std::pair<long long, std::filesystem::path>> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, pattern)) found.emplace_back(std::stoll(m[1].str()), entry.path());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::filesystem::path> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}


// ---- one optimizer step --------------------------------------------------------------------------------

struct StepOutcome {
  double loss = 0.0;           // mean over this rank's micro-batches
  std::int64_t samples = 0;    // on this rank
};

StepOutcome trainStep(DDP& ddp, Model& model, torch::optim::Optimizer& optimizer, GradScaler& scaler,
                      data::BatchLoader& loader, DistributedSampler& sampler, const TrainOptions& o,
                      const torch::Device& device) {
  ddp.zeroGrad();
  // The last step of an epoch may have fewer micro-batches left; every rank has as many as the others.
  const std::int64_t micro = std::min(o.gradAccumSteps, ceilDiv(sampler.remaining(), o.batchSize));
  StepOutcome out;
  torch::Tensor lossSum = torch::zeros({}, torch::TensorOptions().device(device));
  for (std::int64_t m = 0; m < micro; ++m) {
    auto batch = loader.next();
    if (!batch) throw std::logic_error("the batch loader ended before the sampler's epoch did");
    sampler.advance(batch->size());
    out.samples += batch->size();
    const auto inputs = batch->inputs.to(device, /*non_blocking=*/true);
    const auto targets = batch->targets.to(device, /*non_blocking=*/true);
    // Gradients are all-reduced on the last micro-step only (DDP's no_sync on the others).
    std::optional<NoSyncGuard> noSync;
    if (m + 1 < micro) noSync.emplace(ddp.noSync());
    torch::Tensor loss;
    {
      compat::CudaAutocastGuard autocast(o.amp);
      loss = lossFor(model.output(), ddp(inputs), targets);
    }
    scaler.scale(micro > 1 ? loss / static_cast<double>(micro) : loss).backward();
    lossSum += loss.detach();
  }
  scaler.step(optimizer);
  scaler.update();
  // The bucket regrouping that follows a process's first step happens here rather than in the next
  // forward, so that a snapshot taken now records the layout the next step uses (see bucketsOf).
  ddp.rebuildBuckets();
  out.loss = lossSum.item<double>() / static_cast<double>(micro);
  return out;
}

}  // namespace

RunResult runTraining(const TrainOptions& o, const RunHooks& hooks) {
  o.validate();
  tuneAllocator();
  const auto runStart = Clock::now();

  // ---- the process group; rank roles named once
  const torch::Device wanted = chooseDevice(o);
  ProcessGroupScope pg(processGroupOptions(o, wanted));
  c10d::ProcessGroup& group = pg.group();
  const int rank = getRank();
  const int worldSize = getWorldSize();
  const bool isMainProcess = ctorch::isMainProcess();  // prints, writes snapshots, metrics and weights
  const torch::Device device = bindDevice(wanted);
  const torch::Device commDevice = getBackendName() == "nccl" ? device : torch::Device(torch::kCPU);
  const ThreadChoice threads = configureThreads(o.threads, getLocalWorldSize());
  Console console(isMainProcess ? hooks.out : nullptr, o.progress, hooks.terminal);
  console.line("ctorch-train: " + getDistributedEnv().describe() + ", device " + device.str() + ", backend " +
               getBackendName() + ", " + std::to_string(threads.threads) + " thread" +
               (threads.threads == 1 ? "" : "s") + " per rank (" + threads.reason + ")");
  console.line("config: " + o.describe());

  // ---- data and model
  const auto dataStart = Clock::now();
  const TrainData data = loadData(o);
  console.line("data: " + o.dataset + ", " + withThousands(data.train->size()) + " training / " +
               withThousands(data.test->size()) + " test samples of " + shapeText(data.train->sampleShape()) +
               (data.augmented ? ", crop+flip augmentation" : "") + " (loaded in " +
               formatDuration(secondsSince(dataStart)) + ")");
  const models::ModelOptions modelOptions = modelOptionsFor(o, *data.train);
  const std::int64_t activationBytes = device.is_cpu() ? measureActivationBytes(modelOptions, data.train->sampleShape()) : 0;
  torch::manual_seed(static_cast<std::uint64_t>(o.seed));  // initial weights (DDP broadcasts rank 0's anyway)
  const std::shared_ptr<Model> model = models::createModel(modelOptions);
  model->to(device);

  // ---- the snapshot to resume from (found before DDP is built: it carries DDP's bucket layout)
  const SnapshotIdentity identity{o.model, worldSize, o.bindingConfig()};
  const Names names{o.snapshotPath, boundarySlotFor(o.snapshotPath)};
  std::vector<SkippedSnapshot> unusableFiles;
  std::optional<Snapshot> resumeFrom;
  try {
    resumeFrom = findResumePoint(o, identity, names, console, worldSize, unusableFiles);
  } catch (const SnapshotIncompatible& e) {
    refuseSnapshot(e, o);
  }

  // ---- DDP, optimizer, sampler, loss scaling, schedule
  if (o.gradientAsBucketView) {
    // Gradients that exist when the Reducer is built become bucket views at once; it then averages
    // every step with one in-place division. Left undefined, each process's first step would instead
    // multiply by 1/world while copying into the bucket, which rounds differently when the world
    // size is not a power of two: a resumed process would not repeat its predecessor bit for bit.
    torch::NoGradGuard noGrad;
    for (auto& p : model->parameters())
      if (p.requires_grad()) p.mutable_grad() = torch::zeros_like(p);
  }
  DDP ddp(model, DDPOptions()
                     .bucketCapMb(o.bucketCapMb)
                     .findUnusedParameters(o.findUnusedParameters)
                     .gradientAsBucketView(o.gradientAsBucketView)
                     .bucketAssignment(bucketsOf(resumeFrom)));
  const auto optimizer = makeOptimizer(o, ddp.parameters());
  GradScaler scaler(o.amp, device);
  DistributedSamplerOptions samplerOptions;
  samplerOptions.datasetSize = data.train->size();
  samplerOptions.worldSize = worldSize;
  samplerOptions.rank = rank;
  samplerOptions.seed = o.seed;
  DistributedSampler sampler(samplerOptions);
  {
    BatchMemoryInputs batch;
    batch.batchSize = o.batchSize;
    batch.shardSize = sampler.size();
    batch.datasetSize = data.train->size();
    batch.worldSize = worldSize;
    batch.localRanks = getLocalWorldSize();
    batch.inputBytes = sampleBytes(data.train->sampleShape());
    batch.activationBytes = activationBytes;
    batch.prefetch = o.prefetch;
    batch.availableBytes = availableMemory(batch.availableSource);
    if (const std::string problem = checkBatchSize(batch); !problem.empty()) throw UsageError(problem);
  }
  const std::int64_t stepsPerEpoch = ceilDiv(ceilDiv(sampler.size(), o.batchSize), o.gradAccumSteps);
  const LrSchedule schedule = LrSchedule::fromOptions(o);
  console.line("model: " + o.model + ", " + withThousands(models::parameterCount(*model)) + " parameters; global batch " +
               std::to_string(o.batchSize * o.gradAccumSteps * worldSize) + " (" + std::to_string(o.batchSize) +
               " per rank" + (o.gradAccumSteps > 1 ? " x " + std::to_string(o.gradAccumSteps) + " micro-steps" : "") +
               " x " + std::to_string(worldSize) + (worldSize == 1 ? " rank), " : " ranks), ") +
               std::to_string(stepsPerEpoch) + " steps per epoch");

  // ---- restore; every rank loaded the files itself, and all must stand at the same step
  const TrainingObjects objects{model.get(), optimizer.get(), &sampler};
  RunState state;
  try {
    if (resumeFrom) state = restoreFrom(*resumeFrom, objects, scaler);
  } catch (const SnapshotIncompatible& e) {
    refuseSnapshot(e, o);
  }
  // A stop requested while starting up ends the run here (nothing new to save).
  enum class StopPoint { kNone, kBeforeStart, kAfterStep, kEpochEnd };
  StopPoint stopPoint = StopPoint::kNone;
  {
    const double g = static_cast<double>(state.globalStep);
    const auto agreed = allReduceMax(group, {g, -g, stopSignal() != 0 ? 1.0 : 0.0}, commDevice);
    if (agreed[0] != -agreed[1])
      throw DistributedError("ranks resumed from different points (global steps " + std::to_string(-agreed[1]) +
                             " to " + std::to_string(agreed[0]) +
                             "): every rank must see the same snapshot files (a shared file system)");
    if (agreed[2] > 0) stopPoint = StopPoint::kBeforeStart;
  }
  // Corrupt files of the slot are set aside now that every rank has read the slot, so that the next
  // save cannot rotate one into the place of a good fallback (setAsideSkipped).
  if (isMainProcess)
    for (const auto& line : setAsideSkipped(unusableFiles)) console.line("resume: " + line);

  std::optional<MetricsLog> metrics;
  if (isMainProcess && o.metricsPath()) metrics.emplace(*o.metricsPath(), state.globalStep);
  SnapshotWriter writer(/*background=*/true);
  const bool snapshotsOn = o.saveEvery > 0 || o.saveEverySteps > 0;
  auto trainSeconds = [&] { return state.trainSecondsBefore + secondsSince(runStart); };
  auto report = [&console](const std::string& text) { console.line(text); };
  auto reportError = [](const std::string& text) { std::cerr << "ctorch-train: " << text << std::endl; };

  // Rank 0 captures a copy now; the writer thread encodes and writes it while training goes on.
  // kEpochEnd records the next epoch's start; the other two the step just taken. Epoch boundaries
  // also go to the boundary slot, which a run with another world size resumes from.
  enum class When { kMidEpoch, kEpochComplete, kEpochEnd };
  auto snapshot = [&](When when, std::vector<std::filesystem::path> extraFiles, std::function<void()> afterWrite) {
    if (!isMainProcess) return;
    const bool end = when == When::kEpochEnd;
    const TrainingProgress progress{end ? state.epoch + 1 : state.epoch, end ? 0 : state.stepInEpoch,
                                    state.globalStep};
    Snapshot s = captureSnapshot(objects, identity, progress);
    const double at = epochProgress(progress.epochsRun, progress.stepInEpoch, stepsPerEpoch);
    s.schedulerState.insert("kind", std::string(toString(o.lrDecay)));
    s.schedulerState.insert("epoch_progress", at);
    s.schedulerState.insert("lr", schedule.at(at));
    s.userState.insert(kEpochComplete, when == When::kEpochComplete);
    s.userState.insert(kTrainSeconds, trainSeconds());
    s.userState.insert(kBestAccuracy, state.bestAccuracy);
    s.userState.insert("steps_per_epoch", stepsPerEpoch);
    s.userState.insert(kDdpBuckets, bucketsValue(ddp.bucketAssignment()));
    scaler.saveTo(s.userState);
    SnapshotJob job;
    job.snapshot = std::move(s);
    auto add = [&job](const std::filesystem::path& path, int keep) {
      SnapshotSlotOptions slot;
      slot.path = path;
      slot.keepPrevious = keep;
      job.slots.push_back(slot);
    };
    add(names.slot, o.keepSnapshots);
    if (when != When::kMidEpoch) add(names.boundarySlot, 1);
    for (const auto& extra : extraFiles) add(extra, 0);
    job.afterWrite = std::move(afterWrite);
    job.report = report;
    job.reportError = reportError;
    job.label = end ? "end of epoch " + std::to_string(state.epoch + 1)
                    : "epoch " + std::to_string(state.epoch + 1) + ", step " + std::to_string(state.stepInEpoch);
    job.label += ", global step " + std::to_string(state.globalStep);
    writer.submit(std::move(job));
  };

  // Writes only checkpoint_epoch_N.pt (when no snapshot is due at this epoch end).
  auto checkpointOnly = [&](const std::filesystem::path& file, std::function<void()> afterWrite) {
    if (!isMainProcess) return;
    Snapshot s = captureSnapshot(objects, identity, {state.epoch + 1, 0, state.globalStep});
    s.userState.insert(kEpochComplete, false);
    s.userState.insert(kTrainSeconds, trainSeconds());
    s.userState.insert(kBestAccuracy, state.bestAccuracy);
    s.userState.insert(kDdpBuckets, bucketsValue(ddp.bucketAssignment()));
    scaler.saveTo(s.userState);
    SnapshotJob job;
    job.snapshot = std::move(s);
    SnapshotSlotOptions slot;
    slot.path = file;
    slot.keepPrevious = 0;
    job.slots.push_back(slot);
    job.afterWrite = std::move(afterWrite);
    job.report = report;
    job.reportError = reportError;
    job.label = "checkpoint of epoch " + std::to_string(state.epoch + 1);
    writer.submit(std::move(job));
  };

  // After `completed` epochs.
  auto evaluate = [&](std::int64_t completed) {
    const auto evalStart = Clock::now();
    const EvalTotals totals = evaluateDistributed(*model, *data.testPipeline, o.evalBatchSize, device, group);
    std::string line = "epoch " + std::to_string(completed) + "/" + std::to_string(o.epochs) +
                       " test: loss " + std::to_string(totals.loss());
    if (totals.classification) {
      line += ", accuracy " + percent(totals.accuracy()) + " (" + std::to_string(totals.correct) + "/" +
              std::to_string(totals.count) + ")";
      state.bestAccuracy = std::max(state.bestAccuracy, totals.accuracy());
    }
    console.line(line + " in " + formatDuration(secondsSince(evalStart)));
    if (metrics) {
      EvalRecord r;
      r.step = state.globalStep;
      r.epoch = static_cast<double>(completed);
      r.loss = totals.loss();
      if (totals.classification) r.accuracy = totals.accuracy();
      r.correct = totals.correct;
      r.count = totals.count;
      r.time = trainSeconds();
      metrics->write(r);
    }
    return totals;
  };

  RunResult result;
  int stopFlag = stopPoint == StopPoint::kNone ? 0 : 1;  // agreed by all ranks: 1 a stop signal, 2 the step limit
  bool epochEndSaved = false;

  // ---- the epochs
  for (; stopFlag == 0 && state.epoch < o.epochs; ++state.epoch, state.stepInEpoch = 0) {
    sampler.setEpoch(state.epoch);  // right after a mid-epoch resume: keeps the restored position
    data::LoaderOptions loaderOptions;
    loaderOptions.batchSize = o.batchSize;
    loaderOptions.epoch = state.epoch;
    loaderOptions.skipBatches = ceilDiv(sampler.position(), o.batchSize);
    loaderOptions.prefetch = o.prefetch;
    data::BatchLoader loader(data.trainPipeline, sampler.indices(), loaderOptions);

    const auto epochStart = Clock::now();
    const double epochCpuStart = processCpuSeconds();
    auto intervalStart = epochStart;
    const std::int64_t firstStep = state.stepInEpoch;
    double intervalLoss = 0.0, epochLoss = 0.0;
    std::int64_t intervalSteps = 0, intervalSamples = 0, epochSamples = 0;

    while (!sampler.exhausted()) {
      const double lr = schedule.at(epochProgress(state.epoch, state.stepInEpoch, stepsPerEpoch));
      setLearningRate(*optimizer, lr);
      if (hooks.beforeStep) hooks.beforeStep(state.globalStep);
      seedStep(o.seed, rank, state.globalStep);
      StepOutcome step;
      std::vector<double> agreed;
      try {
        step = trainStep(ddp, *model, *optimizer, scaler, loader, sampler, o, device);
        // One small allreduce per step: the mean loss for the log, and whether any rank must stop,
        // so that every rank stops after the same step.
        agreed = allReduceSum(group, {step.loss, stopSignal() != 0 ? 1.0 : 0.0}, commDevice);
      } catch (const Error&) {
        throw;
      } catch (const std::exception& e) {
        stepFailed(e, rank, state.globalStep, o.timeout);
      }
      ++state.stepInEpoch;
      ++state.globalStep;
      const bool limit = o.maxSteps > 0 && state.globalStep >= o.maxSteps &&
                         !(state.epoch + 1 == o.epochs && sampler.exhausted());
      const double loss = agreed[0] / worldSize;
      if (agreed[1] > 0)
        stopFlag = 1;
      else if (limit)
        stopFlag = 2;

      intervalLoss += loss;
      epochLoss += loss;
      ++intervalSteps;
      intervalSamples += step.samples * worldSize;
      epochSamples += step.samples * worldSize;
      const bool periodic = state.globalStep % o.logInterval == 0 || sampler.exhausted();
      if (periodic || console.barMode()) {
        StepReport r;
        r.epoch = state.epoch;
        r.epochs = o.epochs;
        r.stepInEpoch = state.stepInEpoch;
        r.stepsPerEpoch = stepsPerEpoch;
        r.globalStep = state.globalStep;
        r.lr = lr;
        const double elapsed = secondsSince(intervalStart);
        r.loss = intervalLoss / static_cast<double>(intervalSteps);
        r.samplesPerSecond = elapsed > 0 ? static_cast<double>(intervalSamples) / elapsed : 0.0;
        const double perStep = secondsSince(epochStart) / static_cast<double>(state.stepInEpoch - firstStep);
        r.epochEtaSeconds = perStep * static_cast<double>(stepsPerEpoch - state.stepInEpoch);
        r.totalEtaSeconds =
            r.epochEtaSeconds + perStep * static_cast<double>(stepsPerEpoch * (o.epochs - state.epoch - 1));
        console.progress(r, periodic);
        if (periodic) {
          if (metrics) {
            TrainRecord t;
            t.step = state.globalStep;
            t.epoch = epochProgress(state.epoch, state.stepInEpoch, stepsPerEpoch);
            t.loss = r.loss;
            t.lr = lr;
            t.samplesPerSecond = r.samplesPerSecond;
            t.time = trainSeconds();
            t.lossKind = lossKindName(model->output());
            metrics->write(t);
          }
          intervalLoss = 0.0;
          intervalSteps = 0;
          intervalSamples = 0;
          intervalStart = Clock::now();
        }
      }
      if (hooks.afterStep) hooks.afterStep(state.globalStep);
      if (stopFlag != 0) {
        stopPoint = StopPoint::kAfterStep;
        break;
      }
      if (writer.failed()) writer.wait();  // rethrows the failed write: no training on without it
      if (snapshotsOn && o.saveEverySteps > 0 && state.globalStep % o.saveEverySteps == 0 && !sampler.exhausted())
        snapshot(When::kMidEpoch, {}, nullptr);
      if (o.stepDelay.count() > 0) std::this_thread::sleep_for(o.stepDelay);
    }
    if (stopFlag != 0) break;

    // ---- end of the epoch: summary, evaluation, snapshot, checkpoint
    const double epochSeconds = secondsSince(epochStart);
    const std::int64_t stepsRun = state.stepInEpoch - firstStep;
    const double epochRate = static_cast<double>(epochSamples) / std::max(epochSeconds, 1e-9);
    const double meanLoss = stepsRun > 0 ? epochLoss / static_cast<double>(stepsRun) : 0.0;
    console.line("epoch " + std::to_string(state.epoch + 1) + "/" + std::to_string(o.epochs) + " done: " +
                 std::to_string(stepsRun) + " steps in " + formatDuration(epochSeconds) + ", " +
                 std::to_string(std::llround(epochRate)) + " samples/s, train loss " + std::to_string(meanLoss));
    if (metrics) {
      EpochRecord r;
      r.step = state.globalStep;
      r.epoch = state.epoch + 1;
      r.steps = stepsRun;
      r.seconds = epochSeconds;
      r.cpuSeconds = processCpuSeconds() - epochCpuStart;
      r.samplesPerSecond = epochRate;
      r.loss = meanLoss;
      r.time = trainSeconds();
      metrics->write(r);
    }
    const std::int64_t completed = state.epoch + 1;
    const bool lastEpoch = completed == o.epochs;
    if (lastEpoch || (o.evalEvery > 0 && completed % o.evalEvery == 0)) result.lastEval = evaluate(completed);
    const bool saveDue = snapshotsOn && (lastEpoch || o.saveEverySteps > 0 ||
                                         (o.saveEvery > 0 && completed % o.saveEvery == 0));
    const bool checkpointDue = o.checkpointEvery > 0 && completed % o.checkpointEvery == 0;
    std::vector<std::filesystem::path> checkpoint;
    std::function<void()> prune;
    if (checkpointDue) {
      if (isMainProcess) std::filesystem::create_directories(o.outputDir());
      checkpoint.push_back(o.outputDir() / ("checkpoint_epoch_" + std::to_string(completed) + ".pt"));
      prune = [dir = o.outputDir(), keep = static_cast<size_t>(o.keepCheckpoints)] {
        const auto files = checkpointFiles(dir);
        for (size_t i = 0; i + keep < files.size(); ++i) std::filesystem::remove(files[i]);
      };
    }
    if (saveDue)
      snapshot(When::kEpochEnd, checkpoint, prune);
    else if (checkpointDue)
      checkpointOnly(checkpoint.front(), prune);
    // A stop requested during the evaluation or the last step's agreement ends the run at this boundary.
    if (!lastEpoch && allReduceSum(group, {stopSignal() != 0 ? 1.0 : 0.0}, commDevice)[0] > 0) {
      stopFlag = 1;
      stopPoint = StopPoint::kEpochEnd;
      epochEndSaved = saveDue;
      state.epoch = completed;
      state.stepInEpoch = 0;
      break;
    }
  }

  result.epochsRun = state.epoch;
  result.stepInEpoch = state.stepInEpoch;
  result.globalStep = state.globalStep;

  // ---- stopped early: a snapshot of exactly this step, on every rank's word
  if (stopFlag != 0) {
    if (stopPoint == StopPoint::kAfterStep && (snapshotsOn || stopFlag == 1))
      snapshot(sampler.exhausted() ? When::kEpochComplete : When::kMidEpoch, {}, nullptr);
    if (stopPoint == StopPoint::kEpochEnd && !epochEndSaved) {
      // The loop already moved past the epoch: record the boundary it stopped at.
      state.epoch -= 1;
      snapshot(When::kEpochEnd, {}, nullptr);
      state.epoch += 1;
    }
    writer.wait();
    barrier();  // nobody exits before rank 0's snapshot is durable
    const std::string at =
        stopPoint == StopPoint::kEpochEnd
            ? "the end of epoch " + std::to_string(state.epoch) + " (global step " + std::to_string(state.globalStep) + ")"
            : "global step " + std::to_string(state.globalStep) + " (epoch " + std::to_string(state.epoch + 1) +
                  ", step " + std::to_string(state.stepInEpoch) + ")";
    if (stopFlag == 1) {
      result.status = RunStatus::kPreempted;
      result.stopSignal = stopSignal();
      const std::string cause = result.stopSignal != 0 ? std::string(strsignal(result.stopSignal)) + " here"
                                                       : std::string("a stop signal on another rank");
      std::cerr << "ctorch-train: rank " << rank << "/" << worldSize << " stopped after " << at << ": " << cause
                << std::endl;
      if (stopPoint == StopPoint::kBeforeStart)
        console.line("stopped on request before the first step; nothing new to save; run the same command again "
                     "to start (exit code " + std::to_string(contract::kExitPreempted) + ")");
      else
        console.line("stopped on request after " + at + "; snapshot " + names.slot.string() +
                     " written; run the same command again to resume (exit code " +
                     std::to_string(contract::kExitPreempted) + ")");
    } else {
      result.status = RunStatus::kStepLimit;
      console.line("reached --max-steps " + std::to_string(o.maxSteps) + " at " + at +
                   (snapshotsOn ? "; snapshot written: run again with a higher --max-steps to continue" : ""));
    }
    return result;
  }

  // ---- done: the final weights (a resumed finished run evaluates and writes them again)
  if (!result.lastEval) result.lastEval = evaluate(state.epoch);
  writer.wait();
  if (isMainProcess) {
    ctorch::saveStateDict(*model, o.finalModelPath());
    console.line("done: " + std::to_string(o.epochs) + " epochs, " + std::to_string(state.globalStep) +
                 " steps, " + formatDuration(trainSeconds()) + " of training; final weights " +
                 o.finalModelPath().string() +
                 (result.lastEval->classification ? ", test accuracy " + percent(result.lastEval->accuracy()) : ""));
  }
  barrier();
  return result;
}

}  // namespace ctorch::train
