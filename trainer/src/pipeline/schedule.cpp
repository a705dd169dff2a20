// Running a pipeline schedule: one stage's forwards and backwards in the order pipelineActions()
// gives, activations sent forward and their gradients back with c10d send/recv.
//
// The wire, per step and per pair of neighbours (stage s -> s+1 on one tag, s+1 -> s on another):
// a header from the first stage passed down the pipeline (magic, M, step, whether shapes follow,
// training); when they follow, each activation is preceded by its shape and dtype; then the
// activations themselves into fixed receive buffers, and each micro-batch's input gradient back,
// whose shape the receiver knows (it sent the activation). Shapes are exchanged on the first step
// and whenever the first stage's micro-batch shapes change; a stage whose output shape changes
// while its input's did not is refused (the receiver's buffer would not fit it).
#include "ctorch/pipeline.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/hybrid_shard_groups.hpp"
#include "core/exception_text.hpp"

#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>

namespace ctorch {
namespace pipeline_wire {

constexpr std::int64_t kMagic = 0x63747069706531;  // "ctpipe1"
constexpr int kForwardTag = 0x7e10;                // stage s -> s+1: header, shapes, activations
constexpr int kBackwardTag = 0x7e11;               // stage s+1 -> s: input gradients
constexpr std::int64_t kMaxDims = 12;
enum HeaderField : std::int64_t { kHMagic, kHMicroBatches, kHStep, kHShapes, kHTraining, kHeaderSize };

using Clock = std::chrono::steady_clock;

struct Shape {
  std::vector<std::int64_t> sizes;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  bool operator==(const Shape& o) const { return sizes == o.sizes && dtype == o.dtype; }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::string text() const {
    std::ostringstream out;
    out << "[";
    for (std::size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
    out << "] " << c10::toString(dtype);
    return out.str();
  }
};

Shape shapeOf(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type()}; }

std::string stageName(int stage) { return "pipeline stage " + std::to_string(stage); }

// `tensors` in one flat buffer per dtype and device (in their order): `onFlat` runs on each (a
// collective in place), whose values are then copied back into the tensors.
void throughFlatBuffers(const std::vector<at::Tensor>& tensors, const std::function<void(at::Tensor&)>& onFlat) {
  std::map<std::pair<c10::ScalarType, std::string>, std::vector<at::Tensor>> byType;
  for (const auto& t : tensors) byType[{t.scalar_type(), t.device().str()}].push_back(t);
  for (auto& [key, group] : byType) {
    std::vector<at::Tensor> views;
    for (const auto& t : group) views.push_back(t.detach().reshape({-1}));
    at::Tensor flat = torch::cat(views);
    onFlat(flat);
    std::int64_t offset = 0;
    for (const auto& t : group) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

// One send/recv/wait; its failure becomes one DistributedError (DistributedTimeout) naming it.
template <typename F>
auto communicate(const std::string& what, F&& f) {
  return detail::failuresAsDistributed(std::forward<F>(f), [&] { return what; });
}

// The default generator of `device` seeded for one forward, its state put back after.
class SeedGuard {
 public:
  SeedGuard(const std::optional<std::uint64_t>& seed, const torch::Device& device) {
    if (!seed) return;
    generator_ = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator_->mutex());
    saved_ = generator_->get_state();
    generator_->set_current_seed(*seed);
  }
  ~SeedGuard() {
    if (!generator_) return;
    std::lock_guard<std::mutex> lock(generator_->mutex());
    generator_->set_state(saved_);
  }
  SeedGuard(const SeedGuard&) = delete;
  SeedGuard& operator=(const SeedGuard&) = delete;

 private:
  std::optional<at::Generator> generator_;
  at::Tensor saved_;
};

} // namespace pipeline_wire

using namespace pipeline_wire;

// ---- PipelineStage -----------------------------------------------------------------------------------
PipelineStage::PipelineStage(torch::nn::Sequential module, int stageIndex, int numStages, PipelineStageOptions options)
    : module_(std::move(module)), stageIndex_(stageIndex), numStages_(numStages), options_(std::move(options)) {
  if (numStages < 1 || stageIndex < 0 || stageIndex >= numStages)
    throw ConfigError("PipelineStage: stage " + std::to_string(stageIndex) + " is not one of " +
                      std::to_string(numStages) + " stages");
  if (module_->is_empty()) throw ConfigError("PipelineStage: stage " + std::to_string(stageIndex) + " has no module");
  group_ = options_.group();
  if (!group_ && numStages > 1) group_ = getDefaultGroup();  // ConfigError without initProcessGroup()
  if (group_ && (group_->getSize() != numStages || group_->getRank() != stageIndex))
    throw ConfigError("PipelineStage: stage " + std::to_string(stageIndex) + " of " + std::to_string(numStages) +
                      " needs a pipeline group of " + std::to_string(numStages) + " ranks in which it is rank " +
                      std::to_string(stageIndex) + "; this rank is rank " + std::to_string(group_->getRank()) +
                      " of " + std::to_string(group_->getSize()) + " (pipelineGroups() makes them)");
}

// ---- PipelineSchedule -----------------------------------------------------------------------------------
struct PipelineSchedule::Impl {
  std::vector<PipelineAction> actions;
  torch::Device device{torch::kCPU};
  // The first stage's micro-batch input shapes of the step before (shapes are exchanged when they change).
  std::vector<Shape> lastInputShapes;
  std::vector<Shape> received;  // per micro-batch: the activation shape from the stage before
  std::vector<Shape> sent;      // per micro-batch: the activation shape sent to the stage after
  // Fixed receive buffers by shape, handed back when their micro-batch is done.
  std::map<std::string, std::vector<at::Tensor>> pool;

  // Per micro-batch, for its backward.
  struct Flight {
    at::Tensor buffer;   // the receive buffer under `input` (back to the pool after the backward)
    at::Tensor input;    // the leaf whose gradient goes back to the stage before
    at::Tensor output;   // the stage's output (or, on the last stage, the scaled loss)
    c10::intrusive_ptr<c10d::Work> activationSend;  // the output on its way to the stage after
    at::Tensor activation;                           // what it sends
    bool live = false;
  };
  std::vector<Flight> flights;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, at::Tensor>> sends;  // waited at the step's end

  at::Tensor takeBuffer(const Shape& shape) {
    auto& free = pool[shape.text()];
    if (!free.empty()) {
      at::Tensor t = std::move(free.back());
      free.pop_back();
      return t;
    }
    return torch::empty(shape.sizes, torch::TensorOptions().dtype(shape.dtype).device(device));
  }
  void giveBack(at::Tensor buffer) {
    if (buffer.defined()) pool[shapeOf(buffer).text()].push_back(std::move(buffer));
  }
};

PipelineSchedule::PipelineSchedule(PipelineStage& stage, int microBatches, PipelineScheduleKind kind,
                                   PipelineLossFn loss, PipelineScheduleOptions options)
    : stage_(stage), microBatches_(microBatches), kind_(kind), loss_(std::move(loss)), options_(std::move(options)),
      impl_(std::make_unique<Impl>()) {
  if (microBatches < 1)
    throw ConfigError("pipeline: micro-batches must be at least 1, got " + std::to_string(microBatches));
  if (stage.isLast() && !loss_) throw ConfigError("pipeline: the last stage needs a loss function");
  impl_->actions = pipelineActions(kind, stage.stageIndex(), stage.numStages(), microBatches);
  for (const auto& p : stage.module()->parameters()) {
    impl_->device = p.device();
    break;
  }
}

PipelineSchedule::~PipelineSchedule() {
  // Sends still in flight after a failed step: their buffers must outlive them.
  for (auto& [work, tensor] : impl_->sends) {
    try {
      if (work) work->wait();
    } catch (...) {
    }
  }
  for (auto& flight : impl_->flights) {
    try {
      if (flight.activationSend) flight.activationSend->wait();
    } catch (...) {
    }
  }
}

std::vector<at::Tensor> PipelineSchedule::step(const at::Tensor& input, const at::Tensor& target) {
  return run(input, target, true);
}

at::Tensor PipelineSchedule::evaluate(const at::Tensor& input) {
  torch::NoGradGuard noGrad;
  auto outputs = run(input, {}, false);
  if (outputs.empty()) return {};
  return torch::cat(outputs, 0);
}

// One run of the schedule - a training step or an evaluation - on this stage: the step's header, then
// one function per action of pipelineActions() (forward(), backward()), then the sends finished and,
// with a data-parallel group, the stage's gradients averaged over it.
class PipelineSchedule::StepRun {
 public:
  StepRun(PipelineSchedule& schedule, const at::Tensor& input, const at::Tensor& target, bool training)
      : ps_(schedule),
        im_(*schedule.impl_),
        s_(schedule.stage_.stageIndex()),
        M_(schedule.microBatches_),
        first_(schedule.stage_.isFirst()),
        last_(schedule.stage_.isLast()),
        training_(training),
        group_(schedule.stage_.group()),
        me_(stageName(s_)) {
    ps_.stats_ = {};
    if (first_) inputs_ = split(input, "input");
    if (last_ && training_) targets_ = split(target, "target");
  }

  std::vector<at::Tensor> run() {
    const auto stepStart = Clock::now();
    passHeader();
    if (training_) {
      for (const PipelineAction& action : im_.actions)
        if (action.kind == PipelineAction::Kind::kForward) forward(action.microBatch);
        else backward(action.microBatch);
    } else {
      for (int m = 0; m < M_; ++m) forward(m);
    }
    finishSends();
    if (training_) averageGradients();
    ++ps_.steps_;
    ps_.stats_.total = Clock::now() - stepStart;
    return std::move(results_);
  }

 private:
  std::vector<at::Tensor> split(const at::Tensor& t, const char* what) const {
    if (!t.defined()) throw ConfigError(me_ + ": step() needs the " + std::string(what) + " on this stage");
    if (t.dim() == 0 || t.size(0) < M_)
      throw ConfigError(me_ + ": the " + what + " has " + std::to_string(t.dim() == 0 ? 0 : t.size(0)) +
                        " rows, fewer than the " + std::to_string(M_) + " micro-batches");
    return t.tensor_split(M_, 0);
  }

  // ---- the wire
  void timedWait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    const auto start = Clock::now();
    communicate(me_ + ": " + what, [&] { return work->wait(); });
    ps_.stats_.waiting += Clock::now() - start;
  }
  c10::intrusive_ptr<c10d::Work> sendTo(int peer, int tag, const at::Tensor& tensor, const std::string& what) {
    std::vector<at::Tensor> tensors{tensor};
    return communicate(me_ + ": " + what, [&] { return group_->send(tensors, peer, tag); });
  }
  void recvInto(int peer, int tag, at::Tensor& tensor, const std::string& what) {
    std::vector<at::Tensor> tensors{tensor};
    auto work = communicate(me_ + ": " + what, [&] { return group_->recv(tensors, peer, tag); });
    timedWait(work, what);
  }
  void keepSending(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor) {
    im_.sends.emplace_back(std::move(work), std::move(tensor));
  }

  // The header: made by the first stage, passed down; it says whether shapes follow.
  void passHeader() {
    const int s = s_;
    at::Tensor header = torch::zeros({kHeaderSize}, torch::kInt64);
    if (first_) {
      std::vector<Shape> shapes;
      for (const auto& x : inputs_) shapes.push_back(shapeOf(x));
      exchange_ = shapes != im_.lastInputShapes;
      im_.lastInputShapes = std::move(shapes);
      auto* h = header.data_ptr<std::int64_t>();
      h[kHMagic] = kMagic;
      h[kHMicroBatches] = M_;
      h[kHStep] = ps_.steps_;
      h[kHShapes] = exchange_;
      h[kHTraining] = training_;
    } else {
      recvInto(s - 1, kForwardTag, header, "receiving the step's header from stage " + std::to_string(s - 1));
      const auto* h = header.data_ptr<std::int64_t>();
      if (h[kHMagic] != kMagic)
        throw DistributedError(me_ + ": the message from stage " + std::to_string(s - 1) +
                               " is not a pipeline step's header (is the stage before running a schedule?)");
      if (h[kHMicroBatches] != M_ || h[kHTraining] != training_ || h[kHStep] != ps_.steps_)
        throw ConfigError(me_ + ": stage " + std::to_string(s - 1) + " runs " + (h[kHTraining] ? "step" : "evaluate") +
                          " " + std::to_string(h[kHStep]) + " with " + std::to_string(h[kHMicroBatches]) +
                          " micro-batches, this stage " + (training_ ? "step" : "evaluate") + " " +
                          std::to_string(ps_.steps_) + " with " + std::to_string(M_) +
                          ": every stage makes the same calls with the same micro-batches and step count");
      exchange_ = h[kHShapes] != 0;
    }
    if (!last_) keepSending(sendTo(s + 1, kForwardTag, header, "sending the step's header"), header);
    ps_.stats_.shapesExchanged = exchange_;
    if (exchange_) {
      im_.received.assign(static_cast<std::size_t>(M_), Shape{});
      im_.sent.assign(static_cast<std::size_t>(M_), Shape{});
    }
    im_.flights.assign(static_cast<std::size_t>(M_), Impl::Flight{});
  }

  // ---- the actions
  void forward(int m) {
    const auto mu = static_cast<std::size_t>(m);
    auto& flight = im_.flights[mu];
    const std::string micro = "micro-batch " + std::to_string(m);
    const at::Tensor x = first_ ? inputs_[mu] : receiveActivation(m, micro);
    const auto computeStart = Clock::now();
    at::Tensor y;
    {
      std::optional<std::uint64_t> seed;
      if (ps_.stage_.options().seed()) seed = pipelineMicroBatchSeed(*ps_.stage_.options().seed(), ps_.steps_, m, s_);
      SeedGuard guard(seed, im_.device);
      y = ps_.stage_.module()->forward(x);
    }
    if (last_) {
      if (training_) {
        at::Tensor loss = ps_.loss_(y, targets_[mu]);
        if (!loss.defined() || loss.numel() != 1)
          throw ConfigError(me_ + ": the loss function must return one value, got " +
                            (loss.defined() ? std::to_string(loss.numel()) : std::string("none")));
        results_.push_back(loss.detach().reshape({}));
        flight.output = ps_.options_.scaleLoss() ? loss / static_cast<double>(M_) : loss;
      } else {
        results_.push_back(y.detach());
      }
    }
    ps_.stats_.compute += Clock::now() - computeStart;
    if (!last_) sendActivation(m, y, micro);
    if (training_) {
      flight.live = true;
      ps_.stats_.maxInFlight = std::max(ps_.stats_.maxInFlight, ++inFlight_);
    }
  }

  // Micro-batch m's activation from the stage before (its shape first, when shapes are exchanged),
  // into a receive buffer of that shape: the forward's input.
  at::Tensor receiveActivation(int m, const std::string& micro) {
    const int s = s_;
    const auto mu = static_cast<std::size_t>(m);
    auto& flight = im_.flights[mu];
    if (exchange_) {
      at::Tensor meta = torch::zeros({2 + kMaxDims}, torch::kInt64);
      recvInto(s - 1, kForwardTag, meta, "receiving " + micro + "'s activation shape from stage " + std::to_string(s - 1));
      const auto* d = meta.data_ptr<std::int64_t>();
      if (d[1] < 0 || d[1] > kMaxDims || d[0] < 0 || d[0] >= static_cast<std::int64_t>(c10::ScalarType::NumOptions))
        throw DistributedError(me_ + ": stage " + std::to_string(s - 1) + " sent no activation shape for " + micro);
      Shape shape{std::vector<std::int64_t>(d + 2, d + 2 + d[1]), static_cast<c10::ScalarType>(d[0])};
      for (auto size : shape.sizes)
        if (size < 0) throw DistributedError(me_ + ": stage " + std::to_string(s - 1) + " sent a negative size");
      im_.received[mu] = shape;
    }
    flight.buffer = im_.takeBuffer(im_.received[mu]);
    recvInto(s - 1, kForwardTag, flight.buffer, "receiving " + micro + "'s activation from stage " + std::to_string(s - 1));
    at::Tensor x = flight.buffer.detach();
    if (training_ && x.is_floating_point()) x.requires_grad_(true);
    flight.input = x;
    return x;
  }

  // Micro-batch m's output `y` to the stage after (its shape first, when shapes are exchanged).
  void sendActivation(int m, const at::Tensor& y, const std::string& micro) {
    const auto mu = static_cast<std::size_t>(m);
    auto& flight = im_.flights[mu];
    const at::Tensor out = y.detach().contiguous();
    const Shape shape = shapeOf(out);
    if (exchange_) {
      if (static_cast<std::int64_t>(shape.sizes.size()) > kMaxDims)
        throw ConfigError(me_ + ": an activation of " + std::to_string(shape.sizes.size()) + " dimensions (at most " +
                          std::to_string(kMaxDims) + ")");
      at::Tensor meta = torch::zeros({2 + kMaxDims}, torch::kInt64);
      auto* d = meta.data_ptr<std::int64_t>();
      d[0] = static_cast<std::int64_t>(shape.dtype);
      d[1] = static_cast<std::int64_t>(shape.sizes.size());
      std::copy(shape.sizes.begin(), shape.sizes.end(), d + 2);
      keepSending(sendTo(s_ + 1, kForwardTag, meta, "sending " + micro + "'s activation shape"), meta);
      im_.sent[mu] = shape;
    } else if (shape != im_.sent[mu]) {
      throw ConfigError(me_ + ": " + micro + "'s output is " + shape.text() + " where the step before sent " +
                        im_.sent[mu].text() + " for the same input shapes: a stage's output shape must follow from its input's");
    }
    // Waited once (a Gloo send's second wait never returns): at its backward, or at the step's end.
    flight.activationSend = sendTo(s_ + 1, kForwardTag, out, "sending " + micro + "'s activation");
    flight.activation = out;
    if (training_) flight.output = y;
  }

  void backward(int m) {
    const auto mu = static_cast<std::size_t>(m);
    auto& flight = im_.flights[mu];
    const std::string micro = "micro-batch " + std::to_string(m);
    if (!flight.live) throw std::logic_error("pipeline: backward of a micro-batch never forwarded");
    at::Tensor gradOut;
    if (!last_) {
      gradOut = torch::empty(im_.sent[mu].sizes, torch::TensorOptions().dtype(im_.sent[mu].dtype).device(im_.device));
      recvInto(s_ + 1, kBackwardTag, gradOut, "receiving " + micro + "'s gradient from stage " + std::to_string(s_ + 1));
    }
    const auto computeStart = Clock::now();
    if (flight.output.requires_grad()) {
      if (last_) torch::autograd::backward({flight.output});
      else torch::autograd::backward({flight.output}, {gradOut});
    }
    ps_.stats_.compute += Clock::now() - computeStart;
    if (!first_) {
      at::Tensor grad = flight.input.defined() && flight.input.requires_grad() ? flight.input.grad() : at::Tensor();
      if (!grad.defined()) grad = torch::zeros_like(flight.buffer);
      grad = grad.contiguous();
      keepSending(sendTo(s_ - 1, kBackwardTag, grad, "sending " + micro + "'s input gradient"), grad);
    }
    // The activation came back as a gradient, so its send is done; the buffer may serve again.
    if (flight.activationSend) timedWait(flight.activationSend, "sending " + micro + "'s activation");
    im_.giveBack(std::move(flight.buffer));
    flight = Impl::Flight{};
    --inFlight_;
  }

  void finishSends() {
    for (auto& [work, tensor] : im_.sends) timedWait(work, "finishing the step's sends");
    im_.sends.clear();
    for (auto& flight : im_.flights) {  // evaluation: nothing came back to say the activations were taken
      if (flight.activationSend) timedWait(flight.activationSend, "sending an activation");
      im_.giveBack(std::move(flight.buffer));
    }
    im_.flights.clear();
  }

  void averageGradients() {
    const auto& dp = ps_.options_.dataParallelGroup();
    if (!dp || dp->getSize() <= 1) return;
    std::vector<at::Tensor> grads;
    for (auto& p : ps_.stage_.module()->parameters()) {
      if (!p.requires_grad()) continue;
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      grads.push_back(p.grad());
    }
    throughFlatBuffers(grads, [&](at::Tensor& flat) {
      std::vector<at::Tensor> tensors{flat};
      auto work = communicate(me_ + ": averaging the stage's gradients over its data-parallel group",
                              [&] { return dp->allreduce(tensors); });
      timedWait(work, "averaging the stage's gradients over its data-parallel group");
      flat.div_(dp->getSize());
    });
  }

  PipelineSchedule& ps_;
  Impl& im_;
  const int s_, M_;
  const bool first_, last_, training_;
  const c10::intrusive_ptr<c10d::ProcessGroup>& group_;
  const std::string me_;
  std::vector<at::Tensor> inputs_, targets_, results_;
  bool exchange_ = false;  // shapes precede the activations this step
  int inFlight_ = 0;
};

std::vector<at::Tensor> PipelineSchedule::run(const at::Tensor& input, const at::Tensor& target, bool training) {
  return StepRun(*this, input, target, training).run();
}

void pipelineGatherModel(const torch::nn::Sequential& model, const std::vector<std::size_t>& stageSizes,
                         const PipelineStage& stage) {
  if (stage.numStages() == 1) return;
  const auto& group = stage.group();
  torch::NoGradGuard noGrad;
  for (int t = 0; t < stage.numStages(); ++t) {
    const torch::nn::Sequential part = pipelineSplit(model, stageSizes, t);
    std::vector<at::Tensor> state = part->parameters();
    for (const auto& b : part->buffers()) state.push_back(b);
    const std::string what = stageName(stage.stageIndex()) + ": receiving stage " + std::to_string(t) + "'s weights";
    throughFlatBuffers(state, [&](at::Tensor& flat) {
      std::vector<at::Tensor> tensors{flat};
      c10d::BroadcastOptions options;
      options.rootRank = t;
      auto work = communicate(what, [&] { return group->broadcast(tensors, options); });
      communicate(what, [&] { return work->wait(); });
    });
  }
}

// ---- Pipeline x data parallelism ---------------------------------------------------------------------
PipelineGroups pipelineGroups(int stages) {
  const int world = getWorldSize(), rank = getRank();
  if (stages < 1 || world % stages != 0)
    throw ConfigError("pipeline: " + std::to_string(stages) + " stages do not divide the world of " +
                      std::to_string(world) + (world == 1 ? " rank" : " ranks") + " into whole pipelines");
  // The same layout as hybrid sharding's: a pipeline is a "node" of S consecutive ranks.
  const HybridShardLayout layout = hybridShardLayout(world, rank, stages);
  PipelineGroups groups;
  groups.stages = stages;
  groups.replicas = layout.replicas;
  groups.stage = layout.localRank;
  groups.replica = layout.node;
  if (layout.replicas == 1) {
    groups.pipeline = getDefaultGroup();
    return groups;
  }
  for (std::size_t r = 0; r < layout.shardGroups.size(); ++r) {
    auto g = newGroup(layout.shardGroups[r]);
    if (static_cast<int>(r) == layout.node) groups.pipeline = g;
  }
  for (std::size_t st = 0; st < layout.replicateGroups.size(); ++st) {
    auto g = newGroup(layout.replicateGroups[st]);
    if (static_cast<int>(st) == layout.localRank) groups.dataParallel = g;
  }
  return groups;
}

} // namespace ctorch
