// Parameter-server training, the seeds' other way to keep data-parallel replicas in step: the last
// K ranks of the job serve (hold the weights and the optimizer, sharded by size), the others work
// (compute gradients on their batches). Synchronous, one optimizer step per round of four stages:
//
//   ctorch::ParameterServer ps(model->parameters(), [](std::vector<at::Tensor> share) {
//     return std::make_unique<torch::optim::Adam>(share, torch::optim::AdamOptions(1e-3));
//   }, ctorch::ParameterServerOptions().servers(1));
//   if (ps.isServer()) { ps.serve(); return 0; }     // until every worker called finish()
//   ps.pull();                                       // stage 1: the weights into the local replica
//   for (...) {
//     ps.zeroGrad();
//     torch::mse_loss(model(x), y).backward();       // stage 2: this worker's gradients
//     ps.step();                                     // stages 3, 4 and the next pull: push the
//   }                                                //   gradients; servers average, step, send back
//   ps.finish();
//
// Exact: with 2 workers the weights are bit-identical to DistributedDataParallel with the same
// optimizer on the same global batch (docs/parameter-server.md says what holds for more workers).
//
// Asynchronous mode (ParameterServerOptions().mode(kAsynchronous).staleness(s)): a server applies each
// worker's gradients as they arrive and answers that worker alone, so workers do not wait for each
// other - except that no worker is answered while it is more than s steps ahead of the slowest worker
// still training (stale synchronous parallel). A round ends when every worker called sync() and the
// servers' serveRound() returned: then every replica holds the same weights (snapshot there).
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/state_dict.hpp"
#include "ctorch/zero_redundancy_optimizer.hpp"

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace ctorch {

enum class ParameterServerMode {
  kSynchronous,   // the four stages in lockstep: every step averages every worker's gradients
  kAsynchronous,  // each worker's gradients applied on arrival, bounded by the staleness
};

struct ParameterServerOptions {
  // How many ranks serve: the LAST `servers` ranks of the group, at most one per parameter (a
  // parameter is never split). Rank 0 is always a worker, so the
  // main process holds the current model (after step()), logs, evaluates and writes snapshots.
  // Under ctorchrun the last ranks are on the last node: a user puts the servers on a node of their
  // own by giving it as many processes as servers.
  TORCH_ARG(int, servers) = 1;
  // The group every role is part of (default: the default process group).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, processGroup);
  // The bound of every send and receive. Unset: the group's own timeout (Gloo's), else 30 minutes.
  // In asynchronous mode a worker held back by the staleness bound waits within it too: it must
  // exceed the time the slowest worker needs for `staleness` steps.
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);
  TORCH_ARG(ParameterServerMode, mode) = ParameterServerMode::kSynchronous;
  // Asynchronous mode: how many steps a worker may be ahead of the slowest worker still training
  // before a server holds back its answer (0: nobody starts step k+1 before everyone pushed step k).
  TORCH_ARG(int, staleness) = 4;

 public:
  // Throws ConfigError naming the bad value (servers < 1, a timeout that is not positive, a negative
  // staleness).
  void validate() const;
};

// What a server saw in asynchronous mode (zeros in synchronous mode, where every gradient is fresh).
struct ParameterServerStats {
  std::int64_t updates = 0;        // optimizer steps: one per worker's step
  std::int64_t maxStaleness = 0;   // the most updates applied between a worker's pull and its push
  double meanStaleness = 0.0;
  std::int64_t heldAnswers = 0;    // answers held back by the staleness bound
};

enum class ParameterServerRole { kWorker, kServer };

// The role of `rank` in a group of `worldSize` ranks whose last `servers` serve. Throws ConfigError
// when the group leaves no worker (servers >= worldSize) or servers < 1.
ParameterServerRole parameterServerRole(int rank, int worldSize, int servers);

// A checkpoint sees it as a Stateful (parameter_server/parameter_server_state.cpp): the run's
// optimizer, the servers' shards of its state in their shard files (a worker's holds nothing),
// resharded over another number of servers on resume. It cannot follow a re-formed group.
class ParameterServer : public ShardedOptimizerState {
 public:
  // Builds a server's optimizer over its share of the parameters.
  using OptimizerFactory = ZeroRedundancyOptimizer::OptimizerFactory;

  // A collective: every rank (servers and workers) constructs it with the same model's parameters
  // (one dtype and device); rank 0's values are broadcast to all, as DistributedDataParallel does.
  // Parameters go to servers by size: ZeroRedundancyOptimizer's sorted-greedy packing
  // (partitionParameters) over the servers.
  ParameterServer(std::vector<at::Tensor> parameters, OptimizerFactory makeOptimizer,
                  ParameterServerOptions options = {});
  ~ParameterServer();
  ParameterServer(const ParameterServer&) = delete;
  ParameterServer& operator=(const ParameterServer&) = delete;

  ParameterServerRole role() const { return role_; }
  bool isServer() const { return role_ == ParameterServerRole::kServer; }
  bool isWorker() const { return role_ == ParameterServerRole::kWorker; }
  int numServers() const { return servers_; }
  int numWorkers() const { return workers_; }
  // A worker's index among the workers (its rank: workers are ranks 0 .. numWorkers()-1), the data
  // shard it reads; -1 on a server.
  int workerIndex() const { return isWorker() ? rank_ : -1; }
  // A server's index among the servers (0 .. numServers()-1); -1 on a worker.
  int serverIndex() const { return isServer() ? rank_ - workers_ : -1; }
  // The rank of the server that owns parameter `parameterIndex`.
  int serverRankOf(std::size_t parameterIndex) const { return workers_ + owners_.at(parameterIndex); }
  const std::vector<at::Tensor>& parameters() const { return parameters_; }

  // ---- a worker's calls (ConfigError on a server). Every worker makes the same calls in the same
  // order (synchronous mode); a server that sees two workers ask different things throws.
  // Stage 1: every server's share of the current weights into the local parameters.
  void pull();
  // Stages 3 and 4, then stage 1 of the next step: every server receives its share of this worker's
  // gradients (a parameter without a gradient counts as zeros), averages them over the workers once
  // all have arrived, runs its optimizer and sends the updated weights back; returns when the local
  // parameters hold them. Gradients are left as they are (zero them before the next backward).
  // Asynchronous mode: each server steps with this worker's gradients times 1/N at once and answers
  // with its weights as they are then (unless this worker is too far ahead: see staleness).
  void step();
  // The end of a round: returns when every worker called sync() (or finish()) and the local
  // parameters hold the servers' weights, the same on every worker. In synchronous mode a pull.
  void sync();
  // Tells every server this worker is done (after the last step; no call may follow).
  void finish();
  // Asynchronous mode: how many steps this worker was ahead of the slowest worker still training
  // when its last answer left the servers (the most over the servers; 0 in synchronous mode).
  std::int64_t aheadOfSlowest() const { return ahead_; }
  // Every parameter's gradient set to none (or zeroed, `setToNone` false), as Python's
  // optimizer.zero_grad() does: a worker has no optimizer of its own. Any rank.
  void zeroGrad(bool setToNone = true);

  // ---- every rank's call
  // A collective over the whole group: every rank's parameters become rank 0's (a worker's: the
  // current weights after step()), e.g. so that servers take part in an evaluation. Between steps.
  void syncReplicas();

  // ---- a server's calls (ConfigError on a worker).
  // Serves the workers' pulls until one optimizer step is done (true) or every worker finished
  // (false). A loop that snapshots calls it once per step, in step with the workers' step().
  // Synchronous mode only (ConfigError in asynchronous mode: serveRound()).
  bool serveStep();
  // Serves every request until every worker called sync() (true: a round ended, each worker has the
  // same weights) or finish() (false). Either mode.
  bool serveRound();
  // Until every worker finished.
  void serve();
  ParameterServerMode mode() const { return mode_; }
  // This server's record in asynchronous mode.
  const ParameterServerStats& stats() const { return stats_; }
  // This server's optimizer (null on a worker).
  torch::optim::Optimizer* localOptimizer() { return local_.get(); }
  // Completed optimizer steps (the same on every rank).
  std::int64_t steps() const { return steps_; }

  // This rank's shard of the optimizer state, in ZeroRedundancyOptimizer's shard layout (global
  // parameter indices); a worker's is empty. What a snapshot keeps per rank.
  ItemDict shardStateDict() const override;
  // Restores this server's share from shards saved with any number of servers (ConfigError naming
  // what does not fit). Does nothing on a worker.
  void loadShardStateDicts(const std::vector<ItemDict>& shards) override;

  // ---- Stateful
  std::string stateName() const override { return "ParameterServer"; }
  std::string whyNotInPlace() const override;

 private:
  enum Command : std::int64_t { kPull = 1, kStep = 2, kFinish = 3, kSync = 4 };
  enum class WorkerState { kTraining, kSynced, kFinished };
  void requireRole(ParameterServerRole role, const char* call) const;
  void broadcastFromRankZero(const char* why);
  void sendCommand(Command command);
  void receiveWeights();
  void receiveAnswers();
  void pushGradients();
  bool serveSynchronous(bool untilStep);
  bool serveAsync(bool untilSync);
  void applyGradient(const at::Tensor& flat);
  void answer(int worker);
  void releaseHeld();
  std::int64_t slowestClock() const;
  Command receiveCommands();
  void sendWeights();
  void aggregateAndStep();
  at::Tensor packShare(int server, bool gradients) const;

  std::vector<at::Tensor> parameters_;
  std::vector<int> owners_;                       // server index owning each parameter
  std::vector<std::vector<std::size_t>> shares_;  // per server: the indices of its parameters
  std::unique_ptr<torch::optim::Optimizer> local_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_{};
  ParameterServerRole role_ = ParameterServerRole::kWorker;
  int rank_ = 0;
  int servers_ = 1;
  int workers_ = 1;
  std::int64_t steps_ = 0;
  bool finished_ = false;
  ParameterServerMode mode_ = ParameterServerMode::kSynchronous;
  int staleness_ = 0;
  // Asynchronous mode. A worker's: the version (updates applied) of each server's share it holds, its
  // steps pushed, what the last answers said. A server's: its version, each worker's steps applied,
  // state, and whether its answer is held back.
  std::vector<std::int64_t> versions_;
  std::int64_t clock_ = 0;
  std::int64_t ahead_ = 0;
  std::int64_t version_ = 0;
  std::vector<std::int64_t> clocks_;
  std::vector<WorkerState> states_;
  std::vector<bool> held_;
  ParameterServerStats stats_;
  double stalenessSum_ = 0.0;
};

} // namespace ctorch
