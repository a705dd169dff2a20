// Collectives for a loop's own values (metrics, early-stopping decisions, a seed to share) over the
// default group, as Python's torch.distributed.all_reduce / broadcast / all_gather / gather:
//
//   double correct = ...;                                   // this rank's count
//   correct = ctorch::allReduce(correct);                  // every rank's sum
//   auto losses = ctorch::allGather(loss.detach());        // one tensor per rank, in rank order
//   ctorch::broadcast(best, /*src=*/0);                     // rank 0's value everywhere
//
// Every call is a collective: each rank of the group calls it, in the same order. Without a process
// group (a world of 1, initProcessGroup not called) each is the identity. They always use the
// current default group, so they keep working after ResilientTraining::recover() replaced it; a
// failure (a peer lost, a timeout) is a ctorch::DistributedError (DistributedTimeout), which
// recover() handles like a failed step. Tensors may be CPU or CUDA ones, as the backend takes them
// (NCCL: CUDA; the scalar and vector overloads use the current CUDA device under NCCL).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ctorch {

enum class ReduceOp {
  kSum,
  kAvg,      // the sum divided by the world size (Gloo has no average: done here, in the tensor's dtype)
  kMin,
  kMax,
  kProduct,
};

// In place: `tensor` becomes the reduction over the ranks (same shape and dtype on every rank).
void allReduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
double allReduce(double value, ReduceOp op = ReduceOp::kSum);
// Several values in one collective (element-wise).
std::vector<double> allReduce(std::vector<double> values, ReduceOp op = ReduceOp::kSum);

// In place: `tensor` becomes rank `src`'s (same shape and dtype on every rank).
void broadcast(at::Tensor& tensor, int src = 0);
double broadcast(double value, int src = 0);

// Every rank's tensor (same shape and dtype on every rank), in rank order, on every rank.
std::vector<at::Tensor> allGather(const at::Tensor& tensor);
std::vector<double> allGather(double value);

// Every rank's tensor in rank order on rank `dst`; an empty vector on the others.
std::vector<at::Tensor> gather(const at::Tensor& tensor, int dst = 0);

} // namespace ctorch
