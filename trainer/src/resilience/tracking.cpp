// ResilientTraining's track() calls: what a loop registers to be saved in every snapshot and put back
// on resume (Python's Snapshot dataclass, filled by hand there), each kept by TrackedState
// (tracked_state.hpp) with its one capture and restore. A way of sharing the step is a Stateful
// (ctorch/stateful.hpp), implemented in its own room; none is named here.
#include "ctorch/resilience.hpp"

#include "ctorch/amp.hpp"
#include "resilience/tracked_state.hpp"

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

namespace ctorch {

namespace {

// LibTorch's LRScheduler keeps its step count protected and offers no state_dict: reach it through
// a derived class's member pointer (well-defined: the member is named in the derived class's scope).
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& stepCount(torch::optim::LRScheduler& s) { return s.*(&SchedulerAccess::step_count_); }
};

} // namespace

ResilientTraining& ResilientTraining::track(torch::nn::Module& module) {
  tracked().setModel(module);
  return *this;
}

ResilientTraining& ResilientTraining::track(Stateful& object) {
  tracked().add(object);
  return *this;
}

ResilientTraining& ResilientTraining::track(torch::optim::Optimizer& optimizer) {
  tracked().setOptimizer(optimizer);
  return *this;
}

ResilientTraining& ResilientTraining::track(DistributedSampler& sampler) {
  tracked().setSampler(sampler);
  return *this;
}

ResilientTraining& ResilientTraining::trackScheduler(std::function<ItemDict()> save,
                                                     std::function<void(const ItemDict&)> load) {
  tracked().setScheduler(std::move(save), std::move(load));
  return *this;
}

ResilientTraining& ResilientTraining::track(torch::optim::LRScheduler& scheduler) {
  torch::optim::LRScheduler* s = &scheduler;
  return trackScheduler(
      [s] {
        ItemDict d = newItemDict();
        d.insert("last_epoch", static_cast<std::int64_t>(SchedulerAccess::stepCount(*s)));
        return d;
      },
      [s](const ItemDict& d) {
        if (!d.contains("last_epoch") || !d.at("last_epoch").isInt())
          throw ConfigError("the snapshot's LR_SCHEDULER_STATE has no step count (last_epoch): it was saved by "
                            "another kind of scheduler");
        const auto count = d.at("last_epoch").toInt();
        if (count < 0) throw ConfigError("the snapshot's scheduler step count is negative: " + std::to_string(count));
        SchedulerAccess::stepCount(*s) = static_cast<unsigned>(count);
      });
}

ResilientTraining& ResilientTraining::trackItems(std::function<void(ItemDict&)> save,
                                                 std::function<void(const ItemDict&)> load) {
  tracked().addItems(std::move(save), std::move(load));
  return *this;
}

ResilientTraining& ResilientTraining::track(amp::GradScaler& scaler) {
  auto* s = &scaler;
  return trackItems([s](ItemDict& d) { s->saveTo(d); }, [s](const ItemDict& d) { s->loadFrom(d); });
}

ResilientTraining& ResilientTraining::track(const std::string& name, std::function<c10::IValue()> save,
                                            std::function<void(const c10::IValue&)> load,
                                            std::function<void(const c10::IValue&)> check) {
  tracked().addNamed(name, std::move(save), std::move(load), std::move(check));
  return *this;
}

ResilientTraining& ResilientTraining::trackPerRank(const std::string& name, std::function<double()> save,
                                                   std::function<void(std::optional<double>)> load) {
  tracked().addPerRank(name, std::move(save), std::move(load));
  return *this;
}

ResilientTraining& ResilientTraining::track(const std::string& name, double& value) {
  double* v = &value;
  auto check = [name](const c10::IValue& x) {
    if (!x.isDouble() && !x.isInt()) throw ConfigError("the snapshot's USER_STATE['" + name + "'] is not a number");
  };
  return track(
      name, [v] { return c10::IValue(*v); },
      [v, check](const c10::IValue& x) {
        check(x);
        *v = x.isDouble() ? x.toDouble() : static_cast<double>(x.toInt());
      },
      check);
}

ResilientTraining& ResilientTraining::track(const std::string& name, std::int64_t& value) {
  std::int64_t* v = &value;
  auto check = [name](const c10::IValue& x) {
    if (!x.isInt()) throw ConfigError("the snapshot's USER_STATE['" + name + "'] is not an integer");
  };
  return track(
      name, [v] { return c10::IValue(*v); },
      [v, check](const c10::IValue& x) {
        check(x);
        *v = x.toInt();
      },
      check);
}

ResilientTraining& ResilientTraining::track(const std::string& name, at::Tensor& value) {
  at::Tensor* v = &value;
  auto check = [v, name](const c10::IValue& x) {
    if (!x.isTensor()) throw ConfigError("the snapshot's USER_STATE['" + name + "'] is not a tensor");
    const auto& t = x.toTensor();
    if (v->defined() && t.defined() && (v->sizes() != t.sizes() || v->scalar_type() != t.scalar_type()))
      throw ConfigError("the snapshot's USER_STATE['" + name + "'] has another shape or dtype than the registered tensor");
  };
  return track(
      name, [v] { return c10::IValue(v->defined() ? v->detach().to(torch::kCPU).clone() : at::Tensor()); },
      [v, check](const c10::IValue& x) {
        check(x);
        const auto t = x.toTensor();
        if (v->defined() && t.defined()) {
          torch::NoGradGuard noGrad;
          v->copy_(t);
        } else {
          *v = t;
        }
      },
      check);
}

} // namespace ctorch
