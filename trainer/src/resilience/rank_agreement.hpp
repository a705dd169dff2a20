// The collectives through which ResilientTraining's ranks agree: small allreduces (waited for, or
// left running while the next step computes), every rank's generator states, one rank's bytes to all.
#pragma once

#include "ctorch/snapshot.hpp"

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::detail {

// Every call is a collective (each rank makes it at the same point). A failed one throws one
// DistributedError (DistributedTimeout when it timed out) naming the rank and `during`.
class RankAgreement {
 public:
  RankAgreement(c10::intrusive_ptr<c10d::ProcessGroup> group, bool nccl);

  int rank() const { return rank_; }
  int world() const { return world_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }
  // After a re-form (in-place recovery): the new group; null lets go of the failed one.
  void replaceGroup(c10::intrusive_ptr<c10d::ProcessGroup> group) { group_ = std::move(group); }

  // The element-wise reduction over the ranks (a world of one returns `values` as they are).
  std::vector<double> allReduce(std::vector<double> values, c10d::ReduceOp op, const std::string& during);
  // The same, left running: finishPending() waits for it (nothing when none is running);
  // dropPending() forgets it (its group failed).
  void startPending(const std::vector<double>& values, c10d::ReduceOp op, std::string during);
  std::optional<std::vector<double>> finishPending();
  void dropPending() { pending_.reset(); }

  // Every rank's generator states, index = rank.
  std::vector<RngState> gatherRng();
  // The largest `value` of any rank (run even by a world of one: the re-formed group's first meeting).
  std::int64_t maxOf(std::int64_t value, const std::string& during);
  // `root`'s `bytes` on every rank (the others pass none); an empty payload is refused.
  std::vector<char> broadcast(std::vector<char> bytes, int root, const std::string& during);

  // Point to point (not collectives: only the ranks named take part). A ring pass: `mine` to rank + 1,
  // and rank - 1's bytes back (every rank calls it at the same point; a world of one gets its own).
  // Each received payload is refused above `limit` bytes, or empty.
  at::Tensor passToNext(const std::vector<char>& mine, std::int64_t limit, const std::string& during);
  void sendTo(const at::Tensor& bytes, int to, const std::string& during);
  at::Tensor receiveFrom(int from, std::int64_t limit, const std::string& during);

 private:
  struct Reduction {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor values;
    std::string during;  // names it when it fails
  };
  torch::Device device() const;
  Reduction start(const std::vector<double>& values, c10d::ReduceOp op, std::string during);
  std::vector<double> finish(Reduction& r);
  // Runs `body`; any failure but the library's own errors becomes the one line described above.
  template <typename F>
  auto guarded(const std::string& during, F&& body);
  [[noreturn]] void fail(const std::exception& e, const std::string& during) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  int world_ = 1;
  bool nccl_ = false;
  std::optional<Reduction> pending_;
};

} // namespace ctorch::detail
