// cuda_graph::decide: which way the next step runs, from what was recorded (pure: no CUDA, no
// tensors; tests/cuda_graph checks it on the CPU).
#include <ctorch/cuda_graph.hpp>

#include <sstream>

namespace ctorch::cuda_graph {

TensorSignature signatureOf(const at::Tensor& tensor) {
  TensorSignature s;
  if (!tensor.defined()) return s;
  s.sizes = tensor.sizes().vec();
  s.dtype = tensor.scalar_type();
  s.device = tensor.device();
  return s;
}

std::string describe(const TensorSignature& s) {
  if (s.dtype == c10::ScalarType::Undefined) return "an undefined tensor";
  std::ostringstream os;
  os << c10::toString(s.dtype) << "[";
  for (size_t i = 0; i < s.sizes.size(); ++i) os << (i ? ", " : "") << s.sizes[i];
  os << "] on " << s.device.str();
  return os.str();
}

const char* toString(Action action) {
  switch (action) {
    case Action::kEager: return "eager";
    case Action::kWarmup: return "warm-up";
    case Action::kCapture: return "capture";
    case Action::kReplay: return "replay";
  }
  return "?";
}

void record(Record& r, const StepSignature& finished) {
  if (r.last && r.last->input == finished.input && r.last->hasGrad != finished.hasGrad) {
    size_t changed = 0;
    while (changed < finished.hasGrad.size() && changed < r.last->hasGrad.size() &&
           finished.hasGrad[changed] == r.last->hasGrad[changed])
      ++changed;
    r.controlFlow = "the parameters with gradients changed between two steps of the same shapes (parameter " +
                    std::to_string(changed) + " first): the step's control flow is not static";
  }
  if (r.last && *r.last == finished) {
    ++r.repeats;
  } else {
    r.last = finished;
    r.repeats = 1;
  }
}

void recordCapture(Record& r, const StepSignature& captured) {
  r.captured = captured;
  r.last = captured;
  r.repeats = 1;
}

namespace {

// Why `next` differs from `was`, in one line; empty when it does not.
std::string difference(const InputSignature& was, const InputSignature& next) {
  if (was.inputs.size() != next.inputs.size())
    return std::to_string(next.inputs.size()) + " inputs where there were " + std::to_string(was.inputs.size());
  for (size_t i = 0; i < next.inputs.size(); ++i)
    if (was.inputs[i] != next.inputs[i])
      return "input " + std::to_string(i) + " is " + describe(next.inputs[i]) + ", was " + describe(was.inputs[i]);
  if (was.baked != next.baked) {
    for (size_t i = 0; i < next.baked.size() && i < was.baked.size(); ++i)
      if (was.baked[i] != next.baked[i]) {
        std::ostringstream os;
        os << "a value baked into the graph changed (" << was.baked[i] << " -> " << next.baked[i]
           << ", e.g. a learning rate)";
        return os.str();
      }
    return "the values baked into the graph changed";
  }
  return "";
}

Decision eager(std::string reason) { return {Action::kEager, std::move(reason)}; }

} // namespace

Decision decide(const Record& r, const InputSignature& next, const CudaGraphOptions& options,
                const std::optional<std::string>& blocker, bool cudaGraphs) {
  if (!options.enabled()) return eager("CUDA graphs are off");
  if (!cudaGraphs) return eager("this LibTorch was built without CUDA: no CUDA graphs");
  if (next.inputs.empty()) return eager("the step has no input tensors to copy into a graph");
  for (size_t i = 0; i < next.inputs.size(); ++i)
    if (!next.inputs[i].device.is_cuda())
      return eager("input " + std::to_string(i) + " is " + describe(next.inputs[i]) + ": CUDA graphs need CUDA tensors");
  if (r.controlFlow) return eager(*r.controlFlow);
  // A blocker is about capturing: a replay runs none of the participants' host side (DDP's timed
  // iterations, say, are not reached by it). What would make a graph stale is in the signature.
  if (r.captured && r.captured->input == next) return {Action::kReplay, ""};
  // Not the captured shapes (or nothing captured yet): warm up towards a capture of these.
  const bool sameAsLast = r.last && r.last->input == next;
  const std::int64_t seen = sameAsLast ? r.repeats : 0;
  std::string why;
  if (r.captured) why = difference(r.captured->input, next) + " (the graph holds the other shapes): ";
  if (seen < options.warmupSteps())
    return {Action::kWarmup, why + "warm-up step " + std::to_string(seen + 1) + " of " +
                                 std::to_string(options.warmupSteps()) +
                                 (r.last && !sameAsLast && !r.captured ? " (" + difference(r.last->input, next) + ")" : "")};
  if (blocker) return {Action::kWarmup, why + *blocker};
  return {Action::kCapture, ""};
}

} // namespace ctorch::cuda_graph
