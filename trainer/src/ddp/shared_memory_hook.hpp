// Private: DistributedDataParallel's CommHook::kSharedMemory, a c10d communication hook that averages
// the Reducer's gradient buckets through a SharedMemoryAllreduce segment instead of the group.
#pragma once

#include "ddp/shared_memory_allreduce.hpp"

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>

namespace ctorch::detail {

// CommHook::kSharedMemory: the gradient buckets averaged through shared memory, in place.
// Overlapped: each bucket on the allreduce's worker thread as soon as it is ready (the backward pass
// goes on meanwhile; the Reducer waits for the futures at its end, as for Gloo's). After backward:
// the hook keeps each bucket's future pending, and the last bucket's call reduces them all on the
// thread running the backward pass, then completes them (buckets are launched in index order, the
// last one last). A sparse bucket goes through the group, as with the built-in hook. Derives from
// CommHookInterface, not CppCommHookInterface, whose parseHookResult 1.13 does not export.
std::unique_ptr<c10d::CommHookInterface> makeSharedMemoryHook(std::shared_ptr<SharedMemoryAllreduce> allreduce,
                                                              c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                              bool afterBackward);

} // namespace ctorch::detail
