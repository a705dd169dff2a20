// CudaGraphStep: runs each step the way cuda_graph::decide says -- eagerly, as warm-up on a side
// stream, captured into an at::cuda::CUDAGraph (then replayed once: a capture computes nothing), or
// replayed after copying the inputs into the static buffers. PyTorch's torch.cuda.graph recipe:
// warm-up on a side stream, synchronise before the capture, capture on the side stream into the
// graph's private memory pool, replay on the caller's stream.
// Everything CUDA is behind CTORCH_WITH_CUDA (defined when ctorch is built against a CUDA LibTorch):
// the CPU builds have ATen's CUDA headers but no CUDA runtime, and there every step is eager.
#include <ctorch/cuda_graph.hpp>

#include "core/exception_text.hpp"

#include <torch/types.h>
#include <torch/utils.h>

#ifdef CTORCH_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <stdexcept>

namespace ctorch {

struct CudaGraphStep::StreamScope::State {
#ifdef CTORCH_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard;
#endif
};

CudaGraphStep::StreamScope::StreamScope(std::unique_ptr<State> state) : state_(std::move(state)) {}
CudaGraphStep::StreamScope::StreamScope(StreamScope&&) noexcept = default;
CudaGraphStep::StreamScope::~StreamScope() = default;

struct CudaGraphStep::Impl {
  std::vector<at::Tensor> params;
  CudaGraphOptions options;
  std::vector<std::unique_ptr<GraphParticipant>> participants;
  cuda_graph::Record record;
  cuda_graph::Decision last;
  std::int64_t replays = 0, captures = 0;
  std::vector<at::Tensor> staticInputs, staticOutputs;
#ifdef CTORCH_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side;
  std::unique_ptr<at::cuda::CUDAGraph> graph;

  c10::cuda::CUDAStream sideStream(const c10::Device& device) {
    const auto index = device.has_index() ? device.index() : c10::cuda::current_device();
    if (!side || side->device_index() != index) side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
    return *side;
  }
#endif

  cuda_graph::InputSignature signature(const std::vector<at::Tensor>& inputs) const {
    cuda_graph::InputSignature s;
    for (const auto& t : inputs) s.inputs.push_back(cuda_graph::signatureOf(t));
    for (const auto& p : participants)
      for (double v : p->bakedValues()) s.baked.push_back(v);
    return s;
  }

  cuda_graph::StepSignature finished(const cuda_graph::InputSignature& input) const {
    cuda_graph::StepSignature s{input, {}};
    for (const auto& p : params) s.hasGrad.push_back(p.grad().defined());
    return s;
  }

  std::optional<std::string> blocker() const {
    for (const auto& p : participants)
      if (auto why = p->captureBlocker()) return *why;
    return std::nullopt;
  }

  std::vector<at::Tensor> warmup(const std::vector<at::Tensor>& inputs, const StepFunction& step);
  void capture(const std::vector<at::Tensor>& inputs, const StepFunction& step);
  void replay(const std::vector<at::Tensor>& inputs);
};

#ifdef CTORCH_WITH_CUDA

std::vector<at::Tensor> CudaGraphStep::Impl::warmup(const std::vector<at::Tensor>& inputs, const StepFunction& step) {
  const auto device = inputs.front().device();
  auto current = c10::cuda::getCurrentCUDAStream(device.index());
  auto stream = sideStream(device);
  at::cuda::CUDAEvent ready, done;
  ready.record(current);
  ready.block(stream);
  std::vector<at::Tensor> out;
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    out = step(inputs);
  }
  done.record(stream);
  done.block(current);
  return out;
}

void CudaGraphStep::Impl::capture(const std::vector<at::Tensor>& inputs, const StepFunction& step) {
  const auto device = inputs.front().device();
  graph.reset();
  staticOutputs.clear();
  staticInputs.clear();
  {
    torch::NoGradGuard noGrad;
    for (const auto& t : inputs) staticInputs.push_back(t.detach().clone());
  }
  // torch.cuda.graph: everything before the capture done, so nothing the capture reads is in flight.
  c10::cuda::device_synchronize();
  auto stream = sideStream(device);
  graph = std::make_unique<at::cuda::CUDAGraph>();
  for (auto& p : participants) p->beginCapture();
  auto endAll = [&] {
    for (auto& p : participants) p->endCapture();
  };
  {
    c10::cuda::CUDAStreamGuard guard(stream);
    graph->capture_begin();
    try {
      staticOutputs = step(staticInputs);
    } catch (const std::exception& e) {
      const std::string what = detail::messageOf(e);
      try {
        graph->capture_end();
      } catch (const std::exception&) {
        // the capture is invalid already; the step's error is the one to report
      }
      graph.reset();
      endAll();
      throw std::runtime_error("CUDA graph capture of the training step failed: " + what +
                               " (the step must not synchronise with the host: no .item(), no printing)");
    }
    graph->capture_end();
  }
  endAll();
  ++captures;
}

void CudaGraphStep::Impl::replay(const std::vector<at::Tensor>& inputs) {
  {
    torch::NoGradGuard noGrad;
    for (size_t i = 0; i < inputs.size(); ++i) staticInputs[i].copy_(inputs[i], /*non_blocking=*/true);
  }
  for (auto& p : participants) p->beforeReplay();
  graph->replay();
  for (auto& p : participants) p->afterReplay();
  ++replays;
}

#else

std::vector<at::Tensor> CudaGraphStep::Impl::warmup(const std::vector<at::Tensor>& inputs, const StepFunction& step) {
  return step(inputs);
}
void CudaGraphStep::Impl::capture(const std::vector<at::Tensor>&, const StepFunction&) {
  throw std::logic_error("CudaGraphStep: no CUDA graphs in this build (decide() never captures here)");
}
void CudaGraphStep::Impl::replay(const std::vector<at::Tensor>&) {
  throw std::logic_error("CudaGraphStep: no CUDA graphs in this build (decide() never replays here)");
}

#endif

CudaGraphStep::CudaGraphStep(std::vector<at::Tensor> parameters, CudaGraphOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (options.warmupSteps() < 1)
    throw std::invalid_argument("CudaGraphOptions::warmupSteps must be at least 1, not " +
                                std::to_string(options.warmupSteps()));
  impl_->params = std::move(parameters);
  impl_->options = options;
}

CudaGraphStep::~CudaGraphStep() = default;

CudaGraphStep& CudaGraphStep::add(std::unique_ptr<GraphParticipant> participant) {
  if (!participant) throw std::invalid_argument("CudaGraphStep::add: a null participant");
  impl_->participants.push_back(std::move(participant));
  return *this;
}

std::vector<at::Tensor> CudaGraphStep::run(const std::vector<at::Tensor>& inputs, const StepFunction& step) {
  Impl& s = *impl_;
  const auto signature = s.signature(inputs);
  s.last = cuda_graph::decide(s.record, signature, s.options, s.blocker(), available());
  switch (s.last.action) {
    case cuda_graph::Action::kEager: {
      auto out = step(inputs);
      cuda_graph::record(s.record, s.finished(signature));
      return out;
    }
    case cuda_graph::Action::kWarmup: {
      auto out = s.warmup(inputs, step);
      cuda_graph::record(s.record, s.finished(signature));
      return out;
    }
    case cuda_graph::Action::kCapture:
      s.capture(inputs, step);
      cuda_graph::recordCapture(s.record, s.finished(signature));
      s.replay(inputs);
      return s.staticOutputs;
    case cuda_graph::Action::kReplay:
      s.replay(inputs);
      return s.staticOutputs;
  }
  throw std::logic_error("CudaGraphStep: unknown action");
}

CudaGraphStep::StreamScope CudaGraphStep::sideStream(const c10::Device& device) {
  auto state = std::make_unique<StreamScope::State>();
#ifdef CTORCH_WITH_CUDA
  if (device.is_cuda()) state->guard.emplace(impl_->sideStream(device));
#else
  (void)device;
#endif
  return StreamScope(std::move(state));
}

const cuda_graph::Decision& CudaGraphStep::lastDecision() const { return impl_->last; }
std::int64_t CudaGraphStep::replays() const { return impl_->replays; }
std::int64_t CudaGraphStep::captures() const { return impl_->captures; }

bool CudaGraphStep::available() {
#ifdef CTORCH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

} // namespace ctorch
