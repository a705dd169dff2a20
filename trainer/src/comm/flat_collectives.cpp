// Ring reduce-scatter and all-gather of flat tensors over a process group's send/recv
// (flat_collectives.hpp); CUDA tensors use NCCL's own collectives, or the ring on host copies (Gloo).
#include "ctorch/flat_collectives.hpp"

#include "core/compat.hpp"
#include "ctorch/errors.hpp"
#include "core/exception_text.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <deque>
#include <string>
#include <utility>
#include <vector>

namespace ctorch {

// A named namespace, not an anonymous one: the library is built as unity sources.
namespace flat_collectives_detail {

// Point-to-point tags (Gloo slots) of these collectives; Gloo's own collectives use slots with a
// non-zero prefix byte, so these never meet theirs. Each call is matched in order on its tag.
constexpr int kReduceScatterTag = 0x63740100;
constexpr int kAllGatherTag = 0x63740200;

using WorkPtr = decltype(std::declval<c10d::ProcessGroup&>().send(std::declval<std::vector<at::Tensor>&>(), 0, 0));

// One ring collective on this rank: its neighbours, its segmenting, and its posted transfers.
class Ring {
 public:
  Ring(c10d::ProcessGroup& group, const char* what, int tag, std::int64_t chunkNumel, std::int64_t segmentNumel)
      : group_(group), what_(what), tag_(tag), rank_(group.getRank()), world_(group.getSize()),
        chunk_(chunkNumel), segment_(std::max<std::int64_t>(1, std::min(segmentNumel, chunkNumel))) {}

  int world() const { return world_; }
  // Chunk index `k` places before this rank's, around the ring.
  int chunkBefore(int k) const { return ((rank_ - k) % world_ + world_) % world_; }
  std::int64_t segments() const { return chunk_ == 0 ? 0 : (chunk_ + segment_ - 1) / segment_; }
  at::Tensor chunk(const at::Tensor& flat, int c) const { return flat.narrow(0, c * chunk_, chunk_); }
  at::Tensor segment(const at::Tensor& part, std::int64_t j) const {
    return part.narrow(0, j * segment_, std::min(segment_, chunk_ - j * segment_));
  }

  void postSend(const at::Tensor& t) { sends_.push_back(post(true, t)); }
  void postRecv(const at::Tensor& t) { recvs_.push_back(post(false, t)); }
  // Waits for the oldest receive still pending (receives complete in the order they were posted).
  void awaitRecv() {
    finish(recvs_.front(), false);
    recvs_.pop_front();
  }
  // Waits until at most `keep` sends are still pending.
  void awaitSends(std::size_t keep = 0) {
    while (sends_.size() > keep) {
      finish(sends_.front(), true);
      sends_.pop_front();
    }
  }

 private:
  int right() const { return (rank_ + 1) % world_; }
  int left() const { return (rank_ + world_ - 1) % world_; }

  [[noreturn]] void fail(bool send, const std::exception& e) const {
    const std::string message = detail::messageOf(e);
    detail::throwDistributed("rank " + std::to_string(rank_) + ": " + what_ + " failed " +
                                 (send ? "sending to rank " + std::to_string(right())
                                       : "receiving from rank " + std::to_string(left())) +
                                 ": " + message,
                             message);
  }

  WorkPtr post(bool send, const at::Tensor& t) {
    try {
      std::vector<at::Tensor> tensors{t};
      return send ? group_.send(tensors, right(), tag_) : group_.recv(tensors, left(), tag_);
    } catch (const std::exception& e) {
      fail(send, e);
    }
  }

  // Gloo bounds each wait by the group's timeout (its context's) and throws past it.
  void finish(const WorkPtr& work, bool send) const {
    bool done = false;
    try {
      done = work->wait();
    } catch (const std::exception& e) {
      fail(send, e);
    }
    if (!done) fail(send, std::runtime_error("the transfer was aborted"));
  }

  c10d::ProcessGroup& group_;
  const char* what_;
  int tag_, rank_, world_;
  std::int64_t chunk_, segment_;
  std::deque<WorkPtr> sends_, recvs_;
};

void check(const char* what, const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& input,
           const at::Tensor& output, std::int64_t bigNumel, std::int64_t smallNumel, const char* bigName,
           const FlatCollectiveOptions& options) {
  options.validate();
  const std::string where = std::string("ctorch::") + what + ": ";
  if (!group) throw ConfigError(where + "no process group");
  if (!input.defined() || !output.defined()) throw ConfigError(where + "a tensor is undefined");
  if (input.dim() != 1 || output.dim() != 1)
    throw ConfigError(where + "flat (1-D) tensors only; got " + std::to_string(input.dim()) + "-D input, " +
                      std::to_string(output.dim()) + "-D output");
  if (!input.is_contiguous() || !output.is_contiguous())
    throw ConfigError(where + "the input and the output must be contiguous");
  if (input.scalar_type() != output.scalar_type() || input.device() != output.device())
    throw ConfigError(where + "the input and the output differ in dtype or device (" + input.toString() + " on " +
                      input.device().str() + ", " + output.toString() + " on " + output.device().str() + ")");
  if (bigNumel != smallNumel * group->getSize())
    throw ConfigError(where + "the " + bigName + " has " + std::to_string(bigNumel) + " elements, not " +
                      std::to_string(group->getSize()) + " (the world size) x " + std::to_string(smallNumel) +
                      "; pad it to a multiple of the world size (ctorch::shardNumel)");
  if (!input.is_cuda() && !input.is_cpu())
    throw ConfigError(where + "CPU (Gloo) or CUDA (NCCL) tensors only, not " + input.device().str());
}

// A native collective (NCCL), its failure as one DistributedError.
template <typename F>
void runNative(const char* what, c10d::ProcessGroup& group, F&& f) {
  detail::failuresAsDistributed([&] { return f()->wait(); },
                                [&] { return "rank " + std::to_string(group.getRank()) + ": " + what; });
}

std::int64_t segmentNumel(const FlatCollectiveOptions& options, const at::Tensor& t) {
  return std::max<std::int64_t>(1, options.segmentBytes() / static_cast<std::int64_t>(t.element_size()));
}

// Step s (0 .. N-2): send the partial sum of chunk rank-1-s, receive that of chunk rank-2-s and add
// this rank's own part to it; the last step's chunk is this rank's own, received into `output`.
// Partials rotate through three buffers: step s's is received, summed and forwarded from
// buffer s % 3 while step s+1's receives are already posted into the next one.
void ringReduceScatter(Ring& ring, const at::Tensor& input, at::Tensor& output) {
  const int steps = ring.world() - 1;
  const std::int64_t segments = ring.segments();
  std::vector<at::Tensor> partial;
  for (int i = 0; i < std::min(steps - 1, 3); ++i) partial.push_back(at::empty_like(output));
  auto target = [&](int s) { return s == steps - 1 ? output : partial[static_cast<std::size_t>(s % 3)]; };
  auto postRecvs = [&](int s) {
    for (std::int64_t j = 0; j < segments; ++j) ring.postRecv(ring.segment(target(s), j));
  };
  const at::Tensor first = ring.chunk(input, ring.chunkBefore(1));
  for (std::int64_t j = 0; j < segments; ++j) ring.postSend(ring.segment(first, j));
  postRecvs(0);
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) {
      // Buffer (s+1) % 3 last held step s-2's partial, forwarded as step s-1's sends.
      ring.awaitSends(static_cast<std::size_t>(segments));
      postRecvs(s + 1);
    }
    const at::Tensor own = ring.chunk(input, ring.chunkBefore(s + 2));
    const at::Tensor into = target(s);
    for (std::int64_t j = 0; j < segments; ++j) {
      ring.awaitRecv();
      at::Tensor part = ring.segment(into, j);
      part.add_(ring.segment(own, j));  // the partial so far + this rank's: a + b, the documented order
      if (s + 1 < steps) ring.postSend(part);
    }
  }
  ring.awaitSends();
}

// Each rank's chunk travels N-1 hops to the right; every receive lands in its final place in
// `output`, so all are posted at once and each segment is forwarded as soon as it has arrived.
void ringAllGather(Ring& ring, const at::Tensor& input, at::Tensor& output) {
  const int steps = ring.world() - 1;
  const std::int64_t segments = ring.segments();
  at::Tensor mine = ring.chunk(output, ring.chunkBefore(0));
  if (mine.data_ptr() != input.data_ptr()) mine.copy_(input);  // else in place: input is output's own chunk
  for (std::int64_t j = 0; j < segments; ++j) ring.postSend(ring.segment(input, j));
  for (int s = 0; s < steps; ++s)
    for (std::int64_t j = 0; j < segments; ++j) ring.postRecv(ring.segment(ring.chunk(output, ring.chunkBefore(s + 1)), j));
  for (int s = 0; s < steps; ++s) {
    const at::Tensor arrived = ring.chunk(output, ring.chunkBefore(s + 1));
    for (std::int64_t j = 0; j < segments; ++j) {
      ring.awaitRecv();
      if (s + 1 < steps) ring.postSend(ring.segment(arrived, j));
      ring.awaitSends(2 * static_cast<std::size_t>(segments));  // keep the sends in flight bounded
    }
  }
  ring.awaitSends();
}

} // namespace flat_collectives_detail

void FlatCollectiveOptions::validate() const {
  if (segmentBytes_ <= 0)
    throw ConfigError("FlatCollectiveOptions: segmentBytes must be positive, got " + std::to_string(segmentBytes_));
}

std::int64_t shardNumel(std::int64_t numel, int worldSize) {
  if (worldSize <= 0) throw ConfigError("ctorch::shardNumel: the world size must be positive, got " + std::to_string(worldSize));
  if (numel < 0) throw ConfigError("ctorch::shardNumel: negative numel " + std::to_string(numel));
  return (numel + worldSize - 1) / worldSize;
}

void reduceScatter(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& input,
                   at::Tensor& output, const FlatCollectiveOptions& options) {
  using namespace flat_collectives_detail;
  check("reduceScatter", group, input, output, input.numel(), output.numel(), "input", options);
  at::NoGradGuard noGrad;  // the output may be a view of a parameter (FSDP's flat parameter)
  if (input.is_cuda() && compat::backendNameFor(group, c10::DeviceType::CUDA) == "nccl") {
    at::Tensor in = input;
    runNative("reduceScatter", *group, [&] { return compat::reduceScatterFlat(*group, output, in); });
    return;
  }
  if (input.is_cuda()) {  // Gloo: the ring on host copies (its send / recv read host memory only)
    at::Tensor hostOutput = at::empty(output.sizes(), output.options().device(at::kCPU));
    reduceScatter(group, input.to(at::kCPU), hostOutput, options);
    output.copy_(hostOutput);
    return;
  }
  if (group->getSize() == 1) {
    output.copy_(input);
    return;
  }
  Ring ring(*group, "reduceScatter", kReduceScatterTag, output.numel(), segmentNumel(options, output));
  ringReduceScatter(ring, input, output);
}

void allGather(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const at::Tensor& input, at::Tensor& output,
               const FlatCollectiveOptions& options) {
  using namespace flat_collectives_detail;
  check("allGather", group, input, output, output.numel(), input.numel(), "output", options);
  at::NoGradGuard noGrad;  // the output may be a view of a parameter (FSDP's flat parameter)
  if (input.is_cuda() && compat::backendNameFor(group, c10::DeviceType::CUDA) == "nccl") {
    at::Tensor in = input;
    runNative("allGather", *group, [&] { return compat::allGatherFlat(*group, output, in); });
    return;
  }
  if (input.is_cuda()) {  // Gloo: as reduceScatter; the input is copied first (it may be output's chunk)
    at::Tensor hostOutput = at::empty(output.sizes(), output.options().device(at::kCPU));
    allGather(group, input.to(at::kCPU), hostOutput, options);
    output.copy_(hostOutput);
    return;
  }
  if (group->getSize() == 1) {
    if (output.data_ptr() != input.data_ptr()) output.copy_(input);
    return;
  }
  Ring ring(*group, "allGather", kAllGatherTag, input.numel(), segmentNumel(options, input));
  ringAllGather(ring, input, output);
}

} // namespace ctorch
