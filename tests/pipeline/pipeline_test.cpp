// ctorch pipeline parallelism: the balanced partition and the schedules' action lists (pure), and
// pipelines of real processes (TCPStore, Gloo send/recv on 127.0.0.1) against one process running the
// same model with M gradient-accumulation micro-steps: bit for bit at S = 2 and 3, M = 1 and 4, GPipe
// and 1F1B, SGD and Adam, with dropout seeded per micro-batch; pipeline x data parallel within a bound.
#include "ctorch_catch.hpp"

#include "multiproc.hpp"
#include "pipeline_test_util.hpp"
#include "../ddp/ddp_test_util.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/pipeline.hpp"
#include "pipeline/partition.hpp"

#include <torch/torch.h>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

using namespace ctorch::test;
using ddptest::arg;
using ddptest::paramsHex;

namespace pipeline_test {

// args: none. World = S stages. For each schedule, M in {1, 4}, optimizer in {sgd, adam}: three steps
// of the pipeline and of the reference; prints "equal" or "DIFFER" per step and check.
CTORCH_TEST_WORKER(pipeline_exact) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int S = ctorch::getWorldSize(), rank = ctorch::getRank();
  for (const auto kind : {ctorch::PipelineScheduleKind::kGPipe, ctorch::PipelineScheduleKind::k1F1B})
    for (const int M : {1, 4})
      for (const std::string optim : {"sgd", "adam"}) {
        const std::string config = std::string(ctorch::toString(kind)) + " M=" + std::to_string(M) + " " + optim;
        auto model = makeModel(), ref = makeModel();
        const auto sizes = ctorch::balancedPartition(model, S);
        ctorch::PipelineStage stage(ctorch::pipelineSplit(model, sizes, rank), rank, S,
                                    ctorch::PipelineStageOptions().seed(kSeed));
        ctorch::PipelineSchedule schedule(stage, M, kind, lossFn);
        std::vector<torch::nn::Sequential> refStages;
        for (int t = 0; t < S; ++t) refStages.push_back(ctorch::pipelineSplit(ref, sizes, t));
        auto opt = makeOptimizer(optim, stage.module()->parameters());
        auto refOpt = makeOptimizer(optim, ref->parameters());
        for (int step = 0; step < 3; ++step) {
          auto [x, y] = batch(step, rowsOf(step));
          opt->zero_grad();
          auto losses = schedule.step(stage.isFirst() ? x : at::Tensor(), stage.isLast() ? y : at::Tensor());
          opt->step();
          refOpt->zero_grad();
          auto refLosses = referenceStep(refStages, x, y, M, step, static_cast<double>(M));
          refOpt->step();
          const std::string at = config + " step " + std::to_string(step) + ": ";
          std::cout << at << "params "
                    << (paramsHex(stage.module()->parameters()) == paramsHex(refStages[rank]->parameters()) ? "equal" : "DIFFER")
                    << "\n";
          if (stage.isLast())
            std::cout << at << "losses " << (losses.size() == static_cast<std::size_t>(M) &&
                                                     paramsHex(losses) == paramsHex(refLosses) ? "equal" : "DIFFER")
                      << "\n";
          const auto& stats = schedule.lastStepStats();
          const int inFlight = kind == ctorch::PipelineScheduleKind::kGPipe ? M : std::min(S - rank, M);
          std::cout << at << "in flight " << (stats.maxInFlight == inFlight ? "equal" : "DIFFER") << " ("
                    << stats.maxInFlight << ")\n";
          const bool exchanged = step != 1;  // the first step and the step whose shapes changed
          std::cout << at << "shapes exchanged " << (stats.shapesExchanged == exchanged || S == 1 ? "equal" : "DIFFER") << "\n";
        }
        // Evaluation: dropout off, the whole batch's output on the last stage.
        torch::NoGradGuard noGrad;
        model->eval();
        ref->eval();
        auto [x, y] = batch(7, 8);
        at::Tensor out = schedule.evaluate(stage.isFirst() ? x : at::Tensor());
        if (stage.isLast()) {  // the model run on each micro-batch (a whole batch's matmul rounds otherwise)
          std::vector<at::Tensor> refOut;
          for (const auto& xm : x.tensor_split(M, 0)) refOut.push_back(ref->forward(xm));
          std::cout << config << " evaluate: " << (paramsHex({out}) == paramsHex({torch::cat(refOut, 0)}) ? "equal" : "DIFFER") << "\n";
        }
      }
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// World = 2 replicas x 2 stages. Each replica takes its half of a 16-row batch; the stage's gradients
// are averaged over its data-parallel group. Prints the largest parameter difference against one
// process on the whole batch (the DDP equivalence), after three SGD steps.
CTORCH_TEST_WORKER(pipeline_2d) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  const int M = 2;
  const auto groups = ctorch::pipelineGroups(2);
  std::cout << "layout stage " << groups.stage << " replica " << groups.replica << " of " << groups.replicas << "\n";
  auto model = makeModel(), ref = makeModel();
  const auto sizes = ctorch::balancedPartition(model, 2);
  ctorch::PipelineStage stage(ctorch::pipelineSplit(model, sizes, groups.stage), groups.stage, 2,
                              ctorch::PipelineStageOptions().group(groups.pipeline).seed(kSeed));
  ctorch::Schedule1F1B schedule(stage, M, lossFn, ctorch::PipelineScheduleOptions().dataParallelGroup(groups.dataParallel));
  std::vector<torch::nn::Sequential> refStages{ctorch::pipelineSplit(ref, sizes, 0), ctorch::pipelineSplit(ref, sizes, 1)};
  auto opt = makeOptimizer("sgd", stage.module()->parameters());
  auto refOpt = makeOptimizer("sgd", ref->parameters());
  double worst = 0;
  for (int step = 0; step < 3; ++step) {
    auto [x, y] = batch(step, 16);
    opt->zero_grad();
    schedule.step(x.narrow(0, groups.replica * 8, 8), y.narrow(0, groups.replica * 8, 8));
    opt->step();
    refOpt->zero_grad();
    for (int r = 0; r < groups.replicas; ++r)
      referenceStep(refStages, x.narrow(0, r * 8, 8), y.narrow(0, r * 8, 8), M, step, static_cast<double>(M * groups.replicas));
    refOpt->step();
    auto mine = stage.module()->parameters(), theirs = refStages[static_cast<std::size_t>(groups.stage)]->parameters();
    for (std::size_t i = 0; i < mine.size(); ++i)
      worst = std::max(worst, (mine[i] - theirs[i]).abs().max().item<double>());
  }
  std::cout << "max difference " << worst << "\n";
  ctorch::barrier();
  ctorch::destroyProcessGroup();
  return 0;
}

// World 2. What is refused before anything is sent, then stage 1 runs with other micro-batches than
// stage 0: it refuses and leaves, and stage 0 learns it lost its neighbour (an error, not a hang).
CTORCH_TEST_WORKER(pipeline_refusals) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
  const int rank = ctorch::getRank();
  auto model = makeModel();
  const auto sizes = ctorch::balancedPartition(model, 2);
  try {
    ctorch::PipelineStage wrong(ctorch::pipelineSplit(model, sizes, rank), rank, 3);
  } catch (const ctorch::ConfigError& e) {
    std::cout << "refused: " << e.what() << "\n";
  }
  ctorch::PipelineStage stage(ctorch::pipelineSplit(model, sizes, rank), rank, 2);
  ctorch::ScheduleGPipe schedule(stage, rank == 0 ? 4 : 2, lossFn);
  auto [x, y] = batch(0, 8);
  if (rank == 0) {
    try {
      schedule.step(x.narrow(0, 0, 3));
    } catch (const ctorch::ConfigError& e) {
      std::cout << "refused: " << e.what() << "\n";
    }
  }
  try {
    schedule.step(x, y);
    std::cout << "no error\n";
  } catch (const ctorch::ConfigError& e) {
    std::cout << "refused: " << e.what() << "\n";
    std::cout.flush();
    std::_Exit(0);  // leaves without a word to stage 0
  } catch (const ctorch::DistributedError& e) {
    std::cout << "distributed error: " << e.what() << "\n";
  }
  std::cout.flush();
  std::_Exit(0);
}

// World 2: stage 0's output narrows on the second step while its input keeps its shape. Stage 0
// refuses before sending it (stage 1's buffer would not fit) and leaves; stage 1 gets an error.
CTORCH_TEST_WORKER(pipeline_shape_change) {
  ctorch::initProcessGroup(ctorch::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
  const int rank = ctorch::getRank();
  static int calls = 0;
  torch::nn::Sequential part =
      rank == 0 ? torch::nn::Sequential(torch::nn::Functional([](const at::Tensor& x) {
        return ++calls > 2 ? x.narrow(1, 0, 6) : x;  // two micro-batches per step
      }))
                : torch::nn::Sequential(torch::nn::Linear(12, 3));
  ctorch::PipelineStage stage(part, rank, 2);
  ctorch::Schedule1F1B schedule(stage, 2, lossFn);
  auto [x, y] = batch(0, 8);
  for (int step = 0; step < 2; ++step) {
    try {
      schedule.step(x, y);
      std::cout << "step " << step << " done\n";
    } catch (const ctorch::ConfigError& e) {
      std::cout << "refused: " << e.what() << "\n";
      std::cout.flush();
      std::_Exit(0);
    } catch (const ctorch::DistributedError& e) {
      std::cout << "distributed error: " << e.what() << "\n";
      std::cout.flush();
      std::_Exit(0);
    }
  }
  std::cout << "no error\n";
  std::cout.flush();
  std::_Exit(0);
}

} // namespace pipeline_test

using namespace pipeline_test;

TEST_CASE("balancedPartition: contiguous stages whose largest parameter count is smallest", "[pipeline]") {
  CHECK(ctorch::balancedPartitionOfCounts({10, 10, 10, 10}, 2) == std::vector<std::size_t>{2, 2});
  CHECK(ctorch::balancedPartitionOfCounts({100, 1, 1, 1, 100}, 3) == std::vector<std::size_t>{1, 3, 1});
  CHECK(ctorch::balancedPartitionOfCounts({0, 50, 0, 0, 50, 0}, 2) == std::vector<std::size_t>{2, 4});
  CHECK(ctorch::balancedPartitionOfCounts({5, 5, 5}, 3) == std::vector<std::size_t>{1, 1, 1});
  CHECK(ctorch::balancedPartitionOfCounts({7}, 1) == std::vector<std::size_t>{1});
  CHECK_THROWS_WITH(ctorch::balancedPartitionOfCounts({1, 2}, 3), "pipeline: 2 children cannot make 3 stages of at least one child each");
  CHECK_THROWS_WITH(ctorch::balancedPartitionOfCounts({1, 2}, 0), "pipeline: stages must be at least 1, got 0");
  // The seeds' MLP cut in two: 416 + 792 parameters before the cut, 408 + 51 after.
  auto model = makeModel();
  CHECK(ctorch::balancedPartition(model, 2) == std::vector<std::size_t>{4, 5});
}

TEST_CASE("pipelineSplit: a stage holds the model's own modules, named by their place in the model", "[pipeline]") {
  auto model = makeModel();
  auto stage = ctorch::pipelineSplit(model, {4, 3, 2}, 1);
  REQUIRE(stage->size() == 3);
  const auto names = stage->named_parameters().keys();
  CHECK(names == std::vector<std::string>{"5.weight", "5.bias"});
  CHECK(stage->parameters()[0].data_ptr() == model->named_parameters()["5.weight"].data_ptr());
  CHECK_THROWS_WITH(ctorch::pipelineSplit(model, {4, 4}, 0),
                    "pipeline: stage sizes [4, 4] add up to 8, but the model has 9 children");
  CHECK_THROWS_WITH(ctorch::pipelineSplit(model, {9, 0}, 0), "pipeline: stage sizes [9, 0] give a stage no child");
  CHECK_THROWS_WITH(ctorch::pipelineSplit(model, {4, 5}, 2), "pipeline: stage 2 is outside the 2 stages");
}

TEST_CASE("pipelineActions: GPipe and 1F1B per stage, backwards in micro-batch order", "[pipeline]") {
  using ctorch::PipelineScheduleKind;
  CHECK(ctorch::describeActions(ctorch::pipelineActions(PipelineScheduleKind::kGPipe, 1, 3, 3)) == "F0 F1 F2 B0 B1 B2");
  CHECK(ctorch::describeActions(ctorch::pipelineActions(PipelineScheduleKind::k1F1B, 0, 3, 4)) == "F0 F1 F2 B0 F3 B1 B2 B3");
  CHECK(ctorch::describeActions(ctorch::pipelineActions(PipelineScheduleKind::k1F1B, 1, 3, 4)) == "F0 F1 B0 F2 B1 F3 B2 B3");
  CHECK(ctorch::describeActions(ctorch::pipelineActions(PipelineScheduleKind::k1F1B, 2, 3, 4)) == "F0 B0 F1 B1 F2 B2 F3 B3");
  CHECK(ctorch::describeActions(ctorch::pipelineActions(PipelineScheduleKind::k1F1B, 0, 4, 2)) == "F0 F1 B0 B1");
  // Every schedule: each micro-batch forward once and backward once after it, backwards in order,
  // and 1F1B holds at most S - stage micro-batches in flight.
  for (const auto kind : {PipelineScheduleKind::kGPipe, PipelineScheduleKind::k1F1B})
    for (int S = 1; S <= 5; ++S)
      for (int M = 1; M <= 9; ++M)
        for (int s = 0; s < S; ++s) {
          const auto actions = ctorch::pipelineActions(kind, s, S, M);
          INFO(ctorch::toString(kind) << " S=" << S << " M=" << M << " stage " << s << ": " << ctorch::describeActions(actions));
          std::vector<int> forwarded(static_cast<std::size_t>(M), 0);
          int nextBackward = 0, inFlight = 0, most = 0;
          for (const auto& a : actions) {
            if (a.kind == ctorch::PipelineAction::Kind::kForward) {
              REQUIRE(forwarded[static_cast<std::size_t>(a.microBatch)]++ == 0);
              most = std::max(most, ++inFlight);
            } else {
              REQUIRE(a.microBatch == nextBackward++);
              REQUIRE(forwarded[static_cast<std::size_t>(a.microBatch)] == 1);
              --inFlight;
            }
          }
          CHECK(nextBackward == M);
          CHECK(most == (kind == PipelineScheduleKind::kGPipe ? M : std::min(S - s, M)));
        }
  CHECK(ctorch::parsePipelineSchedule("GPipe") == PipelineScheduleKind::kGPipe);
  CHECK_THROWS_WITH(ctorch::parsePipelineSchedule("zb"), "pipeline: unknown schedule 'zb' (gpipe or 1f1b)");
}

TEST_CASE("pipeline: one stage is gradient accumulation itself, with no process group", "[pipeline]") {
  auto model = makeModel(), ref = makeModel();
  ctorch::PipelineStage stage(ctorch::pipelineSplit(model, {9}, 0), 0, 1, ctorch::PipelineStageOptions().seed(kSeed));
  ctorch::Schedule1F1B schedule(stage, 4, lossFn);
  std::vector<torch::nn::Sequential> refStages{ref};
  auto [x, y] = batch(0, 8);
  torch::manual_seed(5);
  const at::Tensor before = torch::randn({4});
  torch::manual_seed(5);
  const auto losses = schedule.step(x, y);
  CHECK(paramsHex({torch::randn({4})}) == paramsHex({before}));  // the loop's random stream is left as it was
  const auto refLosses = referenceStep(refStages, x, y, 4, 0, 4.0);
  std::vector<at::Tensor> grads, refGrads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad());
  for (const auto& p : ref->parameters()) refGrads.push_back(p.grad());
  CHECK(paramsHex(grads) == paramsHex(refGrads));
  CHECK(paramsHex(losses) == paramsHex(refLosses));
  CHECK_THROWS_WITH(ctorch::ScheduleGPipe(stage, 0, lossFn), "pipeline: micro-batches must be at least 1, got 0");
  CHECK_THROWS_WITH(ctorch::ScheduleGPipe(stage, 2), "pipeline: the last stage needs a loss function");
  CHECK_THROWS_WITH(schedule.step(x.narrow(0, 0, 3), y.narrow(0, 0, 3)),
                    "pipeline stage 0: the input has 3 rows, fewer than the 4 micro-batches");
}

TEST_CASE("pipeline: 2 and 3 processes equal one process accumulating gradients, bit for bit (GPipe, 1F1B, M = 1 "
          "and 4, SGD and Adam, dropout)", "[pipeline][multiproc]") {
  for (const int S : {2, 3}) {
    auto results = runWorkerGroup({.worker = "pipeline_exact", .worldSize = S});
    requireAllOk(results);
    for (int rank = 0; rank < S; ++rank) {
      const auto& out = results[static_cast<std::size_t>(rank)].output;
      INFO("S=" << S << " rank " << rank << ":\n" << out);
      CHECK(out.find("DIFFER") == std::string::npos);
      // 2 schedules x 2 M x 2 optimizers x 3 steps of params, in-flight and shapes checks (+ losses on the last).
      std::size_t equal = 0;
      for (auto pos = out.find(" equal"); pos != std::string::npos; pos = out.find(" equal", pos + 1)) ++equal;
      CHECK(equal == 8 * 3 * (rank == S - 1 ? 4 : 3) + (rank == S - 1 ? 8 : 0));
    }
  }
}

TEST_CASE("pipeline x data parallel: 2 pipelines of 2 stages equal one process on the whole batch within 1e-6",
          "[pipeline][multiproc]") {
  // The bound: the same products, but the two replicas' gradients are summed by Gloo and divided after,
  // where the single process adds the scaled losses' gradients in turn: float32 rounding, a few ulps.
  auto results = runWorkerGroup({.worker = "pipeline_2d", .worldSize = 4});
  requireAllOk(results);
  for (int rank = 0; rank < 4; ++rank) {
    const auto& out = results[static_cast<std::size_t>(rank)].output;
    INFO("rank " << rank << ":\n" << out);
    CHECK_THAT(out, Catch::Contains("layout stage " + std::to_string(rank % 2) + " replica " + std::to_string(rank / 2) + " of 2"));
    const auto pos = out.find("max difference ");
    REQUIRE(pos != std::string::npos);
    const double difference = std::stod(out.substr(pos + 15));
    CHECK(difference < 1e-6);
  }
}

TEST_CASE("pipeline: a wrong group, too few rows and stages that disagree are refused in one line, and a lost "
          "neighbour is an error, not a hang", "[pipeline][multiproc]") {
  auto results = runWorkerGroup({.worker = "pipeline_refusals", .worldSize = 2, .timeout = std::chrono::seconds(60)});
  requireAllOk(results);
  const auto& first = results[0].output;
  const auto& second = results[1].output;
  INFO("rank 0:\n" << first << "\nrank 1:\n" << second);
  for (const auto* out : {&first, &second})
    CHECK_THAT(*out, Catch::Contains("refused: PipelineStage: stage " + std::string(out == &first ? "0" : "1") +
                                     " of 3 needs a pipeline group of 3 ranks"));
  CHECK_THAT(first, Catch::Contains("refused: pipeline stage 0: the input has 3 rows, fewer than the 4 micro-batches"));
  CHECK_THAT(second, Catch::Contains("refused: pipeline stage 1: stage 0 runs step 0 with 4 micro-batches, this stage step 0 with 2"));
  CHECK_THAT(first, Catch::Contains("distributed error: pipeline stage 0: "));
}

TEST_CASE("pipeline: a stage whose output shape changes while its input's did not is refused before it sends, "
          "and its neighbour gets an error", "[pipeline][multiproc]") {
  auto results = runWorkerGroup({.worker = "pipeline_shape_change", .worldSize = 2, .timeout = std::chrono::seconds(60)});
  requireAllOk(results);
  INFO("rank 0:\n" << results[0].output << "\nrank 1:\n" << results[1].output);
  for (const auto& r : results) CHECK_THAT(r.output, Catch::Contains("step 0 done"));
  CHECK_THAT(results[0].output, Catch::Contains("refused: pipeline stage 0: micro-batch 0's output is [4, 6] Float where the "
                                                "step before sent [4, 12] Float for the same input shapes"));
  CHECK_THAT(results[1].output, Catch::Contains("distributed error: pipeline stage 1: "));
}
