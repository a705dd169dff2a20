// Pipeline stages under ResilientTraining: every rank writes its stage's shard beside each snapshot; a
// run stopped after step 2 and started again (a group restart) resumes bit-identically, on 2 stages
// and on 2 pipelines of 2 stages; a snapshot of another number of stages or another partition is
// refused naming both; the shards consolidate into the whole model, which one process trains on
// bit-identically.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "pipeline_test_util.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/pipeline.hpp"
#include "ctorch/resilience.hpp"
#include "ctorch/sharded_snapshot.hpp"

#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

using namespace ctorch::test;
using ddptest::arg;
using ddptest::argInt;
using ddptest::paramsHex;

namespace pipeline_resume_test {

using namespace pipeline_test;
constexpr int kSteps = 4;
constexpr int kMicroBatches = 4;

std::vector<std::size_t> partitionOf(const std::vector<std::string>& args, torch::nn::Sequential& model, int stages) {
  const std::string given = arg(args, "partition", "");
  if (given.empty()) return ctorch::balancedPartition(model, stages);
  std::vector<std::size_t> sizes;
  std::stringstream in(given);
  for (std::string part; std::getline(in, part, ',');) sizes.push_back(std::stoul(part));
  return sizes;
}

// Step k's rows of this replica: the replicas split a batch of 8 rows each.
std::pair<at::Tensor, at::Tensor> replicaBatch(int step, int replica, int replicas) {
  auto [x, y] = batch(step, 8 * replicas);
  return {x.narrow(0, 8 * replica, 8), y.narrow(0, 8 * replica, 8)};
}

// args: dir=<folder> stages=S (world = replicas x S) schedule=<gpipe|1f1b> optimizer=<sgd|adam>
// stop-after=<steps, 0: run through> [partition=a,b] [epoch-steps=<steps per epoch, 0: one epoch>]. Four steps under ResilientTraining with a
// snapshot after every step; each rank prints "after step k <its stage's parameters>" and, resumed,
// "resumed at step s" and "restored <parameters>". A refused resume prints "refused: <why>", exit 3.
CTORCH_TEST_WORKER(pipeline_resume) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int S = static_cast<int>(argInt(args, "stages", ctorch::getWorldSize()));
  const int stopAfter = static_cast<int>(argInt(args, "stop-after", 0));
  const int epochSteps = static_cast<int>(argInt(args, "epoch-steps", 0));
  const auto groups = ctorch::pipelineGroups(S);
  auto model = makeModel();
  const auto sizes = partitionOf(args, model, S);
  ctorch::PipelineStage stage(ctorch::pipelineSplit(model, sizes, groups.stage), groups.stage, S,
                              ctorch::PipelineStageOptions().group(groups.pipeline).seed(kSeed));
  ctorch::PipelineScheduleOptions scheduleOptions;
  if (groups.replicas > 1) scheduleOptions.dataParallelGroup(groups.dataParallel);
  ctorch::PipelineSchedule schedule(stage, kMicroBatches, ctorch::parsePipelineSchedule(arg(args, "schedule", "1f1b")), lossFn,
                                    scheduleOptions);
  auto optimizer = makeOptimizer(arg(args, "optimizer", "adam"), stage.module()->parameters());
  ctorch::ResilientTraining training(ctorch::ResilienceOptions()
                                         .snapshotPath(std::filesystem::path(arg(args, "dir")) / "snapshot.pt")
                                         .saveEverySteps(1)
                                         .handleSignals(false)
                                         .runName("pipeline-test"));
  training.track(schedule).track(*optimizer);
  ctorch::ResumePoint start;
  try {
    start = training.resume();
  } catch (const std::exception& e) {
    std::cout << "refused: " << e.what() << "\n";
    return 3;
  }
  if (start.globalStep > 0)
    std::cout << "resumed at step " << start.globalStep << " (schedule step " << schedule.stepCount() << ")\nrestored "
              << paramsHex(stage.module()->parameters()) << "\n";
  for (int step = static_cast<int>(start.globalStep); step < kSteps; ++step) {
    auto [x, y] = replicaBatch(step, groups.replica, groups.replicas);
    optimizer->zero_grad();
    schedule.step(stage.isFirst() ? x : at::Tensor(), stage.isLast() ? y : at::Tensor());
    optimizer->step();
    std::cout << "after step " << step << " " << paramsHex(stage.module()->parameters()) << "\n";
    if (training.stepDone()) return training.exitCode();
    if (epochSteps > 0 && (step + 1) % epochSteps == 0 && training.epochDone()) return training.exitCode();
    if (stopAfter > 0 && step + 1 == stopAfter) break;
  }
  if (stopAfter == 0) {  // the whole model on every rank: the other stages' weights are stale until gathered
    std::cout << "whole before gathering " << paramsHex(model->parameters()) << "\n";
    ctorch::pipelineGatherModel(model, sizes, stage);
    std::cout << "whole after gathering " << paramsHex(model->parameters()) << "\n";
  }
  training.finish();
  ctorch::destroyProcessGroup();
  return 0;
}

// World 1 (args: dir=<folder> stages=S optimizer=<sgd|adam>): the newest snapshot consolidated into the
// whole model and optimizer, restored into one process, which trains the remaining steps by gradient
// accumulation; prints "after step k <stage t's parameters>" for each stage t as the pipeline cuts it.
CTORCH_TEST_WORKER(pipeline_consolidated) {
  const int S = static_cast<int>(argInt(args, "stages", 2));
  auto model = makeModel();
  const auto sizes = ctorch::balancedPartition(model, S);
  auto optimizer = makeOptimizer(arg(args, "optimizer", "adam"), model->parameters());
  const auto found = ctorch::loadNewestValid(std::filesystem::path(arg(args, "dir")) / "snapshot.pt");
  if (!found.snapshot) throw std::runtime_error("no snapshot");
  std::cout << "sharding: " << ctorch::toString(ctorch::shardingOf(*found.snapshot)) << "\n";
  const ctorch::Snapshot whole = ctorch::consolidateSnapshot(*found.snapshot);
  std::cout << "consolidated: " << whole.modelState.size() << " tensors, " << whole.optimizerType << "\n";
  ctorch::RestoreOptions options;
  options.rng = false;
  ctorch::restoreSnapshot(whole, ctorch::TrainingObjects{model.ptr().get(), optimizer.get(), nullptr}, options);
  std::vector<torch::nn::Sequential> stages;
  for (int t = 0; t < S; ++t) stages.push_back(ctorch::pipelineSplit(model, sizes, t));
  for (int step = static_cast<int>(whole.globalStep); step < kSteps; ++step) {
    auto [x, y] = batch(step, 8);
    optimizer->zero_grad();
    referenceStep(stages, x, y, kMicroBatches, step, kMicroBatches);
    optimizer->step();
    for (int t = 0; t < S; ++t)
      std::cout << "stage " << t << " after step " << step << " " << paramsHex(stages[static_cast<std::size_t>(t)]->parameters()) << "\n";
  }
  return 0;
}

// The lines of `output` that begin with `prefix`, in order.
std::vector<std::string> linesWith(const std::string& output, const std::string& prefix) {
  std::vector<std::string> lines;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) lines.push_back(line);
  return lines;
}

std::vector<std::string> stepsFrom(const std::string& output, int first) {
  std::vector<std::string> out;
  for (const auto& line : linesWith(output, "after step "))
    if (std::stoi(line.substr(11)) >= first) out.push_back(line);
  return out;
}

// A pipeline_resume run whose ranks are each to refuse the snapshot (exit 3): one rank's refusal
// must not cut short another's.
ctorch::test::WorkerGroupOptions refusedOn(int world, std::vector<std::string> args) {
  ctorch::test::WorkerGroupOptions o;
  o.worker = "pipeline_resume";
  o.worldSize = world;
  o.args = std::move(args);
  o.expectedExitCodes = {3};
  return o;
}

}  // namespace pipeline_resume_test

using namespace pipeline_resume_test;

TEST_CASE("pipeline resume: stopped after step 2 and restarted, 2 stages and 2 pipelines of 2 stages go on bit-identically "
          "from each rank's stage shard",
          "[pipeline][resume]") {
  struct Case {
    int world, stages;
    std::string schedule, optimizer;
  };
  for (const Case& c : {Case{2, 2, "1f1b", "adam"}, Case{4, 2, "gpipe", "sgd"}}) {
    INFO(c.world << " ranks, " << c.stages << " stages, " << c.schedule << ", " << c.optimizer);
    const std::vector<std::string> common = {"stages=" + std::to_string(c.stages), "schedule=" + c.schedule,
                                             "optimizer=" + c.optimizer};
    TempDir whole("ctorch-pipe-whole"), parts("ctorch-pipe-parts");
    auto withDir = [&](const TempDir& dir, std::vector<std::string> extra) {
      auto a = common;
      a.push_back("dir=" + dir.path().string());
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    auto through = runWorkerGroup({.worker = "pipeline_resume", .worldSize = c.world, .args = withDir(whole, {})});
    requireAllOk(through);
    auto first = runWorkerGroup({.worker = "pipeline_resume", .worldSize = c.world, .args = withDir(parts, {"stop-after=2"})});
    requireAllOk(first);
    // Every rank wrote its stage's shard; the snapshot itself holds no parameters.
    CHECK(ctorch::snapshotShardFiles(parts.path() / "snapshot.pt").size() == static_cast<std::size_t>(c.world));
    const auto saved = ctorch::loadNewestValid(parts.path() / "snapshot.pt");
    REQUIRE(saved.snapshot);
    CHECK(saved.snapshot->modelState.size() == 0);
    CHECK(ctorch::shardingOf(*saved.snapshot) == ctorch::SnapshotSharding::kPipelineStages);
    auto second = runWorkerGroup({.worker = "pipeline_resume", .worldSize = c.world, .args = withDir(parts, {})});
    requireAllOk(second);
    for (int r = 0; r < c.world; ++r) {
      const auto& expected = through[static_cast<std::size_t>(r)].output;
      const auto& resumed = second[static_cast<std::size_t>(r)].output;
      INFO("rank " << r << " through:\n" << expected << "resumed:\n" << resumed);
      CHECK_THAT(resumed, Catch::Contains("resumed at step 2 (schedule step 2)"));
      const auto steps = stepsFrom(expected, 0);
      REQUIRE(steps.size() == static_cast<std::size_t>(kSteps));
      CHECK(linesWith(resumed, "restored ").front().substr(9) == steps[1].substr(steps[1].find(' ', 11) + 1));
      CHECK(stepsFrom(resumed, 0) == stepsFrom(expected, 2));
      CHECK(stepsFrom(first[static_cast<std::size_t>(r)].output, 0) == std::vector<std::string>(steps.begin(), steps.begin() + 2));
      // pipelineGatherModel: every rank's copy of the whole model is the same once gathered, not before.
      CHECK(linesWith(expected, "whole after gathering ") == linesWith(through.front().output, "whole after gathering "));
      if (r % c.stages != 0)  // another stage than rank 0's: its copy of stage 0 was stale
        CHECK(linesWith(expected, "whole before gathering ") != linesWith(through.front().output, "whole before gathering "));
    }
  }
}

TEST_CASE("pipeline resume: saved by 2 pipelines of 2 stages, a single pipeline takes each stage from a replica's shard",
          "[pipeline][resume]") {
  TempDir dir("ctorch-pipe-replicas");
  // Epochs of 2 steps: another world size resumes at an epoch boundary.
  auto first = runWorkerGroup({.worker = "pipeline_resume", .worldSize = 4,
                               .args = {"stages=2", "schedule=1f1b", "optimizer=sgd", "stop-after=2", "epoch-steps=2",
                                        "dir=" + dir.path().string()}});
  requireAllOk(first);
  auto second = runWorkerGroup({.worker = "pipeline_resume", .worldSize = 2,
                                .args = {"stages=2", "schedule=1f1b", "optimizer=sgd", "stop-after=3", "epoch-steps=2",
                                         "dir=" + dir.path().string()}});
  requireAllOk(second);
  for (int r = 0; r < 2; ++r) {
    const auto& saved = first[static_cast<std::size_t>(r)].output;
    const auto& resumed = second[static_cast<std::size_t>(r)].output;
    INFO("stage " << r << " saved:\n" << saved << "resumed:\n" << resumed);
    const auto steps = stepsFrom(saved, 1);
    REQUIRE(steps.size() == 1);
    REQUIRE(linesWith(resumed, "restored ").size() == 1);
    CHECK(linesWith(resumed, "restored ").front().substr(9) == steps[0].substr(steps[0].find(' ', 11) + 1));
  }
}

TEST_CASE("pipeline resume: the shards consolidate into the whole model, which one process trains on bit-identically, "
          "and another number of stages or another partition is refused naming both",
          "[pipeline][resume]") {
  TempDir whole("ctorch-pipe-whole"), dir("ctorch-pipe-refuse");
  const std::string d = "dir=" + dir.path().string();
  auto through = runWorkerGroup({.worker = "pipeline_resume", .worldSize = 2,
                                 .args = {"stages=2", "optimizer=adam", "epoch-steps=2", "dir=" + whole.path().string()}});
  requireAllOk(through);
  requireAllOk(runWorkerGroup({.worker = "pipeline_resume", .worldSize = 2, .args = {"stages=2", "optimizer=adam", "epoch-steps=2", "stop-after=2", d}}));

  auto one = runWorkerGroup({.worker = "pipeline_consolidated", .worldSize = 1, .args = {"stages=2", "optimizer=adam", d}});
  requireAllOk(one);
  {
    INFO("consolidated:\n" << one.front().output);
    CHECK_THAT(one.front().output, Catch::Contains("sharding: model and optimizer by pipeline stage"));
    CHECK_THAT(one.front().output, Catch::Contains("consolidated: 8 tensors, Adam"));
    for (int t = 0; t < 2; ++t) {
      const auto expected = stepsFrom(through[static_cast<std::size_t>(t)].output, 2);
      REQUIRE(expected.size() == 2);
      CHECK(linesWith(one.front().output, "stage " + std::to_string(t) + " after step ") ==
            std::vector<std::string>{"stage " + std::to_string(t) + " " + expected[0], "stage " + std::to_string(t) + " " + expected[1]});
    }
  }

  // At the epoch boundary of step 2, a run of another world size restores it: 3 stages are refused.
  auto three = runWorkerGroup(refusedOn(3, {"stages=3", "optimizer=adam", "epoch-steps=2", d}));
  for (const auto& r : three) {
    INFO(r.output);
    CHECK(r.exitCode == 3);
    CHECK_THAT(r.output, Catch::Contains("refused: ") && Catch::Contains("saved by a pipeline of 2 stages, this run has 3"));
  }
  auto repartitioned = runWorkerGroup(refusedOn(2, {"stages=2", "optimizer=adam", "epoch-steps=2", "partition=3,6", d}));
  for (const auto& r : repartitioned) {
    INFO(r.output);
    CHECK(r.exitCode == 3);
    CHECK_THAT(r.output, Catch::Contains("refused: ") && Catch::Contains("held the model's children") &&
                             Catch::Contains("this run's holds children") && Catch::Contains("the same partition"));
  }
}
