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
#pragma once

#include "ctorch/errors.hpp"
#include "ctorch/snapshot.hpp"
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
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout);

 public:
  // Throws ConfigError naming the bad value (servers < 1, a timeout that is not positive).
  void validate() const;
};

enum class ParameterServerRole { kWorker, kServer };

// The role of `rank` in a group of `worldSize` ranks whose last `servers` serve. Throws ConfigError
// when the group leaves no worker (servers >= worldSize) or servers < 1.
ParameterServerRole parameterServerRole(int rank, int worldSize, int servers);

class ParameterServer {
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
  void step();
  // Tells every server this worker is done (after the last step; no call may follow).
  void finish();
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
  bool serveStep();
  // serveStep() until every worker finished.
  void serve();
  // This server's optimizer (null on a worker).
  torch::optim::Optimizer* localOptimizer() { return local_.get(); }
  // Completed optimizer steps (the same on every rank).
  std::int64_t steps() const { return steps_; }

  // This rank's shard of the optimizer state, in ZeroRedundancyOptimizer's shard layout (global
  // parameter indices); a worker's is empty. What a snapshot keeps per rank.
  ItemDict shardStateDict() const;
  // Restores this server's share from shards saved with any number of servers (ConfigError naming
  // what does not fit). Does nothing on a worker.
  void loadShardStateDicts(const std::vector<ItemDict>& shards);

 private:
  enum Command : std::int64_t { kPull = 1, kStep = 2, kFinish = 3 };
  void requireRole(ParameterServerRole role, const char* call) const;
  void broadcastFromRankZero(const char* why);
  void sendCommand(Command command);
  void receiveWeights();
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
};

} // namespace ctorch
