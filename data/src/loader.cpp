#include <ctorch/data/loader.hpp>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <ctorch/data/error.hpp>

namespace ctorch::data {

void LoaderOptions::validate() const {
  if (batchSize < 1) {
    throw DataOptionsError("batch size " + std::to_string(batchSize) + " must be >= 1");
  }
  if (epoch < 0) throw DataOptionsError("epoch " + std::to_string(epoch) + " must be >= 0");
  if (skipBatches < 0) {
    throw DataOptionsError("skip batches " + std::to_string(skipBatches) + " must be >= 0");
  }
  if (prefetch < 0 || prefetch > 2) {
    throw DataOptionsError("prefetch " + std::to_string(prefetch) +
                           " must be 0 (synchronous), 1 or 2 (background batches)");
  }
}

BatchLoader::BatchLoader(std::shared_ptr<const BatchPipeline> pipeline, std::vector<int64_t> indices,
                         LoaderOptions options)
    : pipeline_(std::move(pipeline)), indices_(std::move(indices)), options_(options) {
  options_.validate();
  if (!pipeline_) throw DataOptionsError("BatchLoader needs a pipeline");
  const auto n = static_cast<int64_t>(indices_.size());
  numBatches_ = options_.dropLast ? n / options_.batchSize
                                  : (n + options_.batchSize - 1) / options_.batchSize;
  nextBatch_ = std::min(options_.skipBatches, numBatches_);
  delivered_ = nextBatch_;
  if (options_.prefetch > 0 && nextBatch_ < numBatches_) {
    thread_ = std::thread([this] { produce(); });
  }
}

namespace {
std::vector<int64_t> indexVector(const torch::Tensor& indices) {
  if (!indices.defined() || indices.dim() != 1 || indices.scalar_type() != torch::kLong) {
    throw DataOptionsError("BatchLoader: indices must be a 1-D Long tensor");
  }
  auto cpu = indices.to(torch::kCPU).contiguous();
  const int64_t* p = cpu.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + cpu.numel());
}
}  // namespace

BatchLoader::BatchLoader(std::shared_ptr<const BatchPipeline> pipeline, const torch::Tensor& indices,
                         LoaderOptions options)
    : BatchLoader(std::move(pipeline), indexVector(indices), options) {}

BatchLoader::~BatchLoader() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

BatchLoader::Item BatchLoader::prepare(int64_t batchIndex) const {
  Item item;
  try {
    const int64_t begin = batchIndex * options_.batchSize;
    const int64_t end = std::min<int64_t>(begin + options_.batchSize, indices_.size());
    std::vector<int64_t> slice(indices_.begin() + begin, indices_.begin() + end);
    item.batch = pipeline_->batch(slice, options_.epoch);
  } catch (...) {
    item.error = std::current_exception();
  }
  return item;
}

void BatchLoader::produce() {
  // A new thread starts with default intra-op settings; take the process's (as PyTorch's own
  // worker threads do), and never record autograd history.
  at::init_num_threads();
  torch::NoGradGuard noGrad;
  for (int64_t b = nextBatch_; b < numBatches_; ++b) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stop_ || static_cast<int>(queue_.size()) < options_.prefetch; });
      if (stop_) break;
    }
    Item item = prepare(b);
    const bool failed = item.error != nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(item));
    }
    changed_.notify_all();
    if (failed) break;  // the consumer gets the error at this batch and nothing after it
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    producerDone_ = true;
  }
  changed_.notify_all();
}

std::optional<Batch> BatchLoader::next() {
  if (failed_ || delivered_ >= numBatches_) return std::nullopt;
  Item item;
  if (!thread_.joinable()) {
    item = prepare(nextBatch_++);
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return !queue_.empty() || producerDone_; });
    if (queue_.empty()) return std::nullopt;  // only after a failure, which was already reported
    item = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    changed_.notify_all();
  }
  ++delivered_;
  if (item.error) {
    failed_ = true;
    std::rethrow_exception(item.error);
  }
  return std::move(item.batch);
}

} // namespace ctorch::data
