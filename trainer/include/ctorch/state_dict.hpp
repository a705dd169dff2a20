// ctorch::ItemDict: a str -> any dict, the one shape every state dict of the library takes (an
// optimizer's, a scheduler's, a shard of FSDP's or ZeRO's, a loop's own items), as Python's state_dict()
// is a dict. Small on purpose: the strategies include this, not the snapshot API.
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <string>

namespace ctorch {

// A str -> any dict (Python's dict of plain values): scheduler state, user items, optimizer state.
using ItemDict = c10::Dict<std::string, c10::IValue>;
// An empty ItemDict. (c10::Dict<std::string, IValue> has no default constructor of its own.)
ItemDict newItemDict();

} // namespace ctorch
