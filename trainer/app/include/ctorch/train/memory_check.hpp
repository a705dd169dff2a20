// Refusing a --batch-size that cannot work before the first step: one larger than this rank's share
// of the training set, or one whose inputs and activations need more memory than the node has left
// (otherwise the process grows until the kernel's OOM killer or swapping ends the run).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ctorch::train {

struct BatchMemoryInputs {
  std::int64_t batchSize = 1;
  std::int64_t shardSize = 0;         // training samples this rank sees per epoch
  std::int64_t datasetSize = 0;       // training samples in all
  std::int64_t worldSize = 1;
  std::int64_t localRanks = 1;        // ranks sharing this node's memory
  std::int64_t inputBytes = 0;        // one sample as the model receives it (float32)
  std::int64_t activationBytes = 0;   // one sample's forward pass, kept for backward (0: not measured)
  int prefetch = 0;                   // batches prepared ahead
  std::optional<std::int64_t> availableBytes;  // for this node (nullopt: unknown, not checked)
  std::string availableSource;        // where availableBytes came from ("MemAvailable", "cgroup memory.max")
};

// Bytes one rank needs for a batch: the input batch as loaded, its normalised/augmented copy and each
// prefetched batch, plus the activations the forward pass keeps for backward.
std::int64_t batchBytesPerRank(const BatchMemoryInputs& in);

// "" when the batch fits; else one line naming --batch-size, its value, the estimate and the largest
// batch that fits.
std::string checkBatchSize(const BatchMemoryInputs& in);

// "1.5 GiB", "512 KiB".
std::string formatBytes(std::int64_t bytes);

// MemAvailable of a /proc/meminfo text, in bytes.
std::optional<std::int64_t> parseMemAvailable(const std::string& meminfo);

// What this process may still allocate: the smaller of MemAvailable and its cgroup's limit less its
// usage (cgroup v2 or v1). Sets `source` to the one that decided.
std::optional<std::int64_t> availableMemory(std::string& source);

// Bytes of heap in use by this process (glibc's mallinfo2: all arenas and mmapped blocks), or
// nullopt where it cannot be read.
std::optional<std::int64_t> heapBytesInUse();

}  // namespace ctorch::train
