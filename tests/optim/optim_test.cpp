// ctorch::optim's multi-tensor optimizers on the CPU. kForEach runs torch::optim's arithmetic one
// multi-tensor operation at a time: parameters and state must equal torch::optim's bit for bit
// (several groups, float and double parameters, a channels-last parameter, parameters that skip
// steps so their step counts differ). kFused (where this LibTorch has the kernels: 2.4 and later)
// computes the same update in one pass in another order: within the bound stated below. Both keep
// torch::optim's state, so a snapshot taken of one resumes the other.
#include "ctorch_catch.hpp"

#include <ctorch/errors.hpp>
#include <ctorch/optim.hpp>
#include <ctorch/snapshot.hpp>

#include <torch/torch.h>

#include <functional>
#include <memory>

namespace {

using ctorch::optim::Kernels;
using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::optim::OptimizerParamGroup>)>;

// Parameters of several shapes and dtypes, in two groups, the second with its own learning rate.
struct Params {
  std::vector<at::Tensor> all;
  std::vector<torch::optim::OptimizerParamGroup> groups(double secondLr, const std::string& type) const {
    std::vector<at::Tensor> a(all.begin(), all.begin() + 3), b(all.begin() + 3, all.end());
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(a);
    std::unique_ptr<torch::optim::OptimizerOptions> o;
    if (type == "SGD") o = std::make_unique<torch::optim::SGDOptions>(secondLr);
    else if (type == "Adam") o = std::make_unique<torch::optim::AdamOptions>(secondLr);
    else o = std::make_unique<torch::optim::AdamWOptions>(secondLr);
    g.emplace_back(b, std::move(o));
    return g;
  }
};

Params makeParams(std::uint64_t seed) {
  torch::manual_seed(static_cast<std::int64_t>(seed));
  Params p;
  p.all.push_back(torch::randn({7, 5}));
  p.all.push_back(torch::randn({33}));  // odd length: a vectorised body and a tail
  p.all.push_back(torch::randn({4, 3, 3, 3}).contiguous(at::MemoryFormat::ChannelsLast));
  p.all.push_back(torch::randn({6, 2}, torch::kDouble));
  p.all.push_back(torch::randn({1000}));
  for (auto& t : p.all) t.requires_grad_(true);
  return p;
}

// `steps` steps with the same gradients on both sets; parameter 1 has no gradient on steps 2 and 5
// (its step count falls behind the others').
void run(torch::optim::Optimizer& a, Params& pa, torch::optim::Optimizer& b, Params& pb, int steps) {
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(100 + s);
    for (std::size_t i = 0; i < pa.all.size(); ++i) {
      const bool skip = i == 1 && (s == 2 || s == 5);
      auto g = torch::randn(pa.all[i].sizes(), pa.all[i].options().requires_grad(false));
      if (pa.all[i].dim() == 4) g = g.contiguous(at::MemoryFormat::ChannelsLast);
      pa.all[i].mutable_grad() = skip ? at::Tensor() : g.clone();
      pb.all[i].mutable_grad() = skip ? at::Tensor() : g.clone();
    }
    a.step();
    b.step();
  }
}

// The largest |x - y| / (|y| + 1) over every parameter.
double maxRelative(const Params& a, const Params& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.all.size(); ++i) {
    const auto x = a.all[i].detach().to(torch::kDouble), y = b.all[i].detach().to(torch::kDouble);
    worst = std::max(worst, ((x - y).abs() / (y.abs() + 1)).max().item<double>());
  }
  return worst;
}

bool identical(const Params& a, const Params& b) {
  for (std::size_t i = 0; i < a.all.size(); ++i)
    if (!torch::equal(a.all[i], b.all[i])) return false;
  return true;
}

// The two optimizers' states in Python's state_dict layout, compared entry by entry.
void requireSameState(const torch::optim::Optimizer& a, const torch::optim::Optimizer& b, bool exact) {
  std::string ta, tb;
  const auto sa = ctorch::captureOptimizerState(a, &ta), sb = ctorch::captureOptimizerState(b, &tb);
  REQUIRE(ta == tb);
  const auto stateA = sa.at("state").toGenericDict(), stateB = sb.at("state").toGenericDict();
  REQUIRE(stateA.size() == stateB.size());
  for (const auto& e : stateA) {
    const auto other = stateB.at(e.key()).toGenericDict();
    const auto mine = e.value().toGenericDict();
    REQUIRE(mine.size() == other.size());
    for (const auto& field : mine) {
      const auto& x = field.value();
      const auto& y = other.at(field.key());
      INFO("parameter " << e.key() << " field " << field.key().toStringRef());
      REQUIRE(x.isTensor() == y.isTensor());
      if (!x.isTensor()) {
        CHECK(x == y);
        continue;
      }
      REQUIRE(x.toTensor().sizes() == y.toTensor().sizes());
      REQUIRE(x.toTensor().strides() == y.toTensor().strides());
      if (exact) CHECK(torch::equal(x.toTensor(), y.toTensor()));
    }
  }
}

std::unique_ptr<torch::optim::Optimizer> make(const std::string& type, Kernels k,
                                              std::vector<torch::optim::OptimizerParamGroup> groups) {
  using namespace torch::optim;
  if (type == "SGD") {
    auto o = SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-2);
    if (k == Kernels::kPerParameter) return std::make_unique<SGD>(groups, o);
    return std::make_unique<ctorch::optim::SGD>(groups, o, k);
  }
  if (type == "SGD-dampening") {
    auto o = SGDOptions(0.05).momentum(0.8).dampening(0.3).weight_decay(1e-3);
    if (k == Kernels::kPerParameter) return std::make_unique<SGD>(groups, o);
    return std::make_unique<ctorch::optim::SGD>(groups, o, k);
  }
  if (type == "SGD-plain") {
    auto o = SGDOptions(0.05);
    if (k == Kernels::kPerParameter) return std::make_unique<SGD>(groups, o);
    return std::make_unique<ctorch::optim::SGD>(groups, o, k);
  }
  if (type == "Adam" || type == "Adam-amsgrad") {
    auto o = AdamOptions(1e-2).betas({0.8, 0.95}).weight_decay(1e-2).amsgrad(type == "Adam-amsgrad");
    if (k == Kernels::kPerParameter) return std::make_unique<Adam>(groups, o);
    return std::make_unique<ctorch::optim::Adam>(groups, o, k);
  }
  auto o = AdamWOptions(1e-2).weight_decay(0.1).amsgrad(type == "AdamW-amsgrad");
  if (k == Kernels::kPerParameter) return std::make_unique<AdamW>(groups, o);
  return std::make_unique<ctorch::optim::AdamW>(groups, o, k);
}

std::string baseType(const std::string& type) { return type.substr(0, type.find('-')); }

const std::vector<std::string> kTypes = {"SGD", "SGD-dampening", "SGD-plain", "Adam", "Adam-amsgrad", "AdamW",
                                         "AdamW-amsgrad"};

} // namespace

TEST_CASE("optim: kForEach equals torch::optim bit for bit, parameters and state", "[optim]") {
  for (const auto& type : kTypes) {
    INFO(type);
    Params ref = makeParams(1), mine = makeParams(1);
    auto a = make(type, Kernels::kPerParameter, ref.groups(0.2, baseType(type)));
    auto b = make(type, Kernels::kForEach, mine.groups(0.2, baseType(type)));
    run(*a, ref, *b, mine, 8);
    CHECK(identical(mine, ref));
    requireSameState(*b, *a, /*exact=*/true);
    CHECK(maxRelative(mine, makeParams(1)) > 1e-3);  // the steps did move the parameters
  }
}

TEST_CASE("optim: a snapshot of torch::optim's state resumes ctorch::optim's and back, bit for bit", "[optim]") {
  for (const auto& type : {std::string("SGD"), std::string("Adam-amsgrad"), std::string("AdamW")}) {
    INFO(type);
    // ref: torch::optim all the way; mine: torch::optim for 4 steps, then ctorch::optim (kForEach)
    // restored from its state for 4 more, then torch::optim again restored from that.
    Params ref = makeParams(2), mine = makeParams(2);
    auto a = make(type, Kernels::kPerParameter, ref.groups(0.2, baseType(type)));
    auto first = make(type, Kernels::kPerParameter, mine.groups(0.2, baseType(type)));
    run(*a, ref, *first, mine, 4);
    std::string typeName;
    auto state = ctorch::captureOptimizerState(*first, &typeName);
    auto second = make(type, Kernels::kForEach, mine.groups(0.2, baseType(type)));
    REQUIRE(ctorch::restoreOptimizerState(*second, typeName, state).empty());
    run(*a, ref, *second, mine, 4);
    CHECK(identical(mine, ref));
    state = ctorch::captureOptimizerState(*second, &typeName);
    auto third = make(type, Kernels::kPerParameter, mine.groups(0.2, baseType(type)));
    REQUIRE(ctorch::restoreOptimizerState(*third, typeName, state).empty());
    run(*a, ref, *third, mine, 3);
    CHECK(identical(mine, ref));
  }
}

// The bound for kFused: the fused kernels compute the same update with the bias corrections folded
// in another order (Adam: lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) as one expression in float,
// the momentum as one fused multiply-add), so each step's update differs from torch::optim's by a
// few float32 roundings of the update, not of the parameter: after 8 steps the parameters differ
// by at most 1e-6 relative (measured with 2.14: up to 2.1e-7, AdamW; a fourfold margin), while the
// steps move them by more than 1e-3.
TEST_CASE("optim: kFused stays within 1e-6 of torch::optim and keeps its state layout", "[optim]") {
  for (const auto& type : kTypes) {
    INFO(type);
    if (!ctorch::optim::hasFusedKernel(baseType(type), c10::DeviceType::CPU, at::kFloat)) {
      Params p = makeParams(3);
      auto o = make(type, Kernels::kFused, p.groups(0.2, baseType(type)));
      p.all[0].mutable_grad() = torch::ones_like(p.all[0]);
      CHECK_THROWS_AS(o->step(), ctorch::ConfigError);  // names the missing kernel
      continue;
    }
    Params ref = makeParams(3), mine = makeParams(3);
    auto a = make(type, Kernels::kPerParameter, ref.groups(0.2, baseType(type)));
    auto b = make(type, Kernels::kFused, mine.groups(0.2, baseType(type)));
    run(*a, ref, *b, mine, 8);
    const double err = maxRelative(mine, ref);
    INFO("max relative difference " << err);
    CHECK(err <= 1e-6);
    CHECK(maxRelative(mine, makeParams(3)) > 1e-3);
    requireSameState(*b, *a, /*exact=*/false);
  }
}

// FSDP and ZeRO step flat shards of the parameters where DDP steps whole tensors: an element's
// update must not depend on where in a tensor it lies (a vectorised body or a tail) with the kernels
// kAuto picks. (LibTorch 2.14's fused CPU SGD fails this with momentum: kAuto does not pick it.)
TEST_CASE("optim: an element's update does not depend on how the parameters are packed", "[optim]") {
  for (Kernels k : {Kernels::kForEach, Kernels::kAuto}) {
    for (const auto& type : kTypes) {
      INFO(type << " " << ctorch::optim::toString(k));
      torch::manual_seed(5);
      std::vector<at::Tensor> whole{torch::randn({37}).requires_grad_(), torch::randn({129}).requires_grad_()};
      auto flat = torch::cat({whole[0].detach(), whole[1].detach()}).requires_grad_();
      // Three shards cutting across the parameters at unaligned offsets.
      std::vector<at::Tensor> shards{flat.detach().narrow(0, 0, 21).clone().requires_grad_(),
                                     flat.detach().narrow(0, 21, 50).clone().requires_grad_(),
                                     flat.detach().narrow(0, 71, 95).clone().requires_grad_()};
      std::vector<torch::optim::OptimizerParamGroup> gw{torch::optim::OptimizerParamGroup(whole)};
      std::vector<torch::optim::OptimizerParamGroup> gs{torch::optim::OptimizerParamGroup(shards)};
      auto ow = make(type, k, gw), os = make(type, k, gs);
      for (int s = 0; s < 5; ++s) {
        torch::manual_seed(50 + s);
        const auto g = torch::randn({166});
        whole[0].mutable_grad() = g.narrow(0, 0, 37).clone();
        whole[1].mutable_grad() = g.narrow(0, 37, 129).clone();
        shards[0].mutable_grad() = g.narrow(0, 0, 21).clone();
        shards[1].mutable_grad() = g.narrow(0, 21, 50).clone();
        shards[2].mutable_grad() = g.narrow(0, 71, 95).clone();
        ow->step();
        os->step();
      }
      const auto a = torch::cat({whole[0].detach(), whole[1].detach()});
      const auto b = torch::cat({shards[0].detach(), shards[1].detach(), shards[2].detach()});
      CHECK(torch::equal(a, b));
    }
  }
}

TEST_CASE("optim: kernel names, kAuto's choice and refused input", "[optim]") {
  for (Kernels k : {Kernels::kAuto, Kernels::kFused, Kernels::kForEach, Kernels::kPerParameter})
    CHECK(ctorch::optim::kernelsFromString(ctorch::optim::toString(k)) == k);
  CHECK_FALSE(ctorch::optim::kernelsFromString("fast").has_value());
  CHECK_FALSE(ctorch::optim::hasFusedKernel("RMSprop", c10::DeviceType::CPU, at::kFloat));
  CHECK_FALSE(ctorch::optim::hasFusedKernel("Adam", c10::DeviceType::CPU, at::kLong));

  auto p = torch::randn({4}).requires_grad_();
  ctorch::optim::Adam adam({p}, torch::optim::AdamOptions(0.1));
  CHECK(adam.lastKernels() == Kernels::kAuto);
  p.mutable_grad() = torch::ones({4});
  adam.step();
  const bool fused = ctorch::optim::hasFusedKernel("Adam", c10::DeviceType::CPU, at::kFloat);
  CHECK(adam.lastKernels() == (fused ? Kernels::kFused : Kernels::kForEach));
  auto r = torch::randn({4}).requires_grad_();
  ctorch::optim::SGD autoSgd({r}, torch::optim::SGDOptions(0.1).momentum(0.9));
  r.mutable_grad() = torch::ones({4});
  autoSgd.step();
  CHECK(autoSgd.lastKernels() == Kernels::kForEach);  // never the fused CPU SGD (above)

  // A parameter without a gradient is left alone and gets no state, as torch::optim does.
  auto q = torch::randn({3}).requires_grad_();
  ctorch::optim::SGD sgd({q}, torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto before = q.detach().clone();
  sgd.step();
  CHECK(torch::equal(q, before));
  CHECK(sgd.state().empty());

  auto e = torch::randn({10, 3}).requires_grad_();
  e.mutable_grad() = torch::sparse_coo_tensor(torch::tensor({{0, 2}}), torch::ones({2, 3}), {10, 3});
  ctorch::optim::SGD sparse({e}, torch::optim::SGDOptions(0.1));
  CHECK_THROWS_AS(sparse.step(), ctorch::ConfigError);
}
