// The bytes of Python's torch.save zip format for a value of plain dicts, lists, tuples, scalars and
// CPU tensors that own their storage, without the type tags torch::pickle_save adds (which
// PyTorch 2.6+'s weights-only torch.load refuses). Shared by snapshots and saveStateDict.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

namespace ctorch::detail {
std::vector<char> portableArchive(const c10::IValue& top);
} // namespace ctorch::detail
