// --profile-steps for the Trainer (trainer_impl.hpp): LibTorch's profiler runs while the chosen
// global steps do, and writes one Chrome trace per rank when they end (or the run stops in them).
#include "trainer_impl.hpp"

#include <filesystem>
#include <system_error>

namespace ctorch::train::trainer_parts {

void Trainer::profileBefore(std::int64_t nextStep) {
  if (profiler_ || o_.profileFirst == 0 || nextStep < o_.profileFirst || nextStep > o_.profileLast) return;
  const auto path = o_.profilePath(rank_);
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  profiler_ = std::make_unique<torch::autograd::profiler::RecordProfile>(path.string());
  console_.line("profiling global steps " + std::to_string(nextStep) + " to " + std::to_string(o_.profileLast) +
                " (LibTorch's profiler; rank " + std::to_string(rank_) + " writes " + path.string() + ")");
}

void Trainer::profileAfter(std::int64_t doneStep, bool ending) {
  if (!profiler_ || (doneStep < o_.profileLast && !ending)) return;
  profiler_.reset();  // writes the trace
  console_.line("profiler trace written: " + o_.profilePath(rank_).string() + " (through global step " +
                std::to_string(doneStep) + "; open it in chrome://tracing or ui.perfetto.dev)");
}

}  // namespace ctorch::train::trainer_parts
