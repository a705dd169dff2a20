#include <ctorch/data/cifar.hpp>

#include <torch/torch.h>

#include <ctorch/data/error.hpp>

#include "byte_source.hpp"

namespace ctorch::data {
namespace {
constexpr int64_t kCifarClasses = 10;
constexpr int kCifarTrainBatches = 5;
}  // namespace

std::pair<torch::Tensor, torch::Tensor> readCifar10Batch(const std::filesystem::path& file) {
  detail::ByteSource in(file);
  // Read everything, then check the size: the file may be gzip-compressed, so its size on disk
  // says nothing. A standard batch is 10,000 records (30.7 MB).
  std::vector<torch::Tensor> chunks;
  constexpr int64_t kChunkRecords = 10000;
  int64_t records = 0;
  while (true) {
    auto chunk = torch::empty({kChunkRecords * kCifarRecordBytes}, torch::kByte);
    size_t got = in.read(chunk.data_ptr(), static_cast<size_t>(chunk.numel()));
    if (got % kCifarRecordBytes != 0 || (got == 0 && records == 0)) {
      uint64_t total = in.offset();
      throw DataFormatError(file.string() + ": truncated: " + std::to_string(total) +
                            " bytes is not a positive multiple of the " +
                            std::to_string(kCifarRecordBytes) + "-byte CIFAR-10 record");
    }
    int64_t n = static_cast<int64_t>(got) / kCifarRecordBytes;
    if (n > 0) chunks.push_back(chunk.narrow(0, 0, n * kCifarRecordBytes));
    records += n;
    if (n < kChunkRecords) break;
  }
  auto all = (chunks.size() == 1 ? chunks[0] : torch::cat(chunks)).view({records, kCifarRecordBytes});
  auto labels = all.select(1, 0).to(torch::kLong);
  auto bad = (labels >= kCifarClasses).nonzero();
  if (bad.numel() > 0) {
    int64_t at = bad[0][0].item<int64_t>();
    throw DataFormatError(file.string() + ": label " + std::to_string(labels[at].item<int64_t>()) +
                          " of record " + std::to_string(at) + " is out of range [0, 10)");
  }
  auto images = all.narrow(1, 1, kCifarImageBytes).reshape({records, 3, 32, 32}).contiguous();
  return {images, labels};
}

InMemoryDataset readCifar10(const std::filesystem::path& dir, Split split, DatasetInfo info) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw DataFileError(dir.string() + ": missing data directory (expected CIFAR-10 binary batches "
                        "data_batch_1.bin ... test_batch.bin)");
  }
  auto base = dir;
  if (!std::filesystem::exists(dir / "test_batch.bin", ec) &&
      std::filesystem::is_directory(dir / "cifar-10-batches-bin", ec)) {
    base = dir / "cifar-10-batches-bin";
  }
  std::vector<std::filesystem::path> files;
  if (split == Split::Train) {
    for (int i = 1; i <= kCifarTrainBatches; ++i) {
      files.push_back(base / ("data_batch_" + std::to_string(i) + ".bin"));
    }
  } else {
    files.push_back(base / "test_batch.bin");
  }
  std::vector<torch::Tensor> images, labels;
  for (const auto& f : files) {
    auto [x, y] = readCifar10Batch(f);  // a missing one is a DataFileError naming it
    images.push_back(std::move(x));
    labels.push_back(std::move(y));
  }
  return InMemoryDataset(images.size() == 1 ? images[0] : torch::cat(images),
                         labels.size() == 1 ? labels[0] : torch::cat(labels), std::move(info));
}

} // namespace ctorch::data
