// What both halves of ctorch-train's options share (private to the app): the names each choice flag
// takes (the tables parse and toString read), and the text helpers of the one-line usage errors.
// options.cpp validates TrainOptions; command_line.cpp fills it from argv with CLI11.
#pragma once

#include "ctorch/train/options.hpp"

#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ctorch::train::choices {

inline const std::vector<std::string> kModels = {"linear", "mnist-cnn", "simple-cnn", "resnet18"};
inline const std::vector<std::string> kDatasets = {"fashion-mnist", "mnist", "cifar10", "synthetic-regression",
                                            "synthetic-images"};

inline std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// The shortest text that reads back as exactly `v` (0.05, not 0.050000000000000003).
inline std::string number(double v) {
  for (int precision = 1; precision <= 17; ++precision) {
    std::ostringstream os;
    os.precision(precision);
    os << v;
    if (std::stod(os.str()) == v || !std::isfinite(v)) return os.str();
  }
  return std::to_string(v);
}

[[noreturn]] inline void bad(const std::string& flag, const std::string& value, const std::string& why) {
  throw UsageError(flag + " '" + value + "' " + why);
}

// Said before anything else about --cuda-graphs (also before a strategy's refusal of it).
inline constexpr const char* kCudaGraphsNeedCuda =
    "--cuda-graphs with --device cpu: CUDA graphs need CUDA (use --device cuda or auto)";

// --fsdp-param-dtype / --fsdp-reduce-dtype: the short names and torch's, each to its canonical name.
inline const std::vector<std::pair<std::string, std::string>> kFsdpDtypes = {
    {"bf16", "bfloat16"}, {"bfloat16", "bfloat16"}, {"fp16", "float16"},
    {"float16", "float16"}, {"fp32", "float32"},    {"float32", "float32"}};

inline const std::vector<std::pair<std::string, OptimizerKind>> kOptimizers = {
    {"sgd", OptimizerKind::kSgd},         {"adam", OptimizerKind::kAdam},      {"adamw", OptimizerKind::kAdamW},
    {"rmsprop", OptimizerKind::kRmsprop}, {"adagrad", OptimizerKind::kAdagrad}};
inline const std::vector<std::pair<std::string, LrDecay>> kDecays = {{"none", LrDecay::kNone},
                                                              {"cosine", LrDecay::kCosine},
                                                              {"step", LrDecay::kStep},
                                                              {"linear", LrDecay::kLinear},
                                                              {"onecycle", LrDecay::kOneCycle}};
inline const std::vector<std::pair<std::string, DeviceChoice>> kDevices = {
    {"auto", DeviceChoice::kAuto}, {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}};
inline const std::vector<std::pair<std::string, BackendChoice>> kBackends = {
    {"auto", BackendChoice::kAuto}, {"gloo", BackendChoice::kGloo}, {"nccl", BackendChoice::kNccl}};
inline const std::vector<std::pair<std::string, ShardingChoice>> kShardings = {{"none", ShardingChoice::kNone},
                                                                       {"optimizer", ShardingChoice::kOptimizer},
                                                                       {"grad-op", ShardingChoice::kGradOp},
                                                                       {"full", ShardingChoice::kFull},
                                                                       {"hybrid", ShardingChoice::kHybrid},
                                                                       {"hybrid-grad-op", ShardingChoice::kHybridGradOp}};
// FSDP's ShardingStrategy names and ZeRO's, as a Python user types them.
inline const std::vector<std::pair<std::string, ShardingChoice>> kPythonShardings = {
    {"NO_SHARD", ShardingChoice::kNone},
    {"ZeroRedundancyOptimizer", ShardingChoice::kOptimizer},
    {"SHARD_GRAD_OP", ShardingChoice::kGradOp},
    {"FULL_SHARD", ShardingChoice::kFull},
    {"HYBRID_SHARD", ShardingChoice::kHybrid},
    {"_HYBRID_SHARD_ZERO2", ShardingChoice::kHybridGradOp}};
inline const std::vector<std::pair<std::string, SyncChoice>> kSyncs = {{"allreduce", SyncChoice::kAllreduce},
                                                               {"parameter-server", SyncChoice::kParameterServer}};
inline const std::vector<std::pair<std::string, PipelineScheduleKind>> kPipelineSchedules = {
    {"1f1b", PipelineScheduleKind::k1F1B}, {"gpipe", PipelineScheduleKind::kGPipe}};
// Straight into the library's own enums (ctorch/comm_hook.hpp).
inline const std::vector<std::pair<std::string, CommHook>> kCommHooks = {{"shared-memory", CommHook::kSharedMemory},
                                                                  {"none", CommHook::kNone},
                                                                  {"allreduce", CommHook::kAllreduce},
                                                                  {"fp16", CommHook::kFp16Compress}};
inline const std::vector<std::pair<std::string, GradientReduction>> kReductions = {
    {"overlapped", GradientReduction::kOverlapped}, {"after-backward", GradientReduction::kAfterBackward}};
inline const std::vector<std::pair<std::string, ProgressMode>> kProgress = {{"auto", ProgressMode::kAuto},
                                                                     {"bar", ProgressMode::kBar},
                                                                     {"lines", ProgressMode::kLines},
                                                                     {"none", ProgressMode::kNone}};
inline const std::vector<std::pair<std::string, AugmentChoice>> kAugment = {
    {"auto", AugmentChoice::kAuto}, {"on", AugmentChoice::kOn}, {"off", AugmentChoice::kOff}};

inline const std::vector<std::pair<std::string, MemoryFormatChoice>> kMemoryFormats = {
    {"auto", MemoryFormatChoice::kAuto},
    {"contiguous", MemoryFormatChoice::kContiguous},
    {"channels-last", MemoryFormatChoice::kChannelsLast}};
// torch.channels_last's and torch.contiguous_format's names, as a Python user types them.
inline const std::vector<std::pair<std::string, MemoryFormatChoice>> kPythonMemoryFormats = {
    {"channels_last", MemoryFormatChoice::kChannelsLast}, {"contiguous_format", MemoryFormatChoice::kContiguous}};

template <class E>
const char* nameOf(E value, const std::vector<std::pair<std::string, E>>& choices) {
  for (const auto& [name, e] : choices)
    if (e == value) return name.c_str();
  return "?";
}

}  // namespace ctorch::train::choices
