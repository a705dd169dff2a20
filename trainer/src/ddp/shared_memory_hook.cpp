// DistributedDataParallel's shared-memory communication hook (shared_memory_hook.hpp): each gradient
// bucket averaged in place through the segment, overlapped with the backward pass or all at its end.
#include "ddp/shared_memory_hook.hpp"

#include "ctorch/errors.hpp"

#include <exception>
#include <string>
#include <vector>

namespace ctorch::detail {

namespace {

class SharedMemoryHook : public c10d::CommHookInterface {
 public:
  SharedMemoryHook(std::shared_ptr<SharedMemoryAllreduce> allreduce, c10::intrusive_ptr<c10d::ProcessGroup> group,
                   bool afterBackward)
      : allreduce_(std::move(allreduce)), group_(std::move(group)), afterBackward_(afterBackward) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    // After backward: a step whose backward pass failed half-way left pending buckets; their
    // futures fail, and the first bucket of the next step starts afresh.
    if (afterBackward_ && bucket.getIndex() == 0) failPending("the backward pass that launched it did not finish");
    c10::intrusive_ptr<c10::ivalue::Future> done;
    if (buffer.is_sparse()) {
      buffer.div_(group_->getSize());
      std::vector<at::Tensor> tensors{buffer};
      done = group_->allreduce(tensors)->getFuture();
    } else if (!afterBackward_) {
      return allreduce_->allreduceAsync(buffer, SharedMemoryAllreduce::Op::kAverage);
    } else {
      done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
      pending_.push_back({buffer, done});
    }
    if (afterBackward_ && bucket.isLast()) reducePending();
    return done;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return result.isTensor() ? result.toTensor() : result.toTensorVector().at(0);
  }

 private:
  struct Pending {
    at::Tensor buffer;
    c10::intrusive_ptr<c10::ivalue::Future> done;
  };

  void reducePending() {
    auto pending = std::move(pending_);
    pending_.clear();
    std::exception_ptr error;
    for (auto& p : pending) {
      try {
        if (!error) allreduce_->allreduce(p.buffer, SharedMemoryAllreduce::Op::kAverage);
      } catch (...) {
        error = std::current_exception();
      }
      if (error) p.done->setError(error);
      else p.done->markCompleted(c10::IValue(p.buffer));
    }
  }

  void failPending(const std::string& why) {
    for (auto& p : pending_)
      p.done->setError(std::make_exception_ptr(DistributedError("shared-memory gradient bucket not reduced: " + why)));
    pending_.clear();
  }

  std::shared_ptr<SharedMemoryAllreduce> allreduce_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool afterBackward_;
  std::vector<Pending> pending_;
};

} // namespace

std::unique_ptr<c10d::CommHookInterface> makeSharedMemoryHook(std::shared_ptr<SharedMemoryAllreduce> allreduce,
                                                              c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                              bool afterBackward) {
  return std::make_unique<SharedMemoryHook>(std::move(allreduce), std::move(group), afterBackward);
}

} // namespace ctorch::detail
