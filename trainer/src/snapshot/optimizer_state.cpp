// What a snapshot holds of an optimizer, in Python's state_dict() layout (optimizer_state.hpp):
// capturing it from a live optimizer, and putting it back in two steps - a plan checked against the
// optimizer, applied only when every group checks out.
#include "snapshot/optimizer_state.hpp"

#include "ctorch/snapshot.hpp"
#include "core/compat.hpp"
#include "snapshot/generic_dict.hpp"

#include <torch/optim.h>

#include <functional>
#include <set>

namespace ctorch {

namespace detail {

namespace {

// ---- Optimizers: Python's state_dict() layout ---------------------------------------------------------
double number(const c10::IValue& v, const std::string& where, std::vector<std::string>& errors) {
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());  // Python writes e.g. weight_decay=0
  errors.push_back(where + " is " + v.tagKind() + ", expected a number");
  return 0;
}

bool flag(const c10::IValue& v, const std::string& where, std::vector<std::string>& errors) {
  if (v.isBool()) return v.toBool();
  errors.push_back(where + " is " + v.tagKind() + ", expected a bool");
  return false;
}

std::int64_t stepCount(const c10::IValue& v, const std::string& where,
                       std::vector<std::string>& errors) {
  if (v.isInt()) return v.toInt();
  if (v.isTensor() && v.toTensor().numel() == 1)  // Python 1.12+ keeps Adam's step as a tensor
    return static_cast<std::int64_t>(v.toTensor().item<double>());
  if (v.isDouble()) return static_cast<std::int64_t>(v.toDouble());
  errors.push_back(where + " is " + v.tagKind() + ", expected an int");
  return 0;
}

// Reads the fields of one saved group/state dict, collecting problems instead of throwing so that a
// refusal lists all of them.
class DictView {
 public:
  // `fits` (when given) is cleared by a tensor of another shape than its parameter's: a snapshot of
  // another model, not a damaged one.
  DictView(c10::impl::GenericDict d, std::string where, std::vector<std::string>& errors, bool* fits = nullptr)
      : d_(std::move(d)), where_(std::move(where)), errors_(errors), fits_(fits) {}
  const c10::IValue* find(const std::string& key) const {
    auto it = d_.find(key);
    return it == d_.end() ? nullptr : &it->value();
  }
  const c10::IValue& need(const std::string& key) const {
    static const c10::IValue kNone;
    if (const auto* v = find(key)) return *v;
    if (fits_) *fits_ = false;  // written by another version or another program: not damage
    errors_.push_back(where_ + " has no '" + key + "'");
    return kNone;
  }
  double num(const std::string& key) const {
    const auto& v = need(key);
    return v.isNone() ? 0 : number(v, where_ + "['" + key + "']", errors_);
  }
  bool boolean(const std::string& key) const {
    const auto& v = need(key);
    return v.isNone() ? false : flag(v, where_ + "['" + key + "']", errors_);
  }
  std::int64_t step(const std::string& key) const {
    const auto& v = need(key);
    return v.isNone() ? 0 : stepCount(v, where_ + "['" + key + "']", errors_);
  }
  // A tensor shaped like `param` (or nothing when absent and optional).
  at::Tensor tensor(const std::string& key, const at::Tensor& param, bool optional = false) const {
    const auto* v = find(key);
    if (!v || v->isNone()) {
      if (!optional && fits_) *fits_ = false;
      if (!optional) errors_.push_back(where_ + " has no '" + key + "'");
      return {};
    }
    if (!v->isTensor()) {
      errors_.push_back(where_ + "['" + key + "'] is " + v->tagKind() + ", expected a Tensor");
      return {};
    }
    const at::Tensor& t = v->toTensor();
    if (t.sizes() != param.sizes()) {
      if (fits_) *fits_ = false;
      errors_.push_back(where_ + "['" + key + "'] has shape " + shapeText(t.sizes()) +
                        ", the parameter " + shapeText(param.sizes()));
      return {};
    }
    // Like Python's load_state_dict: on the parameter's device, in its dtype; a copy of its own.
    return t.to(param.device(), param.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }

 private:
  c10::impl::GenericDict d_;
  std::string where_;
  std::vector<std::string>& errors_;
  bool* fits_ = nullptr;
};

} // namespace

std::string optimizerTypeName(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "SGD";
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "Adam";
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return "RMSprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return "Adagrad";
  return "";
}

namespace {

template <typename State>
const State* stateOf(const torch::optim::Optimizer& o, const at::Tensor& p) {
  auto it = o.state().find(compat::optimizerStateKey(p));
  if (it == o.state().end()) return nullptr;
  return static_cast<const State*>(it->second.get());
}

void captureGroupOptions(const std::string& type, const torch::optim::OptimizerOptions& base,
                         c10::impl::GenericDict& g) {
  using namespace torch::optim;
  if (type == "SGD") {
    const auto& o = static_cast<const SGDOptions&>(base);
    g.insert("lr", o.lr());
    g.insert("momentum", o.momentum());
    g.insert("dampening", o.dampening());
    g.insert("weight_decay", o.weight_decay());
    g.insert("nesterov", o.nesterov());
  } else if (type == "Adam" || type == "AdamW") {
    double lr, eps, wd;
    bool amsgrad;
    std::tuple<double, double> betas;
    if (type == "Adam") {
      const auto& o = static_cast<const AdamOptions&>(base);
      lr = o.lr(), eps = o.eps(), wd = o.weight_decay(), amsgrad = o.amsgrad(), betas = o.betas();
    } else {
      const auto& o = static_cast<const AdamWOptions&>(base);
      lr = o.lr(), eps = o.eps(), wd = o.weight_decay(), amsgrad = o.amsgrad(), betas = o.betas();
    }
    g.insert("lr", lr);
    g.insert("betas", c10::ivalue::Tuple::create({std::get<0>(betas), std::get<1>(betas)}));
    g.insert("eps", eps);
    g.insert("weight_decay", wd);
    g.insert("amsgrad", amsgrad);
  } else if (type == "RMSprop") {
    const auto& o = static_cast<const RMSpropOptions&>(base);
    g.insert("lr", o.lr());
    g.insert("momentum", o.momentum());
    g.insert("alpha", o.alpha());
    g.insert("eps", o.eps());
    g.insert("centered", o.centered());
    g.insert("weight_decay", o.weight_decay());
  } else if (type == "Adagrad") {
    const auto& o = static_cast<const AdagradOptions&>(base);
    g.insert("lr", o.lr());
    g.insert("lr_decay", o.lr_decay());
    g.insert("eps", o.eps());
    g.insert("weight_decay", o.weight_decay());
    g.insert("initial_accumulator_value", o.initial_accumulator_value());
  }
}

// Returns the per-parameter state dict, or None when the optimizer has none for `p` yet.
c10::IValue captureParamState(const std::string& type, const torch::optim::Optimizer& o,
                              const at::Tensor& p) {
  using namespace torch::optim;
  auto d = newStringDict();
  if (type == "SGD") {
    const auto* s = stateOf<SGDParamState>(o, p);
    if (!s || !s->momentum_buffer().defined()) return {};
    d.insert("momentum_buffer", portableCopy(s->momentum_buffer()));
  } else if (type == "Adam" || type == "AdamW") {
    std::int64_t step;
    at::Tensor avg, avgSq, maxSq;
    if (type == "Adam") {
      const auto* s = stateOf<AdamParamState>(o, p);
      if (!s) return {};
      step = s->step(), avg = s->exp_avg(), avgSq = s->exp_avg_sq(), maxSq = s->max_exp_avg_sq();
    } else {
      const auto* s = stateOf<AdamWParamState>(o, p);
      if (!s) return {};
      step = s->step(), avg = s->exp_avg(), avgSq = s->exp_avg_sq(), maxSq = s->max_exp_avg_sq();
    }
    // An int, exact at any count; Python's Adam turns it into its step tensor on load.
    d.insert("step", step);
    d.insert("exp_avg", portableCopy(avg));
    d.insert("exp_avg_sq", portableCopy(avgSq));
    if (maxSq.defined()) d.insert("max_exp_avg_sq", portableCopy(maxSq));
  } else if (type == "RMSprop") {
    const auto* s = stateOf<RMSpropParamState>(o, p);
    if (!s) return {};
    d.insert("step", s->step());
    d.insert("square_avg", portableCopy(s->square_avg()));
    if (s->momentum_buffer().defined()) d.insert("momentum_buffer", portableCopy(s->momentum_buffer()));
    if (s->grad_avg().defined()) d.insert("grad_avg", portableCopy(s->grad_avg()));
  } else if (type == "Adagrad") {
    const auto* s = stateOf<AdagradParamState>(o, p);
    if (!s) return {};
    d.insert("step", s->step());
    d.insert("sum", portableCopy(s->sum()));
  }
  return d;
}


std::function<void(torch::optim::OptimizerOptions&)> readGroupOptions(const std::string& type,
                                                                      const DictView& g,
                                                                      std::vector<std::string>& errors) {
  using namespace torch::optim;
  if (type == "SGD") {
    const double lr = g.num("lr"), momentum = g.num("momentum"), dampening = g.num("dampening"),
                 wd = g.num("weight_decay");
    const bool nesterov = g.boolean("nesterov");
    return [=](OptimizerOptions& base) {
      static_cast<SGDOptions&>(base).lr(lr).momentum(momentum).dampening(dampening).weight_decay(wd).nesterov(nesterov);
    };
  }
  if (type == "Adam" || type == "AdamW") {
    const double lr = g.num("lr"), eps = g.num("eps"), wd = g.num("weight_decay");
    const bool amsgrad = g.boolean("amsgrad");
    std::tuple<double, double> betas{0.9, 0.999};
    const auto& b = g.need("betas");
    if (b.isTuple() && b.toTupleRef().elements().size() == 2) {
      betas = {number(b.toTupleRef().elements()[0], "betas[0]", errors),
               number(b.toTupleRef().elements()[1], "betas[1]", errors)};
    } else if (b.isList() && b.toListRef().size() == 2) {
      betas = {number(b.toListRef()[0], "betas[0]", errors), number(b.toListRef()[1], "betas[1]", errors)};
    } else if (!b.isNone()) {
      errors.push_back("betas is " + b.tagKind() + ", expected a pair of numbers");
    }
    if (type == "Adam")
      return [=](OptimizerOptions& base) {
        static_cast<AdamOptions&>(base).lr(lr).eps(eps).weight_decay(wd).amsgrad(amsgrad).betas(betas);
      };
    return [=](OptimizerOptions& base) {
      static_cast<AdamWOptions&>(base).lr(lr).eps(eps).weight_decay(wd).amsgrad(amsgrad).betas(betas);
    };
  }
  if (type == "RMSprop") {
    const double lr = g.num("lr"), momentum = g.num("momentum"), alpha = g.num("alpha"),
                 eps = g.num("eps"), wd = g.num("weight_decay");
    const bool centered = g.boolean("centered");
    return [=](OptimizerOptions& base) {
      static_cast<RMSpropOptions&>(base).lr(lr).momentum(momentum).alpha(alpha).eps(eps).centered(centered).weight_decay(wd);
    };
  }
  // Adagrad
  const double lr = g.num("lr"), lrDecay = g.num("lr_decay"), eps = g.num("eps"),
               wd = g.num("weight_decay"), init = g.num("initial_accumulator_value");
  return [=](OptimizerOptions& base) {
    static_cast<AdagradOptions&>(base).lr(lr).lr_decay(lrDecay).eps(eps).weight_decay(wd).initial_accumulator_value(init);
  };
}

std::unique_ptr<torch::optim::OptimizerParamState> readParamState(const std::string& type,
                                                                  const DictView& s,
                                                                  const at::Tensor& p) {
  using namespace torch::optim;
  if (type == "SGD") {
    // Python keeps {'momentum_buffer': None} for parameters without a buffer (momentum 0).
    auto buffer = s.tensor("momentum_buffer", p, /*optional=*/true);
    if (!buffer.defined()) return nullptr;
    auto st = std::make_unique<SGDParamState>();
    st->momentum_buffer(buffer);
    return st;
  }
  if (type == "Adam" || type == "AdamW") {
    auto fill = [&](auto st) {
      st->step(s.step("step"));
      st->exp_avg(s.tensor("exp_avg", p));
      st->exp_avg_sq(s.tensor("exp_avg_sq", p));
      st->max_exp_avg_sq(s.tensor("max_exp_avg_sq", p, /*optional=*/true));
      return std::unique_ptr<OptimizerParamState>(std::move(st));
    };
    if (type == "Adam") return fill(std::make_unique<AdamParamState>());
    return fill(std::make_unique<AdamWParamState>());
  }
  if (type == "RMSprop") {
    auto st = std::make_unique<RMSpropParamState>();
    st->step(s.step("step"));
    st->square_avg(s.tensor("square_avg", p));
    st->momentum_buffer(s.tensor("momentum_buffer", p, true));
    st->grad_avg(s.tensor("grad_avg", p, true));
    return st;
  }
  auto st = std::make_unique<AdagradParamState>();
  st->step(s.step("step"));
  st->sum(s.tensor("sum", p));
  return st;
}

// Checks `state` against `optimizer` and returns the change to apply, or the problems.
// `fits` (when given) is cleared when the snapshot is for another optimizer (another type, another
// number of groups or of parameters in a group): an incompatibility. Any other problem found is in
// the state itself (an entry missing or of another type): damage.
} // namespace

std::vector<GroupPlan> planOptimizerRestore(torch::optim::Optimizer& optimizer,
                                            const std::string& typeName,
                                            const ItemDict& state,
                                            std::vector<std::string>& errors, bool* fits) {
  auto incompatible = [&] {
    if (fits) *fits = false;
  };
  const std::string mine = optimizerTypeName(optimizer);
  if (mine.empty()) {
    incompatible();
    errors.push_back("the optimizer is not one ctorch snapshots support (SGD, Adam, AdamW, RMSprop, Adagrad)");
    return {};
  }
  if (typeName != mine) {
    incompatible();
    errors.push_back("optimizer is " + (typeName.empty() ? std::string("absent") : typeName) +
                     " in the snapshot, " + mine + " in this run");
    return {};
  }
  auto groupsIt = state.find("param_groups");
  auto statesIt = state.find("state");
  if (groupsIt == state.end() || !groupsIt->value().isList() || statesIt == state.end() ||
      !statesIt->value().isGenericDict()) {
    if (groupsIt == state.end() || statesIt == state.end()) incompatible();  // absent, not retyped
    errors.push_back("OPTIMIZER_STATE lacks 'state' (dict) or 'param_groups' (list)");
    return {};
  }
  const auto groups = groupsIt->value().toListRef();
  const auto states = statesIt->value().toGenericDict();
  auto& live = optimizer.param_groups();
  if (groups.size() != live.size()) {
    incompatible();
    errors.push_back("optimizer has " + std::to_string(groups.size()) +
                     " parameter groups in the snapshot, " + std::to_string(live.size()) +
                     " in this run");
    return {};
  }
  std::vector<GroupPlan> plans;
  std::int64_t index = 0;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const std::string where = "param_groups[" + std::to_string(gi) + "]";
    if (!groups[gi].isGenericDict()) {
      errors.push_back(where + " is " + groups[gi].tagKind() + ", expected a dict");
      return {};
    }
    DictView g(groups[gi].toGenericDict(), where, errors, fits);
    const auto& params = g.need("params");
    const auto& liveParams = live[gi].params();
    if (!params.isList() || params.toListRef().size() != liveParams.size()) {
      if (params.isList()) incompatible();
      errors.push_back(where + " has " +
                       (params.isList() ? std::to_string(params.toListRef().size()) : "no") +
                       " parameters in the snapshot, " + std::to_string(liveParams.size()) +
                       " in this run");
      return {};
    }
    GroupPlan plan;
    plan.setOptions = readGroupOptions(mine, g, errors);
    for (std::size_t pi = 0; pi < liveParams.size(); ++pi) {
      const auto& idValue = params.toListRef()[pi];
      const std::int64_t id = idValue.isInt() ? idValue.toInt() : index;
      ++index;
      auto it = states.find(id);
      if (it == states.end() || it->value().isNone()) {
        plan.states.emplace_back(liveParams[pi], nullptr);  // no state yet (e.g. before step 1)
        continue;
      }
      if (!it->value().isGenericDict()) {
        errors.push_back("state[" + std::to_string(id) + "] is " + it->value().tagKind());
        continue;
      }
      DictView s(it->value().toGenericDict(), "state[" + std::to_string(id) + "]", errors, fits);
      plan.states.emplace_back(liveParams[pi], readParamState(mine, s, liveParams[pi]));
    }
    plans.push_back(std::move(plan));
  }
  return plans;
}

void applyOptimizerRestore(torch::optim::Optimizer& optimizer, std::vector<GroupPlan>& plans) {
  auto& live = optimizer.param_groups();
  for (std::size_t gi = 0; gi < plans.size(); ++gi) {
    plans[gi].setOptions(live[gi].options());
    for (auto& [param, st] : plans[gi].states) {
      const auto key = compat::optimizerStateKey(param);
      if (st)
        optimizer.state()[key] = std::move(st);
      else
        optimizer.state().erase(key);
    }
  }
}

} // namespace detail

using detail::applyOptimizerRestore;
using detail::captureGroupOptions;
using detail::captureParamState;
using detail::optimizerTypeName;
using detail::planOptimizerRestore;
using detail::portableCopy;

ItemDict captureOptimizerState(const torch::optim::Optimizer& optimizer, std::string* typeName) {
  const std::string type = optimizerTypeName(optimizer);
  if (type.empty())
    throw std::invalid_argument(
        "captureOptimizerState: unsupported optimizer type (supported: SGD, Adam, AdamW, "
        "RMSprop, Adagrad)");
  if (typeName) *typeName = type;
  c10::impl::GenericDict states(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  std::int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    auto g = newStringDict();
    captureGroupOptions(type, group.options(), g);
    c10::impl::GenericList ids(c10::AnyType::get());  // a plain list, like Python's
    for (const auto& p : group.params()) {
      auto st = captureParamState(type, optimizer, p);
      if (!st.isNone()) states.insert(index, st);
      ids.push_back(index++);
    }
    g.insert("params", ids);
    groups.push_back(g);
  }
  auto out = newItemDict();
  out.insert("state", states);
  out.insert("param_groups", groups);
  return out;
}

namespace detail {

std::vector<std::string> optimizerStateDamage(torch::optim::Optimizer& optimizer, const std::string& typeName,
                                              const ItemDict& state) {
  std::vector<std::string> errors;
  bool fits = true;
  (void)planOptimizerRestore(optimizer, typeName, state, errors, &fits);
  return fits ? errors : std::vector<std::string>{};
}

}  // namespace detail

std::vector<std::string> restoreOptimizerState(torch::optim::Optimizer& optimizer,
                                               const std::string& typeName,
                                               const ItemDict& state) {
  std::vector<std::string> errors;
  auto plans = planOptimizerRestore(optimizer, typeName, state, errors);
  if (errors.empty()) applyOptimizerRestore(optimizer, plans);
  return errors;
}

} // namespace ctorch
