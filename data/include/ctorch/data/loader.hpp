// Iterates an index list (e.g. a DistributedSampler's share of an epoch) in batches, optionally
// preparing the next batches on a background thread (bounded queue). The output is identical to
// the synchronous path; an exception while preparing a batch is rethrown by next() in its place.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <ctorch/data/pipeline.hpp>

namespace ctorch::data {

struct LoaderOptions {
  int64_t batchSize = 64;
  bool dropLast = false;     // drop a last, smaller batch
  int64_t epoch = 0;         // passed to the pipeline (augmentation)
  int64_t skipBatches = 0;   // start after this many batches (resuming mid-epoch)
  int prefetch = 1;          // 0: prepare batches in next(); 1-2: background thread, queue depth
  // Throws DataOptionsError naming the bad value.
  void validate() const;
};

class BatchLoader {
 public:
  BatchLoader(std::shared_ptr<const BatchPipeline> pipeline, std::vector<int64_t> indices,
              LoaderOptions options);
  // The same, from a 1-D Long tensor of indices (copied).
  BatchLoader(std::shared_ptr<const BatchPipeline> pipeline, const torch::Tensor& indices,
              LoaderOptions options);
  ~BatchLoader();  // stops and joins the background thread
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // Batches of the whole index list (skipped ones included).
  int64_t numBatches() const { return numBatches_; }
  // The next batch, or nullopt at the end. Rethrows a preparation error at its batch; after that
  // (or after the end) it returns nullopt.
  std::optional<Batch> next();

 private:
  struct Item {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  Item prepare(int64_t batchIndex) const;
  void produce();

  std::shared_ptr<const BatchPipeline> pipeline_;
  std::vector<int64_t> indices_;
  LoaderOptions options_;
  int64_t numBatches_ = 0;
  int64_t nextBatch_ = 0;   // the next batch to hand out (synchronous) or to prepare (thread)
  int64_t delivered_ = 0;   // batches handed out or skipped
  bool failed_ = false;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Item> queue_;
  bool stop_ = false;
  bool producerDone_ = false;
  std::thread thread_;
};

} // namespace ctorch::data
