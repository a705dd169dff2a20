// Shared pieces of the snapshot tests: small models, a fully populated snapshot, byte surgery.
#pragma once

#include "ctorch/snapshot.hpp"

#include <torch/torch.h>

#include "ctorch_catch.hpp"

#include <string>
#include <vector>

namespace snaptest {

// The model of the Python interop test (check_snapshot.py builds the same one).
inline torch::nn::Sequential interopModel() {
  return torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3),
                               torch::nn::ReLU(), torch::nn::Linear(3, 2));
}

// Every state entry filled with a pattern Python can recompute from the name.
inline void fillPattern(torch::nn::Module& model) {
  torch::NoGradGuard noGrad;
  auto fill = [](const std::string& name, at::Tensor& t) {
    if (t.scalar_type() == at::kLong) {
      t.fill_(static_cast<std::int64_t>(name.size()));
    } else {
      t.copy_((torch::arange(t.numel(), torch::kFloat) * 0.01 + static_cast<double>(name.size()))
                  .reshape(t.sizes()));
    }
  };
  for (auto& p : model.named_parameters()) fill(p.key(), p.value());
  for (auto& b : model.named_buffers()) fill(b.key(), b.value());
}

inline ctorch::SnapshotIdentity identity(const std::string& model = "tiny",
                                         std::int64_t world = 2) {
  ctorch::SnapshotIdentity id;
  id.modelName = model;
  id.worldSize = world;
  id.config = {{"lr", "0.1"}, {"batch_size", "8"}};
  return id;
}

// A snapshot with every field populated (model, SGD momentum, sampler, scheduler, user items).
inline ctorch::Snapshot populatedSnapshot(std::int64_t epochsRun = 3, std::int64_t modelWidth = 16) {
  torch::manual_seed(11);
  auto model = torch::nn::Sequential(torch::nn::Linear(8, modelWidth), torch::nn::BatchNorm1d(modelWidth),
                                     torch::nn::Linear(modelWidth, 2));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  model->train();
  auto loss = model->forward(torch::randn({4, 8})).pow(2).sum();
  loss.backward();
  opt.step();
  ctorch::DistributedSamplerOptions so;
  so.datasetSize = 100;
  so.worldSize = 2;
  so.rank = 0;
  so.seed = 5;
  ctorch::DistributedSampler sampler(so);
  sampler.setEpoch(epochsRun);
  sampler.next(7);
  auto snap = ctorch::captureSnapshot({model.ptr().get(), &opt, &sampler}, identity(),
                                      {epochsRun, 7, epochsRun * 50 + 7});
  snap.schedulerState.insert("last_epoch", epochsRun);
  snap.schedulerState.insert("gamma", 0.5);
  snap.userState.insert("best_accuracy", 0.875);
  snap.userState.insert("note", std::string("hello"));
  snap.userState.insert("history", c10::List<double>({0.5, 0.25}));
  snap.userState.insert("marker", torch::full({64}, 1234.5f));  // recognisable bytes in the file
  return snap;
}

inline std::vector<char> encoded(ctorch::Snapshot s) { return ctorch::encodeSnapshot(s); }

inline std::size_t find(const std::vector<char>& bytes, const std::string& needle,
                        std::size_t from = 0) {
  std::string_view hay(bytes.data(), bytes.size());
  return hay.find(needle, from);
}

// Decodes and returns the corruption kind, or nullopt when the bytes decode.
inline std::optional<ctorch::SnapshotCorrupt::Kind> corruptionOf(const std::vector<char>& bytes,
                                                                std::string* message = nullptr) {
  try {
    ctorch::decodeSnapshot(bytes, "test/snapshot.pt");
  } catch (const ctorch::SnapshotCorrupt& e) {
    if (message) *message = e.what();
    return e.kind();
  }
  return std::nullopt;
}

inline bool sameTensorBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  auto ca = a.contiguous().cpu(), cb = b.contiguous().cpu();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

} // namespace snaptest
