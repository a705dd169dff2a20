// What the snapshot format's two halves share (format.cpp writes, decode.cpp reads and checks): the
// top-level keys, the bounds of the counts a snapshot may hold, and the walks over its content that
// both sides make (a value's type for a message, every tensor's view inside its storage, the tensors'
// bytes against the file's). Internal.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>

namespace ctorch::detail {

namespace format_fields {

// Top-level keys. MODEL_STATE and EPOCHS_RUN are the names of PyTorch's torchrun tutorial.
inline constexpr const char* kHeaderKey = "CTORCH_SNAPSHOT";
inline constexpr const char* kModelKey = "MODEL_STATE";
inline constexpr const char* kOptimizerTypeKey = "OPTIMIZER_TYPE";
inline constexpr const char* kOptimizerKey = "OPTIMIZER_STATE";
inline constexpr const char* kSchedulerKey = "LR_SCHEDULER_STATE";
inline constexpr const char* kEpochsRunKey = "EPOCHS_RUN";
inline constexpr const char* kStepInEpochKey = "STEP_IN_EPOCH";
inline constexpr const char* kGlobalStepKey = "GLOBAL_STEP";
inline constexpr const char* kSamplerKey = "SAMPLER_STATE";
inline constexpr const char* kRngKey = "RNG_STATE";
inline constexpr const char* kUserKey = "USER_STATE";
inline constexpr const char* kDigestKey = "content_digest";


// Bounds of what a snapshot's counts can be (docs/snapshot.md, "What the loader refuses"): far above
// any real run (2^48 steps: one a microsecond for 8 years), far below where arithmetic on them
// overflows.
inline constexpr std::int64_t kMaxCount = std::int64_t(1) << 48;
inline constexpr std::int64_t kMaxWorldSize = std::int64_t(1) << 24;

} // namespace format_fields

// "a dict with keys [a, b]", "a Tensor": what a value is, for a message naming a wrong one.
std::string describeType(const c10::IValue& v);

// Every tensor's view (sizes, strides, offset) must lie inside its storage before anything reads its
// data: the first that does not, by its path in the snapshot; each tensor's bytes added to `bytes`.
std::optional<std::string> badTensorView(const c10::IValue& v, const std::string& where, std::uint64_t& bytes);

// The content's tensors, counted at every place they appear, against the file's size: set when they
// hold more than kMaxTensorBytesPerFileByte times it.
std::optional<std::string> tensorsBeyondFile(std::uint64_t tensorBytes, std::uint64_t fileBytes);

} // namespace ctorch::detail
