// What DDP, the GradScaler and torch::optim's optimizers need from a captured step (GraphParticipant).
#include <ctorch/cuda_graph.hpp>

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace ctorch {

namespace {

class DdpParticipant final : public GraphParticipant {
 public:
  explicit DdpParticipant(detail::DDPCore& core) : core_(core) {}
  std::string name() const override { return "DistributedDataParallel"; }
  std::optional<std::string> captureBlocker() const override { return core_.captureBlocker(); }
  std::vector<double> bakedValues() const override { return {static_cast<double>(core_.reducerGeneration())}; }

 private:
  detail::DDPCore& core_;
};

class ScalerParticipant final : public GraphParticipant {
 public:
  explicit ScalerParticipant(amp::GradScaler& scaler) : scaler_(scaler) {}
  std::string name() const override { return "GradScaler"; }
  // found-inf stays on the device while captured: the skip is a torch::where, not a branch.
  void beginCapture() override {
    previous_ = scaler_.deviceSkip();
    scaler_.setDeviceSkip(true);
  }
  void endCapture() override { scaler_.setDeviceSkip(previous_); }

 private:
  amp::GradScaler& scaler_;
  bool previous_ = false;
};

class OptimizerParticipant final : public GraphParticipant {
 public:
  explicit OptimizerParticipant(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}
  std::string name() const override { return "optimizer"; }

  std::optional<std::string> captureBlocker() const override {
    // Before SGD: ctorch::optim's optimizers derive from these (their capturable mode is to come).
    const char* host = nullptr;
    if (dynamic_cast<torch::optim::Adam*>(&optimizer_)) host = "Adam";
    else if (dynamic_cast<torch::optim::AdamW*>(&optimizer_)) host = "AdamW";
    else if (dynamic_cast<torch::optim::RMSprop*>(&optimizer_)) host = "RMSprop";
    else if (dynamic_cast<torch::optim::Adagrad*>(&optimizer_)) host = "Adagrad";
    else if (dynamic_cast<torch::optim::LBFGS*>(&optimizer_)) host = "LBFGS";
    if (host)
      return std::string("the optimizer (") + host +
             ") counts its steps on the host and bakes them into its arithmetic, so a replayed step "
             "would repeat the captured one's: use SGD";
    if (!dynamic_cast<torch::optim::SGD*>(&optimizer_))
      return std::string("the optimizer is of a kind not known to be capturable (SGD is)");
    return std::nullopt;
  }

  // SGD's step reads its options as kernel arguments: a new learning rate is a new capture.
  std::vector<double> bakedValues() const override {
    std::vector<double> values;
    for (const auto& group : optimizer_.param_groups())
      if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&group.options()))
        values.insert(values.end(), {o->lr(), o->momentum(), o->dampening(), o->weight_decay(),
                                     o->nesterov() ? 1.0 : 0.0});
    return values;
  }

 private:
  torch::optim::Optimizer& optimizer_;
};

} // namespace

std::unique_ptr<GraphParticipant> graphParticipant(detail::DDPCore& ddp) {
  return std::make_unique<DdpParticipant>(ddp);
}
std::unique_ptr<GraphParticipant> graphParticipant(amp::GradScaler& scaler) {
  return std::make_unique<ScalerParticipant>(scaler);
}
std::unique_ptr<GraphParticipant> graphParticipant(torch::optim::Optimizer& optimizer) {
  return std::make_unique<OptimizerParticipant>(optimizer);
}

} // namespace ctorch
