// Synchronous parameter-server training over c10d point-to-point messages: the roles, the share of
// each server, and the four stages of a step (pull, compute, push, aggregate and update).
#include "ctorch/parameter_server.hpp"

#include "core/compat.hpp"
#include "ctorch/distributed.hpp"
#include "core/exception_text.hpp"
#include "zero/optimizer_shard.hpp"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <string>

namespace ctorch {

namespace {

// Message channels between one worker and one server (Gloo matches a receive by peer and tag).
constexpr int kCommandTag = 0;   // worker -> server: one int64, what the worker asks
constexpr int kWeightsTag = 1;   // server -> worker: the server's share of the weights, flat
constexpr int kGradientTag = 2;  // worker -> server: the worker's gradients of that share, flat
constexpr int kInfoTag = 3;      // server -> worker (asynchronous mode): the share's version, how far ahead

// Every message is a CPU tensor, whatever the parameters' device: Gloo's send and recv read and write
// host memory only (a CUDA tensor's pointer would be taken for a host address). CUDA parameters and
// gradients are packed on their device and copied over; what arrives is copied to the device before
// any arithmetic, which runs where DDP's would.
at::Tensor onHost(const at::Tensor& t) { return t.to(at::kCPU); }
at::TensorOptions hostOptions(const at::Tensor& like) { return like.options().device(at::kCPU); }

const char* commandName(std::int64_t command) {
  switch (command) {
    case 1: return "pull";
    case 2: return "step";
    case 3: return "finish";
    case 4: return "sync";
    default: return "an unknown command";
  }
}

} // namespace

void ParameterServerOptions::validate() const {
  if (servers_ < 1)
    throw ConfigError("ParameterServerOptions::servers must be >= 1, got " + std::to_string(servers_));
  if (timeout_ && timeout_->count() <= 0)
    throw ConfigError("ParameterServerOptions::timeout must be positive, got " + std::to_string(timeout_->count()) + " ms");
  if (staleness_ < 0) throw ConfigError("ParameterServerOptions::staleness must be >= 0, got " + std::to_string(staleness_));
}

ParameterServerRole parameterServerRole(int rank, int worldSize, int servers) {
  if (servers < 1) throw ConfigError("parameter server: the number of servers must be >= 1, got " + std::to_string(servers));
  if (servers >= worldSize)
    throw ConfigError("parameter server: " + std::to_string(servers) + " server(s) in a world of " + std::to_string(worldSize) +
                      " leave no worker (the last ranks serve; start at least servers + 1 processes)");
  if (rank < 0 || rank >= worldSize)
    throw ConfigError("parameter server: rank " + std::to_string(rank) + " is outside a world of " + std::to_string(worldSize));
  return rank >= worldSize - servers ? ParameterServerRole::kServer : ParameterServerRole::kWorker;
}

ParameterServer::ParameterServer(std::vector<at::Tensor> parameters, OptimizerFactory makeOptimizer,
                                 ParameterServerOptions options)
    : parameters_(std::move(parameters)) {
  options.validate();
  if (!makeOptimizer) throw ConfigError("ParameterServer: no optimizer factory");
  if (parameters_.empty()) throw ConfigError("ParameterServer: no parameters");
  group_ = options.processGroup() ? options.processGroup() : getDefaultGroup();
  timeout_ = options.timeout().value_or(compat::glooTimeout(group_).value_or(std::chrono::minutes(30)));
  rank_ = group_->getRank();
  servers_ = options.servers();
  role_ = parameterServerRole(rank_, group_->getSize(), servers_);
  workers_ = group_->getSize() - servers_;
  mode_ = options.mode();
  staleness_ = options.staleness();
  versions_.assign(static_cast<std::size_t>(servers_), 0);
  clocks_.assign(static_cast<std::size_t>(workers_), 0);
  states_.assign(static_cast<std::size_t>(workers_), WorkerState::kTraining);
  held_.assign(static_cast<std::size_t>(workers_), false);
  owners_ = partitionParameters(detail::flatShareNumels(parameters_, "ParameterServer"), servers_);
  shares_ = detail::sharesOf(owners_, servers_);
  // A server owning nothing would have nothing to serve and fall out of step with a loop that calls
  // serveStep() once per step: whole parameters are never split, so there are at most as many servers.
  if (static_cast<std::size_t>(servers_) > parameters_.size())
    throw ConfigError("ParameterServer: " + std::to_string(servers_) + " servers for " + std::to_string(parameters_.size()) +
                      " parameters (a parameter is never split): use at most " + std::to_string(parameters_.size()) + " servers");

  // Every rank starts from rank 0's weights (DDP's rule), so replicas built with different seeds agree.
  broadcastFromRankZero("the initial weights");
  if (isServer()) {
    std::vector<at::Tensor> mine;
    for (std::size_t i : shares_[static_cast<std::size_t>(serverIndex())]) mine.push_back(parameters_[i]);
    local_ = makeOptimizer(mine);
    if (!local_) throw ConfigError("ParameterServer: the optimizer factory returned no optimizer");
  }
}

ParameterServer::~ParameterServer() = default;

void ParameterServer::syncReplicas() { broadcastFromRankZero("syncReplicas"); }

void ParameterServer::broadcastFromRankZero(const char* why) {
  torch::NoGradGuard noGrad;
  std::vector<at::Tensor> views;
  for (const auto& p : parameters_) views.push_back(p.detach().reshape({-1}));
  std::vector<at::Tensor> flat{torch::cat(views)};
  try {
    group_->broadcast(flat)->wait(timeout_);
  } catch (const std::exception& e) {
    const std::string message = detail::messageOf(e);
    detail::throwDistributed("rank " + std::to_string(rank_) + ": ParameterServer's broadcast of rank 0's weights (" + why + ") failed: " + message,
                             message);
  }
  std::int64_t offset = 0;
  for (auto& p : parameters_) {
    p.detach().copy_(flat[0].narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

void ParameterServer::requireRole(ParameterServerRole role, const char* call) const {
  if (role_ == role) return;
  throw ConfigError(std::string("ParameterServer::") + call + " is a " + (role == ParameterServerRole::kServer ? "server" : "worker") +
                    "'s call; rank " + std::to_string(rank_) + " is a " + (isServer() ? "server" : "worker"));
}

namespace {

// Waits for every message of one stage, each bounded by the group's timeout; a failure names the peer.
void waitAll(std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>>& works, std::chrono::milliseconds timeout,
             int rank, const char* what) {
  for (auto& [peer, work] : works) {
    try {
      work->wait(timeout);
    } catch (const std::exception& e) {
      const std::string message = detail::messageOf(e);
      detail::throwDistributed("rank " + std::to_string(rank) + ": parameter server: " + what + " rank " + std::to_string(peer) +
                                   " failed: " + message,
                               message);
    }
  }
  works.clear();
}

// Posts one message to or from `peer` (a send or a receive): Gloo throws at once when the peer's
// connection is closed already (it exited), which fails like a wait: DistributedError naming the peer.
template <class Post>
c10::intrusive_ptr<c10d::Work> posted(int rank, int peer, const char* what, Post&& post) {
  try {
    return post();
  } catch (const std::exception& e) {
    const std::string message = detail::messageOf(e);
    detail::throwDistributed("rank " + std::to_string(rank) + ": parameter server: " + what + " rank " + std::to_string(peer) +
                                 " failed: " + message,
                             message);
  }
}

} // namespace

at::Tensor ParameterServer::packShare(int server, bool gradients) const {
  std::vector<at::Tensor> views;
  for (std::size_t i : shares_[static_cast<std::size_t>(server)]) {
    const auto& p = parameters_[i];
    if (!gradients) views.push_back(p.detach().reshape({-1}));
    else if (p.grad().defined()) views.push_back(p.grad().detach().reshape({-1}).to(p.scalar_type()));
    else views.push_back(at::zeros({p.numel()}, p.options()));
  }
  return torch::cat(views);
}

void ParameterServer::sendCommand(Command command) {
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  std::vector<std::vector<at::Tensor>> messages;
  messages.reserve(static_cast<std::size_t>(servers_));
  for (int s = 0; s < servers_; ++s) {
    // What is asked; this worker's steps pushed; the version of the server's share it holds.
    messages.push_back({at::tensor(std::vector<std::int64_t>{command, clock_, versions_[static_cast<std::size_t>(s)]}, at::kLong)});
    works.emplace_back(workers_ + s, posted(rank_, workers_ + s, "sending a command to",
                                    [&] { return group_->send(messages.back(), workers_ + s, kCommandTag); }));
  }
  waitAll(works, timeout_, rank_, "sending a command to");
}

void ParameterServer::receiveWeights() {
  torch::NoGradGuard noGrad;
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  std::vector<std::vector<at::Tensor>> buffers(static_cast<std::size_t>(servers_));
  for (int s = 0; s < servers_; ++s) {
    const auto& share = shares_[static_cast<std::size_t>(s)];
    std::int64_t numel = 0;
    for (std::size_t i : share) numel += parameters_[i].numel();
    buffers[static_cast<std::size_t>(s)] = {at::empty({numel}, hostOptions(parameters_[share.front()]))};
    works.emplace_back(workers_ + s, posted(rank_, workers_ + s, "receiving weights from",
                                    [&] { return group_->recv(buffers[static_cast<std::size_t>(s)], workers_ + s, kWeightsTag); }));
  }
  waitAll(works, timeout_, rank_, "receiving weights from");
  for (int s = 0; s < servers_; ++s) {
    std::int64_t offset = 0;
    for (std::size_t i : shares_[static_cast<std::size_t>(s)]) {
      auto& p = parameters_[i];
      p.detach().copy_(buffers[static_cast<std::size_t>(s)][0].narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

void ParameterServer::receiveAnswers() {
  torch::NoGradGuard noGrad;
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  std::vector<std::vector<at::Tensor>> infos(static_cast<std::size_t>(servers_));
  for (int s = 0; s < servers_; ++s) {
    infos[static_cast<std::size_t>(s)] = {at::zeros({2}, at::kLong)};
    works.emplace_back(workers_ + s, posted(rank_, workers_ + s, "waiting for the answer of",
                                    [&] { return group_->recv(infos[static_cast<std::size_t>(s)], workers_ + s, kInfoTag); }));
  }
  waitAll(works, timeout_, rank_, "waiting for the answer of");
  receiveWeights();
  ahead_ = 0;
  for (int s = 0; s < servers_; ++s) {
    const auto& info = infos[static_cast<std::size_t>(s)][0];
    versions_[static_cast<std::size_t>(s)] = info[0].item<std::int64_t>();
    ahead_ = std::max(ahead_, info[1].item<std::int64_t>());
  }
}

void ParameterServer::pushGradients() {
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  std::vector<std::vector<at::Tensor>> messages;
  messages.reserve(static_cast<std::size_t>(servers_));
  for (int s = 0; s < servers_; ++s) {
    messages.push_back({onHost(packShare(s, /*gradients=*/true))});
    works.emplace_back(workers_ + s, posted(rank_, workers_ + s, "pushing gradients to",
                                    [&] { return group_->send(messages.back(), workers_ + s, kGradientTag); }));
  }
  waitAll(works, timeout_, rank_, "pushing gradients to");
}

void ParameterServer::pull() {
  requireRole(ParameterServerRole::kWorker, "pull");
  if (finished_) throw ConfigError("ParameterServer::pull after finish()");
  sendCommand(kPull);
  if (mode_ == ParameterServerMode::kAsynchronous) receiveAnswers();
  else receiveWeights();
}

void ParameterServer::step() {
  requireRole(ParameterServerRole::kWorker, "step");
  if (finished_) throw ConfigError("ParameterServer::step after finish()");
  if (mode_ == ParameterServerMode::kAsynchronous) {
    ++clock_;
    sendCommand(kStep);
    pushGradients();
    receiveAnswers();
  } else {
    sendCommand(kStep);
    pushGradients();
    receiveWeights();
  }
  ++steps_;
}

void ParameterServer::sync() {
  requireRole(ParameterServerRole::kWorker, "sync");
  if (finished_) throw ConfigError("ParameterServer::sync after finish()");
  sendCommand(kSync);
  if (mode_ == ParameterServerMode::kAsynchronous) receiveAnswers();
  else receiveWeights();
}

void ParameterServer::zeroGrad(bool setToNone) { compat::zeroGrad(parameters_, setToNone); }

void ParameterServer::finish() {
  requireRole(ParameterServerRole::kWorker, "finish");
  if (finished_) return;
  sendCommand(kFinish);
  finished_ = true;
}

ParameterServer::Command ParameterServer::receiveCommands() {
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  std::vector<std::vector<at::Tensor>> commands(static_cast<std::size_t>(workers_));
  for (int w = 0; w < workers_; ++w) {
    commands[static_cast<std::size_t>(w)] = {at::zeros({3}, at::kLong)};
    works.emplace_back(w, posted(rank_, w, "waiting for a command from",
                                    [&] { return group_->recv(commands[static_cast<std::size_t>(w)], w, kCommandTag); }));
  }
  waitAll(works, timeout_, rank_, "waiting for a command from");
  const std::int64_t first = commands[0][0][0].item<std::int64_t>();
  for (int w = 1; w < workers_; ++w) {
    const std::int64_t other = commands[static_cast<std::size_t>(w)][0][0].item<std::int64_t>();
    if (other != first)
      throw DistributedError("rank " + std::to_string(rank_) + ": parameter server: worker 0 asked '" + commandName(first) +
                             "' while worker " + std::to_string(w) + " asked '" + commandName(other) +
                             "' (synchronous mode: every worker makes the same calls in the same order)");
  }
  if (first < kPull || first > kSync)
    throw DistributedError("rank " + std::to_string(rank_) + ": parameter server: unknown command " + std::to_string(first));
  return static_cast<Command>(first);
}

void ParameterServer::sendWeights() {
  std::vector<at::Tensor> flat{onHost(packShare(serverIndex(), /*gradients=*/false))};
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  for (int w = 0; w < workers_; ++w)
    works.emplace_back(w, posted(rank_, w, "sending weights to", [&] { return group_->send(flat, w, kWeightsTag); }));
  waitAll(works, timeout_, rank_, "sending weights to");
}

void ParameterServer::aggregateAndStep() {
  const auto& share = shares_[static_cast<std::size_t>(serverIndex())];
  std::int64_t numel = 0;
  for (std::size_t i : share) numel += parameters_[i].numel();
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  std::vector<std::vector<at::Tensor>> gradients(static_cast<std::size_t>(workers_));
  for (int w = 0; w < workers_; ++w) {
    gradients[static_cast<std::size_t>(w)] = {at::empty({numel}, hostOptions(parameters_[share.front()]))};
    works.emplace_back(w, posted(rank_, w, "receiving gradients from",
                                    [&] { return group_->recv(gradients[static_cast<std::size_t>(w)], w, kGradientTag); }));
  }
  waitAll(works, timeout_, rank_, "receiving gradients from");
  // DDP's average, operation for operation: c10d's Reducer multiplies each rank's gradient by
  // 1 / world size as it copies it into the bucket, then the allreduce sums. Here the sum runs in
  // worker-rank order; with 2 workers that is every order there is, so the result is DDP's bits.
  torch::NoGradGuard noGrad;
  const double scale = 1.0 / static_cast<double>(workers_);
  const auto device = parameters_[share.front()].device();
  at::Tensor average = gradients[0][0].to(device).mul(scale);
  for (int w = 1; w < workers_; ++w) average.add_(gradients[static_cast<std::size_t>(w)][0].to(device).mul(scale));
  applyGradient(average);
}

void ParameterServer::applyGradient(const at::Tensor& flat) {
  std::int64_t offset = 0;
  for (std::size_t i : shares_[static_cast<std::size_t>(serverIndex())]) {
    auto& p = parameters_[i];
    p.mutable_grad() = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
  }
  local_->step();
  for (std::size_t i : shares_[static_cast<std::size_t>(serverIndex())]) parameters_[i].mutable_grad().reset();
}

bool ParameterServer::serveStep() {
  requireRole(ParameterServerRole::kServer, "serveStep");
  if (mode_ == ParameterServerMode::kAsynchronous)
    throw ConfigError("ParameterServer::serveStep is synchronous mode's: in asynchronous mode workers do not step together "
                      "(serve a round with serveRound(), or serve())");
  if (finished_) return false;
  return serveSynchronous(/*untilStep=*/true);
}

bool ParameterServer::serveSynchronous(bool untilStep) {
  for (;;) {
    switch (receiveCommands()) {
      case kPull:
        sendWeights();
        break;
      case kSync:
        sendWeights();
        if (!untilStep) return true;
        break;
      case kStep:
        aggregateAndStep();
        sendWeights();
        ++steps_;
        if (untilStep) return true;
        break;
      case kFinish:
        finished_ = true;
        return false;
    }
  }
}

bool ParameterServer::serveRound() {
  requireRole(ParameterServerRole::kServer, "serveRound");
  if (finished_) return false;
  if (mode_ == ParameterServerMode::kAsynchronous) return serveAsync(/*untilSync=*/true);
  return serveSynchronous(/*untilStep=*/false);
}

void ParameterServer::serve() {
  requireRole(ParameterServerRole::kServer, "serve");
  if (mode_ == ParameterServerMode::kAsynchronous) {
    while (!finished_) serveAsync(/*untilSync=*/false);
    return;
  }
  while (serveStep()) {
  }
}

// ---- asynchronous mode, a server's side ---------------------------------------------------------

std::int64_t ParameterServer::slowestClock() const {
  std::int64_t slowest = std::numeric_limits<std::int64_t>::max();
  for (int w = 0; w < workers_; ++w)
    if (states_[static_cast<std::size_t>(w)] == WorkerState::kTraining) slowest = std::min(slowest, clocks_[static_cast<std::size_t>(w)]);
  return slowest;
}

// The share as it is now and the two numbers that go with it, to one worker.
void ParameterServer::answer(int worker) {
  const std::int64_t slowest = slowestClock();
  const std::int64_t clock = clocks_[static_cast<std::size_t>(worker)];
  std::vector<at::Tensor> info{at::tensor(std::vector<std::int64_t>{version_, slowest == std::numeric_limits<std::int64_t>::max() ? 0 : std::max<std::int64_t>(0, clock - slowest)}, at::kLong)};
  std::vector<at::Tensor> flat{onHost(packShare(serverIndex(), /*gradients=*/false))};
  std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
  works.emplace_back(worker, posted(rank_, worker, "answering", [&] { return group_->send(info, worker, kInfoTag); }));
  works.emplace_back(worker, posted(rank_, worker, "answering",
                                  [&] { return group_->send(flat, worker, kWeightsTag); }));
  waitAll(works, timeout_, rank_, "answering");
}

// Answers the held workers the slowest one has come close enough to (or that nobody trains behind).
void ParameterServer::releaseHeld() {
  const std::int64_t slowest = slowestClock();
  for (int w = 0; w < workers_; ++w) {
    if (!held_[static_cast<std::size_t>(w)]) continue;
    if (slowest != std::numeric_limits<std::int64_t>::max() && clocks_[static_cast<std::size_t>(w)] - slowest > staleness_) continue;
    held_[static_cast<std::size_t>(w)] = false;
    answer(w);
  }
}

bool ParameterServer::serveAsync(bool untilSync) {
  torch::NoGradGuard noGrad;
  const auto& share = shares_[static_cast<std::size_t>(serverIndex())];
  std::int64_t numel = 0;
  for (std::size_t i : share) numel += parameters_[i].numel();
  for (;;) {
    bool training = false, synced = false;
    for (const auto state : states_) {
      training = training || state == WorkerState::kTraining;
      synced = synced || state == WorkerState::kSynced;
    }
    if (!training) {
      if (!synced) {
        finished_ = true;
        return false;
      }
      // A round ends: every worker that asked for it gets the same weights (no update in between).
      for (int w = 0; w < workers_; ++w)
        if (states_[static_cast<std::size_t>(w)] == WorkerState::kSynced) {
          states_[static_cast<std::size_t>(w)] = WorkerState::kTraining;
          answer(w);
        }
      if (untilSync) return true;
      continue;
    }
    std::vector<at::Tensor> command{at::zeros({3}, at::kLong)};
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = group_->recvAnysource(command, kCommandTag);
      work->wait(timeout_);
    } catch (const std::exception& e) {
      std::string waiting;
      for (int w = 0; w < workers_; ++w)
        if (states_[static_cast<std::size_t>(w)] == WorkerState::kTraining && !held_[static_cast<std::size_t>(w)])
          waiting += (waiting.empty() ? "" : ", ") + std::to_string(w);
      const std::string message = detail::messageOf(e);
      detail::throwDistributed("rank " + std::to_string(rank_) + ": parameter server: waiting for a command from any of rank(s) " +
                                   waiting + " failed: " + message,
                               message);
    }
    const int w = work->sourceRank();
    if (w < 0 || w >= workers_)
      throw DistributedError("rank " + std::to_string(rank_) + ": parameter server: a command from rank " + std::to_string(w) +
                             ", which is not a worker");
    const std::int64_t what = command[0][0].item<std::int64_t>();
    switch (what) {
      case kPull:
        answer(w);
        break;
      case kStep: {
        std::vector<at::Tensor> gradient{at::empty({numel}, hostOptions(parameters_[share.front()]))};
        std::vector<std::pair<int, c10::intrusive_ptr<c10d::Work>>> works;
        works.emplace_back(w, posted(rank_, w, "receiving gradients from",
                                        [&] { return group_->recv(gradient, w, kGradientTag); }));
        waitAll(works, timeout_, rank_, "receiving gradients from");
        // This worker's gradients weigh 1/N, as each does in the synchronous average.
        applyGradient(gradient[0].to(parameters_[share.front()].device()).mul(1.0 / static_cast<double>(workers_)));
        const std::int64_t staleness = std::max<std::int64_t>(0, version_ - command[0][2].item<std::int64_t>());
        ++version_;
        ++steps_;
        ++clocks_[static_cast<std::size_t>(w)];
        ++stats_.updates;
        stats_.maxStaleness = std::max(stats_.maxStaleness, staleness);
        stalenessSum_ += static_cast<double>(staleness);
        stats_.meanStaleness = stalenessSum_ / static_cast<double>(stats_.updates);
        if (clocks_[static_cast<std::size_t>(w)] - slowestClock() > staleness_) {
          held_[static_cast<std::size_t>(w)] = true;
          ++stats_.heldAnswers;
        } else {
          answer(w);
        }
        releaseHeld();
        break;
      }
      case kSync:
        states_[static_cast<std::size_t>(w)] = WorkerState::kSynced;
        releaseHeld();
        break;
      case kFinish:
        states_[static_cast<std::size_t>(w)] = WorkerState::kFinished;
        releaseHeld();
        break;
      default:
        throw DistributedError("rank " + std::to_string(rank_) + ": parameter server: unknown command " + std::to_string(what) +
                               " from rank " + std::to_string(w));
    }
  }
}

ItemDict ParameterServer::shardStateDict() const {
  return detail::optimizerShard(local_.get(), parameters_, group_->getSize(), rank_, "ParameterServer");
}

void ParameterServer::loadShardStateDicts(const std::vector<ItemDict>& shards) {
  detail::loadOptimizerShards(local_.get(), parameters_, shards, "ParameterServer");
}

} // namespace ctorch
