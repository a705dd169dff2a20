// The command line of ctorch-train (CLI11) and the one validation of TrainOptions.
#include "ctorch/train/options.hpp"

#include <ctorch/amp.hpp>
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/version.hpp>

#include <CLI/CLI.hpp>

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

namespace {

const std::vector<std::string> kModels = {"linear", "mnist-cnn", "simple-cnn", "resnet18"};
const std::vector<std::string> kDatasets = {"fashion-mnist", "mnist", "cifar10", "synthetic-regression",
                                            "synthetic-images"};

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// The shortest text that reads back as exactly `v` (0.05, not 0.050000000000000003).
std::string number(double v) {
  for (int precision = 1; precision <= 17; ++precision) {
    std::ostringstream os;
    os.precision(precision);
    os << v;
    if (std::stod(os.str()) == v || !std::isfinite(v)) return os.str();
  }
  return std::to_string(v);
}

[[noreturn]] void bad(const std::string& flag, const std::string& value, const std::string& why) {
  throw UsageError(flag + " '" + value + "' " + why);
}

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

// --batch_size -> --batch-size (only the flag name, not a value after '=').
std::string kebab(const std::string& arg) {
  if (arg.rfind("--", 0) != 0) return arg;
  const auto eq = arg.find('=');
  std::string name = arg.substr(0, eq);
  std::replace(name.begin() + 2, name.end(), '_', '-');
  return eq == std::string::npos ? name : name + arg.substr(eq);
}


// ---- the command line before CLI11 sees it ----------------------------------------------------------
// CLI11's own messages ("The following arguments were not expected: 1 --epoch", "Could not convert")
// neither quote the flag the way the other errors do nor say what to type instead, and their text
// differs between CLI11 releases. Everything a user can get wrong in the shape of the command line is
// therefore checked here first, against the options as they were added to the app.

enum class ValueKind { kFlag, kInt64, kInt32, kNumber, kText };

// The flags ctorch-train knows, by their kebab spelling ("--batch-size").
using FlagKinds = std::map<std::string, ValueKind>;

// Restricted Damerau-Levenshtein distance: insertions, deletions, substitutions and swaps of two
// neighbouring characters (--lr-deacy) each cost one.
std::size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// " (did you mean --epochs?)" for --epoch: the known flags that start with what was typed, else the
// nearest ones within a third of its length in edits (at least 2); "" when nothing is close.
std::string didYouMean(const std::string& typed, const FlagKinds& known) {
  std::vector<std::string> near;
  for (const auto& [name, kind] : known)
    if (typed.size() > 2 && name.rfind(typed, 0) == 0) near.push_back(name);
  if (near.empty()) {
    const std::size_t limit = std::max<std::size_t>(2, (typed.size() - 2) / 3);
    std::size_t best = limit + 1;
    for (const auto& [name, kind] : known) {
      const std::size_t dist = editDistance(typed.substr(2), name.substr(2));
      if (dist < best) near.clear(), best = dist;
      if (dist == best) near.push_back(name);
    }
  }
  if (near.empty()) return "";
  if (near.size() > 3) near.resize(3);
  std::string out = " (did you mean ";
  for (std::size_t i = 0; i < near.size(); ++i) out += (i == 0 ? "" : i + 1 == near.size() ? " or " : ", ") + near[i];
  return out + "?)";
}

bool isWholeNumber(const std::string& text, ValueKind kind) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (*end != '\0' || errno == ERANGE) return false;
  return kind != ValueKind::kInt32 || (v >= INT_MIN && v <= INT_MAX);
}

bool isNumber(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  char* end = nullptr;
  std::strtod(text.c_str(), &end);
  return *end == '\0';
}

// Throws UsageError for the first argument that is not a known option, lacks its value, or has a
// value that is not a number where one is needed. `typed` are the arguments as given, `args` the
// same with kebab flag names.
void checkArguments(const std::vector<std::string>& typed, const std::vector<std::string>& args,
                    const FlagKinds& known) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool negativeNumber = a.size() > 1 && a[0] == '-' && (std::isdigit(static_cast<unsigned char>(a[1])) || a[1] == '.');
    if (a == "--") {
      if (i + 1 < args.size())
        throw UsageError("unexpected argument '" + typed[i + 1] + "' after '--': ctorch-train takes options only");
      return;
    }
    if (a.size() < 2 || a[0] != '-' || negativeNumber)
      throw UsageError("unexpected argument '" + typed[i] +
                       "': ctorch-train takes options only (a value needs its flag before it, e.g. --epochs 3)");
    const auto eq = a.find('=');
    const std::string name = a.substr(0, eq);
    const std::string typedName = typed[i].substr(0, typed[i].find('='));
    const auto found = known.find(name);
    if (found == known.end()) {
      const std::string hint = a.rfind("--", 0) == 0 ? didYouMean(name, known) : "";
      throw UsageError("unknown option '" + typedName + "'" + (hint.empty() ? " (see ctorch-train --help)" : hint));
    }
    if (found->second == ValueKind::kFlag) continue;  // a value after '=' is CLI11's to judge
    std::string value;
    if (eq != std::string::npos) {
      value = a.substr(eq + 1);
    } else {
      const bool missing = i + 1 >= args.size() ||
                           (args[i + 1].rfind("--", 0) == 0 && known.count(args[i + 1].substr(0, args[i + 1].find('='))));
      if (missing) throw UsageError(typedName + " needs a value (see ctorch-train --help)");
      value = typed[++i];
    }
    if ((found->second == ValueKind::kInt64 || found->second == ValueKind::kInt32) &&
        !isWholeNumber(value, found->second))
      bad(typedName, value, isNumber(value) ? "is not a whole number in range" : "is not a number");
    if (found->second == ValueKind::kNumber && !isNumber(value)) bad(typedName, value, "is not a number");
  }
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

template <class E>
E pick(const char* flag, const std::string& value, const std::vector<std::pair<std::string, E>>& choices) {
  std::vector<std::string> names;
  for (const auto& [name, e] : choices) {
    if (name == value) return e;
    names.push_back(name);
  }
  bad(flag, value, "is not one of: " + joined(names));
}

const std::vector<std::pair<std::string, OptimizerKind>> kOptimizers = {
    {"sgd", OptimizerKind::kSgd},         {"adam", OptimizerKind::kAdam},      {"adamw", OptimizerKind::kAdamW},
    {"rmsprop", OptimizerKind::kRmsprop}, {"adagrad", OptimizerKind::kAdagrad}};
const std::vector<std::pair<std::string, LrDecay>> kDecays = {{"none", LrDecay::kNone},
                                                              {"cosine", LrDecay::kCosine},
                                                              {"step", LrDecay::kStep},
                                                              {"linear", LrDecay::kLinear},
                                                              {"onecycle", LrDecay::kOneCycle}};
const std::vector<std::pair<std::string, DeviceChoice>> kDevices = {
    {"auto", DeviceChoice::kAuto}, {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}};
const std::vector<std::pair<std::string, BackendChoice>> kBackends = {
    {"auto", BackendChoice::kAuto}, {"gloo", BackendChoice::kGloo}, {"nccl", BackendChoice::kNccl}};
const std::vector<std::pair<std::string, ShardingChoice>> kShardings = {{"none", ShardingChoice::kNone},
                                                                       {"optimizer", ShardingChoice::kOptimizer},
                                                                       {"grad-op", ShardingChoice::kGradOp},
                                                                       {"full", ShardingChoice::kFull}};
const std::vector<std::pair<std::string, SyncChoice>> kSyncs = {{"allreduce", SyncChoice::kAllreduce},
                                                               {"parameter-server", SyncChoice::kParameterServer}};
const std::vector<std::pair<std::string, CommHookChoice>> kCommHooks = {
    {"shared-memory", CommHookChoice::kSharedMemory},
    {"none", CommHookChoice::kNone},
    {"allreduce", CommHookChoice::kAllreduce},
    {"fp16", CommHookChoice::kFp16}};
const std::vector<std::pair<std::string, ReductionChoice>> kReductions = {
    {"overlapped", ReductionChoice::kOverlapped},
    {"after-backward", ReductionChoice::kAfterBackward}};
const std::vector<std::pair<std::string, ProgressMode>> kProgress = {{"auto", ProgressMode::kAuto},
                                                                     {"bar", ProgressMode::kBar},
                                                                     {"lines", ProgressMode::kLines},
                                                                     {"none", ProgressMode::kNone}};
const std::vector<std::pair<std::string, AugmentChoice>> kAugment = {
    {"auto", AugmentChoice::kAuto}, {"on", AugmentChoice::kOn}, {"off", AugmentChoice::kOff}};

template <class E>
const char* nameOf(E value, const std::vector<std::pair<std::string, E>>& choices) {
  for (const auto& [name, e] : choices)
    if (e == value) return name.c_str();
  return "?";
}

std::string epilog() {
  std::ostringstream os;
  os << "Exit codes: 0 done; " << contract::kExitUsage << " bad command line or configuration; "
     << contract::kExitPreempted
     << " stopped by SIGTERM/SIGUSR1/SIGINT after writing a snapshot (run again to resume); "
     << contract::kExitFailure << " any other failure (recorded in TORCHELASTIC_ERROR_FILE when set).\n"
     << "Run it under ctorchrun (ctorchrun --standalone --nproc-per-node 2 ctorch-train ...), torchrun, plain\n"
     << "srun, or alone (a world of 1). Every flag also accepts its underscore spelling (--batch_size).\n"
     << "Documentation: docs/trainer.md.";
  return os.str();
}

}  // namespace

const char* toString(OptimizerKind v) { return nameOf(v, kOptimizers); }
const char* toString(LrDecay v) { return nameOf(v, kDecays); }
const char* toString(DeviceChoice v) { return nameOf(v, kDevices); }
const char* toString(BackendChoice v) { return nameOf(v, kBackends); }
const char* toString(ProgressMode v) { return nameOf(v, kProgress); }
const char* toString(AugmentChoice v) { return nameOf(v, kAugment); }
const char* toString(CommHookChoice v) { return nameOf(v, kCommHooks); }
const char* toString(ReductionChoice v) { return nameOf(v, kReductions); }
const char* toString(ShardingChoice v) { return nameOf(v, kShardings); }
const char* toString(SyncChoice v) { return nameOf(v, kSyncs); }

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

// --sync parameter-server: what cannot work with it, each refused in one line.
void validateParameterServer(const TrainOptions& o) {
  if (o.psServers < 1 || o.psServers > 1024) bad("--ps-servers", std::to_string(o.psServers), "must be in [1, 1024]");
  if (o.sharding != ShardingChoice::kNone)
    throw UsageError(std::string("--sync parameter-server with --sharding ") + toString(o.sharding) +
                     ": the servers already hold the optimizer state, sharded over them (use --sharding none)");
  // A worker holds its own gradients only: no rank sees the averaged gradient whose norm clipping needs.
  if (o.clipGradNorm > 0)
    throw UsageError("--sync parameter-server with --clip-grad-norm: no rank holds the averaged gradients whose "
                     "norm it needs (use --sync allreduce)");
  if (o.amp && o.ampDtype == "float16")
    throw UsageError("--sync parameter-server with --amp float16 (loss scaling) is not supported: use --amp-dtype "
                     "bfloat16 or --sync allreduce");
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

  if (snapshotPath.empty() || snapshotPath.filename().empty())
    bad("--snapshot-path", snapshotPath.string(), "must name a file");
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
  if (ampDtype != "float16" && ampDtype != "bfloat16") bad("--amp-dtype", ampDtype, "must be float16 or bfloat16");
  if (device == DeviceChoice::kCpu && amp && ampDtype == "float16" && !amp::autocastSupported(torch::kCPU, torch::kHalf))
    throw UsageError("--amp with float16 needs CUDA, but --device is 'cpu' (use --amp-dtype bfloat16 on the CPU, or --device cuda)");
  // GradScaler checks the gradients of the optimizer it steps: a rank's share only, so the ranks could
  // disagree on skipping a step.
  if (sharding != ShardingChoice::kNone && amp && ampDtype == "float16")
    throw UsageError(std::string("--sharding ") + toString(sharding) +
                     " with --amp float16 (loss scaling) is not supported: use --amp-dtype bfloat16 or --sharding none");
  if (sync == SyncChoice::kParameterServer) validateParameterServer(*this);
  if (timeout.count() < 1 || timeout.count() > 7 * 24 * 3600)
    bad("--timeout", std::to_string(timeout.count()), "must be in [1, 604800] seconds");
  if (threads < 0 || threads > 1024) bad("--threads", std::to_string(threads), "must be in [0, 1024]");
  finiteIn("--bucket-cap-mb", bucketCapMb, 0.0, 1e6, true, false);
  if (stepDelay.count() < 0 || stepDelay.count() > 60000)
    bad("--step-delay-ms", std::to_string(stepDelay.count()), "must be in [0, 60000]");
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

void TrainOptions::checkOutputs() const {
  checkOutputFile("--snapshot-path", snapshotPath, "snapshot.pt");
  checkWritableDirectory("--model-dir '" + outputDir().string() + "'", outputDir());
  checkOutputFile("--model-filename", finalModelPath(), "model.pt");
  if (const auto metrics = metricsPath())
    checkOutputFile("--metrics-file", *metrics, "metrics.jsonl", Links::kRefused);
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
  if (weightDecay > 0) os << " weight decay " << number(weightDecay);
  if (warmupEpochs > 0) os << ", warmup " << number(warmupEpochs) << " epochs from x" << number(warmupStartFactor);
  if (lrDecay != LrDecay::kNone) os << ", " << toString(lrDecay) << " decay";
  if (clipGradNorm > 0) os << ", gradients clipped to norm " << number(clipGradNorm);
  if (sharding == ShardingChoice::kOptimizer) os << ", optimizer state sharded over the ranks (ZeRO-1)";
  if (sharding == ShardingChoice::kGradOp) os << ", gradients and optimizer state sharded over the ranks (FSDP SHARD_GRAD_OP)";
  if (sharding == ShardingChoice::kFull) os << ", parameters, gradients and optimizer state sharded over the ranks (FSDP FULL_SHARD)";
  if (sync == SyncChoice::kParameterServer)
    os << ", parameter server on the last " << psServers << (psServers == 1 ? " rank" : " ranks");
  os << ", seed " << seed << ", snapshot " << snapshotPath.string();
  return os.str();
}

namespace {

// The flags whose text becomes a TrainOptions field only after a check or a conversion (after
// parsing); the others are parsed straight into TrainOptions.
struct FlagTexts {
  explicit FlagTexts(const TrainOptions& o)
      : optimizer(toString(o.optimizer)),
        lrDecay(toString(o.lrDecay)),
        device(toString(o.device)),
        backend(toString(o.backend)),
        progress(toString(o.progress)),
        augment(toString(o.augment)),
        commHook(toString(o.commHook)),
        gradientReduction(toString(o.gradientReduction)),
        sharding(toString(o.sharding)),
        sync(toString(o.sync)),
        snapshotPath(o.snapshotPath.string()),
        timeoutS(o.timeout.count()) {}

  std::string optimizer, lrDecay, device, backend, progress, augment, commHook, gradientReduction, sharding, resume = "auto",
      metrics;
  std::string sync;
  std::string dataDir, snapshotPath, modelDir, syntheticShape;
  std::int64_t timeoutS, stepDelayMs = 0;
  bool noBucketView = false;
  std::string profileSteps, profileFile;
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
}

void addSnapshotFlags(FlagTable& f, TrainOptions& o, FlagTexts& t) {
  const char* kSnap = "Snapshots and weights";
  f.option("--snapshot-path", t.snapshotPath, "the snapshot slot (previous ones kept as PATH.1, PATH.2, ...)")
      ->group(kSnap)->capture_default_str();
  f.option("--save-every", o.saveEvery, "epochs between snapshots (0: none at epoch ends)")->group(kSnap)->capture_default_str();
  f.option("--save-every-steps", o.saveEverySteps, "also a snapshot every N optimizer steps (0: off)")
      ->group(kSnap)->capture_default_str();
  f.option("--keep-snapshots", o.keepSnapshots, "previous snapshots kept next to the newest")->group(kSnap)->capture_default_str();
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
  f.flag("--amp", o.amp, "automatic mixed precision: autocast to --amp-dtype (float16 adds dynamic loss scaling)")->group(kSys);
  f.option("--amp-dtype", o.ampDtype, "float16 (CUDA) or bfloat16 (CUDA or CPU)")->group(kSys)->capture_default_str();
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
           "forward and again for the backward); grad-op and full are bit-identical to none at 2 ranks")
      ->group(kSys)->capture_default_str();
  f.flag("--find-unused-parameters", o.findUnusedParameters, "DDP: search for parameters without gradient")
      ->group(kSys);
  f.flag("--no-gradient-as-bucket-view", t.noBucketView,
         "DDP: keep gradients apart from the allreduce buckets (by default they are views into them, "
         "which saves a copy)")
      ->group(kSys);

  f.option("--profile-steps", t.profileSteps,
           "A:B (or A): a Chrome trace of global steps A to B by LibTorch's profiler, one file per rank "
           "(open it in chrome://tracing or ui.perfetto.dev)")
      ->group(kSys);
  f.option("--profile-file", t.profileFile, "where --profile-steps writes (default: <model-dir>/trace-rank<R>.json; "
                                            "{rank} is replaced by the rank)")
      ->group(kSys);

  f.option("--step-delay-ms", t.stepDelayMs, "testing aid: sleep after every step")->group("Testing");
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
  // Python's AdamW decays by 0.01 unless told otherwise; the flag's 0 is for the others.
  if (o.optimizer == OptimizerKind::kAdamW && app.count("--weight-decay") == 0) o.weightDecay = 0.01;
  o.lrDecay = pick("--lr-decay", t.lrDecay, kDecays);
  o.device = pick("--device", t.device, kDevices);
  o.backend = pick("--backend", t.backend, kBackends);
  o.progress = pick("--progress", t.progress, kProgress);
  o.augment = pick("--augment", t.augment, kAugment);
  o.commHook = pick("--comm-hook", t.commHook, kCommHooks);
  o.gradientReduction = pick("--gradient-reduction", t.gradientReduction, kReductions);
  o.sharding = pick("--sharding", t.sharding, kShardings);
  o.sync = pick("--sync", t.sync, kSyncs);
  if (app.count("--ps-servers") && o.sync != SyncChoice::kParameterServer)
    bad("--ps-servers", std::to_string(o.psServers), "needs --sync parameter-server");
  o.resume = ResumeChoice::parse(t.resume);
  o.dataDir = t.dataDir;
  o.snapshotPath = t.snapshotPath;
  o.modelDir = t.modelDir;
  if (app.count("--synthetic-shape")) o.syntheticShape = parseShape(t.syntheticShape);
  if (app.count("--metrics-file"))
    o.metricsFile = t.metrics == "none" ? std::filesystem::path() : std::filesystem::path(t.metrics);
  o.timeout = std::chrono::seconds(t.timeoutS);
  o.stepDelay = std::chrono::milliseconds(t.stepDelayMs);
  if (app.count("--profile-steps")) parseProfileSteps(t.profileSteps, o);
  o.profileFile = t.profileFile;
  o.gradientAsBucketView = !t.noBucketView;
  try {  // bf16, BFloat16, fp16, half: the canonical name, which the binding configuration records
    o.ampDtype = amp::dtypeName(amp::parseDtype(o.ampDtype));
  } catch (const std::invalid_argument&) {
    bad("--amp-dtype", o.ampDtype, "must be float16 or bfloat16");
  }
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
