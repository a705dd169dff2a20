// Bit-identical resume: 2k steps in one process equal k steps, snapshot, a NEW process that loads it
// and takes k more steps, to the byte. Dropout makes the RNG state matter, momentum/Adam moments the
// optimizer state, a shuffled sampler stopped mid-epoch the sampler state; controls that leave one
// of them out must differ.
#include "fixtures.hpp"

#include "multiproc.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>

using namespace snaptest;
using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kBatch = 8;

struct Trainer {
  std::string optimizerName;
  at::Tensor inputs, targets;
  torch::nn::Sequential model{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<ctorch::DistributedSampler> sampler;
  std::int64_t epoch = 0, stepInEpoch = 0, globalStep = 0;
  double baseLr = 0;

  explicit Trainer(const std::string& opt) : optimizerName(opt) {
    torch::set_num_threads(1);
    auto data = at::make_generator<at::CPUGeneratorImpl>(99);  // the data set never changes
    inputs = torch::randn({96, 8}, data);
    targets = torch::randint(0, 4, {96}, data, torch::kLong);
    torch::manual_seed(1234);  // initial weights (a resumed run overwrites them)
    model = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::BatchNorm1d(32),
                                  torch::nn::ReLU(), torch::nn::Dropout(0.3),
                                  torch::nn::Linear(32, 4));
    if (opt == "sgd") {
      baseLr = 0.05;
      optimizer = std::make_unique<torch::optim::SGD>(
          model->parameters(), torch::optim::SGDOptions(baseLr).momentum(0.9).weight_decay(1e-4));
    } else {
      baseLr = 0.01;
      optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                       torch::optim::AdamOptions(baseLr));
    }
    ctorch::DistributedSamplerOptions so;
    so.datasetSize = 96;
    so.worldSize = 2;  // this process plays rank 1 of 2: 48 indices, 6 steps per epoch
    so.rank = 1;
    so.seed = 17;
    sampler = std::make_unique<ctorch::DistributedSampler>(so);
    sampler->setEpoch(0);
  }

  ctorch::TrainingObjects objects() { return {model.ptr().get(), optimizer.get(), sampler.get()}; }

  void step() {
    if (sampler->exhausted()) {
      ++epoch;
      stepInEpoch = 0;
      sampler->setEpoch(epoch);
    }
    const auto idx = sampler->next(kBatch);
    const auto index = torch::tensor(idx, torch::kLong);
    model->train();
    const auto out = model->forward(inputs.index_select(0, index));
    const auto loss = torch::nn::functional::cross_entropy(out, targets.index_select(0, index));
    optimizer->zero_grad();
    loss.backward();
    optimizer->step();
    ++globalStep;
    ++stepInEpoch;
    // A per-step decay, so the learning rate the optimizer holds changes over time.
    for (auto& g : optimizer->param_groups())
      g.options().set_lr(baseLr * std::pow(0.97, static_cast<double>(globalStep)));
  }
};

// resume_train <sgd|adam> <full|first|second> <k> <dir> <out> <skip: none|optimizer|rng|sampler>
CTORCH_TEST_WORKER(resume_train) {
  const std::string opt = args.at(0), mode = args.at(1);
  const int k = std::stoi(args.at(2));
  const fs::path dir = args.at(3), out = args.at(4);
  const std::string skip = args.at(5);
  Trainer t(opt);
  const auto slot = dir / "snapshot.pt";
  ctorch::SnapshotIdentity id{"resume-mlp", 2, {{"optimizer", opt}, {"batch", "8"}}};

  if (mode == "second") {
    ctorch::LoadNewestOptions lo;
    lo.expect.modelName = id.modelName;
    lo.expect.config = id.config;
    auto found = ctorch::loadNewestValid(slot, lo);
    if (!found.snapshot) throw std::runtime_error("no snapshot: " + found.describeSkipped());
    ctorch::RestoreOptions ro;
    ro.optimizer = skip != "optimizer";
    ro.rng = skip != "rng";
    ro.sampler = skip != "sampler";
    ctorch::restoreSnapshot(*found.snapshot, t.objects(), ro);
    t.epoch = found.snapshot->epochsRun;
    t.stepInEpoch = found.snapshot->stepInEpoch;
    t.globalStep = found.snapshot->schedulerState.at("global_step").toInt();
    t.sampler->setEpoch(t.epoch);  // keeps the restored mid-epoch position
  }
  const int steps = mode == "full" ? 2 * k : k;
  for (int i = 0; i < steps; ++i) t.step();
  if (mode == "first") {
    auto snap = ctorch::captureSnapshot(t.objects(), id, {t.epoch, t.stepInEpoch, t.globalStep});
    snap.schedulerState.insert("global_step", t.globalStep);
    ctorch::SnapshotSlotOptions so;
    so.path = slot;
    ctorch::saveSnapshot(snap, so);
    std::printf("saved at epoch %lld step %lld position %lld\n", static_cast<long long>(t.epoch),
                static_cast<long long>(t.stepInEpoch), static_cast<long long>(t.sampler->position()));
  }
  const auto bytes = torch::jit::pickle_save(ctorch::captureModelState(*t.model));
  std::ofstream(out, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return 0;
}

c10::Dict<std::string, at::Tensor> readState(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto d = torch::jit::pickle_load(bytes).toGenericDict();
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& e : d) out.insert(e.key().toStringRef(), e.value().toTensor());
  return out;
}

// Names of the entries whose bytes differ ("" when all are identical).
std::string differingEntries(const fs::path& a, const fs::path& b) {
  const auto x = readState(a), y = readState(b);
  std::string diff;
  REQUIRE(x.size() == y.size());
  for (const auto& e : x)
    if (!sameTensorBytes(e.value(), y.at(e.key()))) diff += (diff.empty() ? "" : ", ") + e.key();
  return diff;
}

ctorch::test::SpawnOptions trainCommand(const std::string& opt, const std::string& mode, int k,
                                        const fs::path& dir, const fs::path& out,
                                        const std::string& skip = "none") {
  ctorch::test::SpawnOptions so;
  so.argv = {ctorch::test::selfExe().string(), "--ctorch-worker", "resume_train", opt, mode,
             std::to_string(k), dir.string(), out.string(), skip};
  so.timeout = std::chrono::seconds(90);
  return so;
}

} // namespace

TEST_CASE("resuming in a new process continues bit-identically", "[snapshot][resume]") {
  const int k = 9;  // 6 steps per epoch: the snapshot falls mid-way through epoch 1
  for (const std::string opt : {"sgd", "adam"}) {
    INFO("optimizer " << opt);
    TempDir dir("snap-resume");
    {
      // The uninterrupted run and the first half run side by side.
      ctorch::test::Process full(trainCommand(opt, "full", k, dir.path(), dir / "full.pt"));
      ctorch::test::Process first(trainCommand(opt, "first", k, dir.path(), dir / "first.pt"));
      const auto rf = full.wait(), r1 = first.wait();
      INFO(rf.output << r1.output);
      REQUIRE(rf.ok());
      REQUIRE(r1.ok());
      CHECK_THAT(r1.output, Catch::Contains("saved at epoch 1 step 3 position 24"));
    }
    // The resumed run and the controls, each a new process reading the same snapshot.
    const std::vector<std::string> variants = {"none", "optimizer", "rng", "sampler"};
    std::vector<std::unique_ptr<ctorch::test::Process>> runs;
    for (const auto& skip : variants)
      runs.push_back(std::make_unique<ctorch::test::Process>(
          trainCommand(opt, "second", k, dir.path(), dir / ("second-" + skip + ".pt"), skip)));
    for (std::size_t i = 0; i < runs.size(); ++i) {
      const auto r = runs[i]->wait();
      INFO(variants[i] << ": " << r.output);
      REQUIRE(r.ok());
    }
    // The first half alone is not the answer (the second half did something).
    CHECK_FALSE(differingEntries(dir / "full.pt", dir / "first.pt").empty());
    // Resumed with everything: identical bytes, every parameter and buffer.
    CHECK(differingEntries(dir / "full.pt", dir / "second-none.pt") == "");
    // Controls: leaving out the optimizer state, the RNG state or the sampler position changes
    // the result, so the check above is not vacuous.
    for (const std::string skip : {"optimizer", "rng", "sampler"}) {
      INFO("resumed without restoring the " << skip << " state");
      CHECK_FALSE(differingEntries(dir / "full.pt", dir / ("second-" + skip + ".pt")).empty());
    }
  }
}
