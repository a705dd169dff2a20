// The bytes of Python's torch.save zip format for a value of plain dicts, lists, tuples, scalars and
// CPU tensors that own their storage, without the type tags torch::pickle_save adds (which
// PyTorch 2.6+'s weights-only torch.load refuses). Shared by snapshots and saveStateDict.
#pragma once

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <functional>
#include <vector>

namespace ctorch {
struct Snapshot;
struct SnapshotSlotOptions;
}

namespace ctorch::detail {

// Receives the archive's bytes in order (a file, a vector).
using ByteSink = std::function<void(const char* data, std::size_t size)>;

// A value pickled, its tensors not yet written: everything that can fail on the value itself
// (an unsupported type) fails in prepare, before a byte is written anywhere; write() then streams
// the archive straight from the tensors' storage, without a second copy in memory.
class PreparedArchive {
 public:
  static PreparedArchive prepare(const c10::IValue& top);
  void write(const ByteSink& sink) const;
  // The archive's size give or take its zip headers (a little more than the exact size).
  std::size_t sizeBound() const;

 private:
  std::vector<char> pickled_;
  std::vector<at::Tensor> tensors_;
};

std::vector<char> portableArchive(const c10::IValue& top);

// encodeSnapshot up to the bytes: the header and digest filled in, the value pickled (snapshot_format.cpp).
PreparedArchive prepareSnapshot(Snapshot& snapshot);
// saveSnapshot after its encoding: `prepared` written into the slot crash-safely (snapshot_file.cpp).
// A snapshot going to several files is prepared (pickled, digested) once and written to each.
std::size_t writePreparedSnapshot(const PreparedArchive& prepared, const SnapshotSlotOptions& options);

} // namespace ctorch::detail
