// CUDA graphs of a whole training step (Python's torch.cuda.graph "whole network capture"): once a
// static-shape step has run as warm-up on a side stream, the forward, the backward, DDP's gradient
// allreduce (NCCL), autocast, the GradScaler and the optimizer step are captured once and replayed,
// the inputs copied into static buffers before each replay. A step whose shapes, dtypes, devices or
// parameters with gradients differ runs eagerly, with a one-line reason; the decision is a pure
// function of the recorded step signatures (cuda_graph::decide).
//
//   ctorch::CudaGraphStep graphed(model->parameters());
//   ctorch::DistributedDataParallel ddp = [&] { auto s = graphed.sideStream(); return DDP(model); }();
//   auto scaler = ...; graphed.add(ctorch::graphParticipant(ddp)).add(ctorch::graphParticipant(scaler))
//                             .add(ctorch::graphParticipant(sgd));
//   for (...) {
//     auto out = graphed.run({x, y}, [&](const std::vector<at::Tensor>& in) {
//       ddp.zeroGrad();  ... loss.backward(); scaler.step(sgd); scaler.update();
//       return std::vector<at::Tensor>{loss.detach()};     // no .item() inside: it syncs
//     });
//     double loss = out[0].item<double>();                // after run(): the graph's static output
//   }
//
// Without a CUDA LibTorch (or for CPU tensors) every step runs eagerly, saying why.
// NOT YET RUN ON A GPU: see docs/gpu.md ("CUDA graphs of the training step").
#pragma once

#include <ctorch/amp.hpp>
#include <ctorch/ddp.hpp>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ctorch {

struct CudaGraphOptions {
  // Identical eager steps (on the side stream) before the capture. DDP needs 11: its Reducer times
  // (and synchronises on) iterations 1 to 10 and every 100th, which cannot be captured.
  TORCH_ARG(std::int64_t, warmupSteps) = 11;
  // Off: every step runs eagerly ("CUDA graphs are off").
  TORCH_ARG(bool, enabled) = true;
};

namespace cuda_graph {

// ---- the decision: pure, testable without CUDA ------------------------------------------------------

struct TensorSignature {
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  bool operator==(const TensorSignature& o) const {
    return sizes == o.sizes && dtype == o.dtype && device == o.device;
  }
  bool operator!=(const TensorSignature& o) const { return !(*this == o); }
};
TensorSignature signatureOf(const at::Tensor& tensor);
std::string describe(const TensorSignature& s);  // "float32[32, 10] on cuda:0"

// What a step looks like before it runs: its inputs, and the host values a capture bakes into the
// graph (e.g. torch::optim::SGD's learning rate; GraphParticipant::bakedValues).
struct InputSignature {
  std::vector<TensorSignature> inputs;
  std::vector<double> baked;
  bool operator==(const InputSignature& o) const { return inputs == o.inputs && baked == o.baked; }
  bool operator!=(const InputSignature& o) const { return !(*this == o); }
};

// A finished step: its inputs, and which of the watched parameters had a gradient after it.
struct StepSignature {
  InputSignature input;
  std::vector<bool> hasGrad;
  bool operator==(const StepSignature& o) const { return input == o.input && hasGrad == o.hasGrad; }
};

// What was recorded: the run of identical finished steps that ends with the last one, and the
// signature the graph (if any) was captured with.
struct Record {
  std::optional<StepSignature> last;
  std::int64_t repeats = 0;                 // finished steps equal to `last`, one after another
  std::optional<StepSignature> captured;
  std::optional<std::string> controlFlow;   // set when parameters with gradients changed between steps
};
// Adds a finished step to the record.
void record(Record& record, const StepSignature& finished);
// The capture produced `captured` (a replay does not record: the graph's host side does not run).
void recordCapture(Record& record, const StepSignature& captured);

enum class Action {
  kEager,    // run the step as it is, on the current stream
  kWarmup,   // run it eagerly on the side stream, counting towards the capture
  kCapture,  // capture it into a graph (and replay it once: a capture computes nothing)
  kReplay,   // copy the inputs into the static buffers and replay the graph
};
const char* toString(Action action);

struct Decision {
  Action action = Action::kEager;
  std::string reason;  // one line: why eager, or what warm-up waits for; empty for capture/replay
};

// The next step's action. `blocker`: why a participant cannot be captured now (nullopt: nothing
// blocks; it delays a capture, never a replay); `cudaGraphs`: whether this LibTorch can capture at all
// (false: CPU-only build).
Decision decide(const Record& record, const InputSignature& next, const CudaGraphOptions& options,
                const std::optional<std::string>& blocker, bool cudaGraphs);

} // namespace cuda_graph

// Something a captured step holds whose host side must know about the graph: DDP (what keeps it
// from being captured now), the GradScaler (no found-inf read inside the capture), an optimizer (its
// learning rate and step counts). A small interface: every method but name() is optional.
class GraphParticipant {
 public:
  virtual ~GraphParticipant() = default;
  virtual std::string name() const = 0;
  // Why the step cannot be captured now (nullopt: it can). Asked before each step; it delays a
  // capture (the step runs as warm-up), never a replay.
  virtual std::optional<std::string> captureBlocker() const { return std::nullopt; }
  // Host values the capture bakes into the graph (kernels' arguments, DDP's communicator); a change
  // means a new warm-up and capture.
  virtual std::vector<double> bakedValues() const { return {}; }
  virtual void beginCapture() {}  // right before the capture
  virtual void endCapture() {}    // right after it (also when it failed)
  virtual void beforeReplay() {}  // on the host, before each replay (e.g. write the lr tensor)
  virtual void afterReplay() {}   // after each replay (e.g. advance host step counts)
};

// DDP: refuses what cannot be captured (Gloo for CUDA gradients, the unused-parameter search without
// staticGraph, a custom hook, the Reducer's timed iterations); bakes its Reducer's generation (a
// re-formed group after in-place recovery has another communicator: a new capture).
std::unique_ptr<GraphParticipant> graphParticipant(detail::DDPCore& ddp);
template <typename ModuleType>
std::unique_ptr<GraphParticipant> graphParticipant(DistributedDataParallel<ModuleType>& ddp) {
  return graphParticipant(ddp.core());
}
// The GradScaler: while captured its step() skips on the device (amp::GradScaler::setDeviceSkip).
std::unique_ptr<GraphParticipant> graphParticipant(amp::GradScaler& scaler);
// An optimizer: torch::optim::SGD is capturable as is (its learning rate is baked: a change is a new
// capture); torch::optim's Adam, AdamW, RMSprop, Adagrad and LBFGS are not (their step counts and
// bias corrections are host numbers baked into the graph).
std::unique_ptr<GraphParticipant> graphParticipant(torch::optim::Optimizer& optimizer);

// Runs a training step eagerly, as warm-up, captured, or replayed (cuda_graph::decide).
class CudaGraphStep {
 public:
  // The step function: reads only `inputs` (the static buffers once captured), returns what the
  // caller wants back (detached tensors: after a replay they are the graph's static outputs,
  // overwritten by the next replay). It must not synchronise with the host (.item(), printing).
  using StepFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

  // `parameters`: whose gradients make part of a step's signature (the model's).
  explicit CudaGraphStep(std::vector<at::Tensor> parameters, CudaGraphOptions options = {});
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  CudaGraphStep& add(std::unique_ptr<GraphParticipant> participant);

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs, const StepFunction& step);

  // Makes the graph's side stream current while it lives. Construct DDP inside one: its Reducer keeps
  // the parameters' gradient accumulators, whose backward runs on the stream current at construction.
  // A no-op without CUDA.
  class [[nodiscard]] StreamScope {
   public:
    ~StreamScope();
    StreamScope(StreamScope&&) noexcept;
    StreamScope(const StreamScope&) = delete;
    StreamScope& operator=(const StreamScope&) = delete;
    StreamScope& operator=(StreamScope&&) = delete;

   private:
    friend class CudaGraphStep;
    struct State;
    explicit StreamScope(std::unique_ptr<State> state);
    std::unique_ptr<State> state_;
  };
  StreamScope sideStream(const c10::Device& device);

  const cuda_graph::Decision& lastDecision() const;
  std::int64_t replays() const;
  std::int64_t captures() const;
  // Whether this LibTorch was built with CUDA graphs (ctorch built against a CUDA LibTorch).
  static bool available();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace ctorch
