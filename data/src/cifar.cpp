#include <ctorch/data/cifar.hpp>

#include <torch/torch.h>

#include <ctorch/data/error.hpp>

#include "byte_source.hpp"

namespace ctorch::data {
namespace {
constexpr int64_t kCifarClasses = 10;
constexpr int kCifarTrainBatches = 5;
constexpr int64_t kCifarBatchRecords = 10000;  // every batch of the published data set
}  // namespace

std::pair<torch::Tensor, torch::Tensor> readCifar10Batch(const std::filesystem::path& file) {
  detail::ByteSource in(file);
  // The file may be gzip-compressed, so its size on disk says little: read at most one standard
  // batch (10,000 records, 30.7 MB) and refuse anything longer before inflating further, so a
  // small gzip bomb cannot grow into gigabytes.
  auto buffer = torch::empty({kCifarBatchRecords * kCifarRecordBytes}, torch::kByte);
  const size_t got = in.read(buffer.data_ptr(), static_cast<size_t>(buffer.numel()));
  if (got == static_cast<size_t>(buffer.numel()) && !in.atEnd()) {
    throw DataFormatError(file.string() + ": more than " + std::to_string(kCifarBatchRecords) +
                          " records (" + std::to_string(buffer.numel()) +
                          " bytes); a CIFAR-10 batch has exactly that many, refusing to read further");
  }
  if (got % kCifarRecordBytes != 0 || got == 0) {
    throw DataFormatError(file.string() + ": truncated: " + std::to_string(got) +
                          " bytes is not a positive multiple of the " +
                          std::to_string(kCifarRecordBytes) + "-byte CIFAR-10 record");
  }
  const int64_t records = static_cast<int64_t>(got) / kCifarRecordBytes;
  auto all = buffer.narrow(0, 0, records * kCifarRecordBytes).view({records, kCifarRecordBytes});
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
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      throw DataFileError(dir.string() + ": cannot access data directory: " + ec.message());
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
