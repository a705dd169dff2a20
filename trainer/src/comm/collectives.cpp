// The loop's own collectives (collectives.hpp) over the current default group.
#include "ctorch/collectives.hpp"

#include "ctorch/distributed.hpp"
#include "ctorch/errors.hpp"
#include "core/exception_text.hpp"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <string>

namespace ctorch {

namespace {

bool grouped() { return isInitialized() && getWorldSize() > 1; }

c10d::ReduceOp c10dOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kSum:
    case ReduceOp::kAvg: break;
  }
  return c10d::ReduceOp::SUM;
}

// Where a scalar's tensor lives: the current CUDA device under NCCL, else the CPU.
torch::Device scalarDevice() {
  if (getBackendName() == "nccl")
    return {c10::DeviceType::CUDA, c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index()};
  return torch::kCPU;
}

void checkRank(const char* what, int rank) {
  const int world = isInitialized() ? getWorldSize() : 1;
  if (rank < 0 || rank >= world)
    throw ConfigError(std::string(what) + ": rank " + std::to_string(rank) + " is not in the group (world size " +
                      std::to_string(world) + ")");
}

// The backends work on dense tensors: `f` runs on `tensor` itself, or on a contiguous copy whose
// result is copied back (a transposed view, a slice).
template <typename F>
void onDense(at::Tensor& tensor, F&& f) {
  if (tensor.is_contiguous()) return f(tensor);
  at::Tensor dense = tensor.contiguous();
  f(dense);
  tensor.copy_(dense);
}

// Runs one collective; its failure becomes one DistributedError naming it.
template <typename F>
void run(const char* what, F&& f) {
  detail::failuresAsDistributed([&] { return f(*getDefaultGroup())->wait(); },
                                [&] { return "rank " + std::to_string(getRank()) + ": " + what; });
}

} // namespace

void allReduce(at::Tensor& tensor, ReduceOp op) {
  if (!tensor.defined()) throw ConfigError("ctorch::allReduce: the tensor is undefined");
  if (!grouped()) return;
  onDense(tensor, [&](at::Tensor& dense) {
    std::vector<at::Tensor> tensors{dense};
    c10d::AllreduceOptions options;
    options.reduceOp = c10dOp(op);
    run("allReduce", [&](c10d::ProcessGroup& g) { return g.allreduce(tensors, options); });
  });
  if (op == ReduceOp::kAvg) {
    if (tensor.is_floating_point() || tensor.is_complex()) tensor.div_(getWorldSize());
    else tensor.div_(getWorldSize(), "floor");
  }
}

std::vector<double> allReduce(std::vector<double> values, ReduceOp op) {
  if (!grouped() || values.empty()) return values;
  at::Tensor t = torch::tensor(values, torch::TensorOptions().dtype(torch::kFloat64)).to(scalarDevice());
  allReduce(t, op);
  t = t.cpu();
  const double* p = t.data_ptr<double>();
  return std::vector<double>(p, p + values.size());
}

double allReduce(double value, ReduceOp op) { return allReduce(std::vector<double>{value}, op)[0]; }

void broadcast(at::Tensor& tensor, int src) {
  if (!tensor.defined()) throw ConfigError("ctorch::broadcast: the tensor is undefined");
  checkRank("ctorch::broadcast", src);
  if (!grouped()) return;
  onDense(tensor, [&](at::Tensor& dense) {
    std::vector<at::Tensor> tensors{dense};
    c10d::BroadcastOptions options;
    options.rootRank = src;
    run("broadcast", [&](c10d::ProcessGroup& g) { return g.broadcast(tensors, options); });
  });
}

double broadcast(double value, int src) {
  checkRank("ctorch::broadcast", src);
  if (!grouped()) return value;
  at::Tensor t = torch::tensor({value}, torch::TensorOptions().dtype(torch::kFloat64)).to(scalarDevice());
  broadcast(t, src);
  return t.cpu().item<double>();
}

std::vector<at::Tensor> allGather(const at::Tensor& tensor) {
  if (!tensor.defined()) throw ConfigError("ctorch::allGather: the tensor is undefined");
  if (!grouped()) return {tensor.clone()};
  const at::Tensor input = tensor.contiguous();
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < getWorldSize(); ++r) outputs[0].push_back(torch::empty_like(input));
  std::vector<at::Tensor> inputs{input};
  run("allGather", [&](c10d::ProcessGroup& g) { return g.allgather(outputs, inputs); });
  return outputs[0];
}

std::vector<double> allGather(double value) {
  const auto parts = allGather(torch::tensor({value}, torch::TensorOptions().dtype(torch::kFloat64)).to(
      grouped() ? scalarDevice() : torch::Device(torch::kCPU)));
  std::vector<double> values;
  for (const auto& p : parts) values.push_back(p.cpu().item<double>());
  return values;
}

std::vector<at::Tensor> gather(const at::Tensor& tensor, int dst) {
  if (!tensor.defined()) throw ConfigError("ctorch::gather: the tensor is undefined");
  checkRank("ctorch::gather", dst);
  if (!grouped()) return {tensor.clone()};
  if (getBackendName() == "nccl") {  // NCCL has no gather of its own in every release: all-gather
    auto all = allGather(tensor);
    if (getRank() != dst) all.clear();
    return all;
  }
  const at::Tensor input = tensor.contiguous();
  std::vector<std::vector<at::Tensor>> outputs;
  if (getRank() == dst) {
    outputs.emplace_back();
    for (int r = 0; r < getWorldSize(); ++r) outputs[0].push_back(torch::empty_like(input));
  }
  std::vector<at::Tensor> inputs{input};
  c10d::GatherOptions options;
  options.rootRank = dst;
  run("gather", [&](c10d::ProcessGroup& g) { return g.gather(outputs, inputs, options); });
  return outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
}

} // namespace ctorch
