// ResilientTraining's collectives with their one failure path: a collective that fails becomes one
// DistributedError naming the rank and the moment (the catch ladder lives here once).
#include "resilience/rank_agreement.hpp"

#include "core/exception_text.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstring>

namespace ctorch::detail {
namespace {

// One rank's generator states as one byte tensor: [count][len, bytes]... (CPU first, then CUDA).
at::Tensor packRng(const RngState& s) {
  std::vector<at::Tensor> parts{s.cpu};
  parts.insert(parts.end(), s.cuda.begin(), s.cuda.end());
  std::vector<std::uint8_t> bytes;
  auto put = [&](std::int64_t v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof v);
  };
  put(static_cast<std::int64_t>(parts.size()));
  for (const auto& t : parts) {
    const auto c = t.contiguous().to(torch::kCPU);
    put(c.numel());
    const auto* d = c.data_ptr<std::uint8_t>();
    bytes.insert(bytes.end(), d, d + c.numel());
  }
  return torch::from_blob(bytes.data(), {static_cast<std::int64_t>(bytes.size())}, torch::kUInt8).clone();
}

RngState unpackRng(const at::Tensor& packed) {
  const auto c = packed.contiguous().to(torch::kCPU);
  const auto* d = c.data_ptr<std::uint8_t>();
  const std::int64_t size = c.numel();
  std::int64_t at = 0;
  auto get = [&]() {
    std::int64_t v = 0;
    if (at + static_cast<std::int64_t>(sizeof v) > size) throw DistributedError("a rank sent a malformed generator state");
    std::memcpy(&v, d + at, sizeof v);
    at += sizeof v;
    return v;
  };
  RngState s;
  const std::int64_t count = get();
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t n = get();
    if (n < 0 || at + n > size) throw DistributedError("a rank sent a malformed generator state");
    auto t = torch::empty({n}, torch::kUInt8);
    std::memcpy(t.data_ptr<std::uint8_t>(), d + at, static_cast<size_t>(n));
    at += n;
    if (i == 0) s.cpu = t;
    else s.cuda.push_back(t);
  }
  return s;
}

}  // namespace

RankAgreement::RankAgreement(c10::intrusive_ptr<c10d::ProcessGroup> group, bool nccl)
    : group_(std::move(group)), rank_(group_->getRank()), world_(group_->getSize()), nccl_(nccl) {}

torch::Device RankAgreement::device() const {
  if (!nccl_) return torch::kCPU;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
}

void RankAgreement::fail(const std::exception& e, const std::string& during) const {
  const std::string message = messageOf(e);
  throwDistributed("rank " + std::to_string(rank_) + ": " + during + " failed: " + message, message);
}

template <typename F>
auto RankAgreement::guarded(const std::string& during, F&& body) {
  try {
    return body();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(e, during);
  }
}

RankAgreement::Reduction RankAgreement::start(const std::vector<double>& values, c10d::ReduceOp op, std::string during) {
  return guarded(during, [&] {
    std::vector<at::Tensor> t{torch::tensor(values, torch::kFloat64).to(device())};
    c10d::AllreduceOptions options;
    options.reduceOp = op;
    auto work = group_->allreduce(t, options);
    return Reduction{std::move(work), t[0], during};
  });
}

std::vector<double> RankAgreement::finish(Reduction& r) {
  return guarded(r.during, [&] {
    r.work->wait();
    const auto cpu = r.values.cpu();
    return std::vector<double>(cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel());
  });
}

std::vector<double> RankAgreement::allReduce(std::vector<double> values, c10d::ReduceOp op, const std::string& during) {
  if (world_ == 1) return values;
  Reduction r = start(values, op, during);
  return finish(r);
}

void RankAgreement::startPending(const std::vector<double>& values, c10d::ReduceOp op, std::string during) {
  pending_ = start(values, op, std::move(during));
}

std::optional<std::vector<double>> RankAgreement::finishPending() {
  if (!pending_) return std::nullopt;
  Reduction r = std::move(*pending_);
  pending_.reset();
  return finish(r);
}

std::vector<RngState> RankAgreement::gatherRng() {
  const at::Tensor mine = packRng(captureRngState());
  if (world_ == 1) return {unpackRng(mine)};
  const std::string during = "gathering generator states";
  const auto longest =
      static_cast<std::int64_t>(allReduce({static_cast<double>(mine.numel())}, c10d::ReduceOp::MAX, during)[0]);
  return guarded(during, [&] {
    auto padded = torch::zeros({longest}, torch::kUInt8);
    padded.narrow(0, 0, mine.numel()).copy_(mine);
    std::vector<at::Tensor> input{padded.to(device())};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < world_; ++r) output[0].push_back(torch::empty_like(input[0]));
    group_->allgather(output, input)->wait();
    std::vector<RngState> states;
    for (const auto& t : output[0]) states.push_back(unpackRng(t));
    return states;
  });
}

std::int64_t RankAgreement::maxOf(std::int64_t value, const std::string& during) {
  return guarded(during, [&] {
    std::vector<at::Tensor> t{torch::tensor({value}, torch::kInt64).to(device())};
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    group_->allreduce(t, max)->wait();
    return t[0].cpu().item<std::int64_t>();
  });
}

std::vector<char> RankAgreement::broadcast(std::vector<char> bytes, int root, const std::string& during) {
  return guarded(during, [&] {
    std::vector<at::Tensor> size{torch::tensor({static_cast<std::int64_t>(bytes.size())}, torch::kInt64).to(device())};
    c10d::BroadcastOptions from;
    from.rootRank = root;
    group_->broadcast(size, from)->wait();
    const std::int64_t n = size[0].cpu().item<std::int64_t>();
    if (n <= 0) throw DistributedError("rank " + std::to_string(root) + " sent an empty training state");
    auto payload = rank_ == root ? torch::from_blob(bytes.data(), {n}, torch::kUInt8).clone()
                                 : torch::empty({n}, torch::kUInt8);
    std::vector<at::Tensor> data{payload.to(device())};
    group_->broadcast(data, from)->wait();
    if (rank_ != root) {
      const auto cpu = data[0].cpu().contiguous();
      bytes.assign(reinterpret_cast<const char*>(cpu.data_ptr<std::uint8_t>()),
                   reinterpret_cast<const char*>(cpu.data_ptr<std::uint8_t>()) + n);
    }
    return std::move(bytes);
  });
}

namespace {
// Gloo keeps point-to-point messages apart from collectives (their own slots); the tags keep a
// payload's size apart from the payload.
constexpr int kSizeTag = 0x5c0, kPayloadTag = 0x5c1;

void checkSize(std::int64_t n, std::int64_t limit, int from, const std::string& during) {
  if (n <= 0 || n > limit)
    throw DistributedError(during + ": rank " + std::to_string(from) + " announced " + std::to_string(n) +
                           " bytes (expected 1 to " + std::to_string(limit) + ")");
}
}  // namespace

at::Tensor RankAgreement::passToNext(const std::vector<char>& mine, std::int64_t limit, const std::string& during) {
  const auto n = static_cast<std::int64_t>(mine.size());
  auto out = torch::from_blob(const_cast<char*>(mine.data()), {n}, torch::kUInt8);
  if (world_ == 1) return out.clone();
  const int next = (rank_ + 1) % world_, prev = (rank_ + world_ - 1) % world_;
  return guarded(during, [&] {
    std::vector<at::Tensor> sizeOut{torch::tensor({n}, torch::kInt64).to(device())};
    std::vector<at::Tensor> sizeIn{torch::zeros({1}, torch::kInt64).to(device())};
    auto sent = group_->send(sizeOut, next, kSizeTag);
    auto got = group_->recv(sizeIn, prev, kSizeTag);
    sent->wait();
    got->wait();
    const std::int64_t m = sizeIn[0].cpu().item<std::int64_t>();
    checkSize(m, limit, prev, during);
    std::vector<at::Tensor> payloadOut{out.to(device())};
    std::vector<at::Tensor> payloadIn{torch::empty({m}, torch::TensorOptions(torch::kUInt8).device(device()))};
    sent = group_->send(payloadOut, next, kPayloadTag);
    got = group_->recv(payloadIn, prev, kPayloadTag);
    sent->wait();
    got->wait();
    return payloadIn[0].cpu();
  });
}

void RankAgreement::sendTo(const at::Tensor& bytes, int to, const std::string& during) {
  guarded(during, [&] {
    std::vector<at::Tensor> size{torch::tensor({bytes.numel()}, torch::kInt64).to(device())};
    group_->send(size, to, kSizeTag)->wait();
    std::vector<at::Tensor> payload{bytes.contiguous().to(device())};
    group_->send(payload, to, kPayloadTag)->wait();
  });
}

at::Tensor RankAgreement::receiveFrom(int from, std::int64_t limit, const std::string& during) {
  return guarded(during, [&] {
    std::vector<at::Tensor> size{torch::zeros({1}, torch::kInt64).to(device())};
    group_->recv(size, from, kSizeTag)->wait();
    const std::int64_t n = size[0].cpu().item<std::int64_t>();
    checkSize(n, limit, from, during);
    std::vector<at::Tensor> payload{torch::empty({n}, torch::TensorOptions(torch::kUInt8).device(device()))};
    group_->recv(payload, from, kPayloadTag)->wait();
    return payload[0].cpu();
  });
}

} // namespace ctorch::detail
