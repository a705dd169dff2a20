#include <ctorch/data/idx.hpp>

#include <algorithm>
#include <array>
#include <cstdio>
#include <optional>

#include <torch/torch.h>

#include <ctorch/data/error.hpp>

#include "byte_source.hpp"

namespace ctorch::data {
namespace {

// A header beyond this is a corrupt file, not a dataset (and would make us allocate it).
constexpr uint64_t kMaxIdxBytes = uint64_t{1} << 40;

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

uint32_t bigEndian32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

struct IdxType {
  torch::ScalarType dtype;
  size_t bytes;
};

std::optional<IdxType> idxType(unsigned char code) {
  switch (code) {
    case 0x08: return IdxType{torch::kByte, 1};
    case 0x09: return IdxType{torch::kChar, 1};
    case 0x0B: return IdxType{torch::kShort, 2};
    case 0x0C: return IdxType{torch::kInt, 4};
    case 0x0D: return IdxType{torch::kFloat, 4};
    case 0x0E: return IdxType{torch::kDouble, 8};
    default: return std::nullopt;
  }
}

// IDX stores multi-byte values big-endian; the machines we run on are little-endian.
void swapToHost(torch::Tensor& t, size_t elementBytes) {
  if (elementBytes == 1) return;
  auto* p = static_cast<unsigned char*>(t.data_ptr());
  int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i, p += elementBytes) std::reverse(p, p + elementBytes);
}

torch::Tensor readIdxExpecting(const std::filesystem::path& file, std::optional<uint32_t> expected,
                               const char* kind) {
  detail::ByteSource in(file);
  std::array<unsigned char, 4> magicBytes{};
  in.readExactly(magicBytes.data(), 4, "the IDX magic number");
  uint32_t magic = bigEndian32(magicBytes.data());
  if (expected && magic != *expected) {
    throw DataFormatError(file.string() + ": wrong magic number: expected " +
                          std::to_string(*expected) + " (" + hex32(*expected) + ", " + kind +
                          "), found " + std::to_string(magic) + " (" + hex32(magic) + ")");
  }
  auto type = idxType(magicBytes[2]);
  int ndim = magicBytes[3];
  if (magicBytes[0] != 0 || magicBytes[1] != 0 || !type || ndim == 0) {
    throw DataFormatError(file.string() + ": not an IDX file: magic number " + hex32(magic) +
                          " (expected 0x0000TTNN with a known type TT and NN > 0 dimensions)");
  }
  std::vector<unsigned char> dimBytes(4 * static_cast<size_t>(ndim));
  in.readExactly(dimBytes.data(), dimBytes.size(), "the header's " + std::to_string(ndim) + " sizes");
  std::vector<int64_t> shape;
  uint64_t bytes = type->bytes;
  for (int d = 0; d < ndim; ++d) {
    uint32_t size = bigEndian32(dimBytes.data() + 4 * d);
    shape.push_back(size);
    // Checked: unchecked, sizes like 2^20 x 2^20 x 2^24 wrap the product to 0 and pass the cap.
    if (__builtin_mul_overflow(bytes, uint64_t{size}, &bytes) || bytes > kMaxIdxBytes) {
      throw DataFormatError(file.string() + ": header announces more than " +
                            std::to_string(kMaxIdxBytes) + " bytes of data: corrupt header");
    }
  }
  // Checked before allocating: the file cannot hold what the header announces.
  const uint64_t headerBytes = 4 + dimBytes.size();
  const uint64_t room = in.maxContentBytes() - std::min(in.maxContentBytes(), headerBytes);
  if (bytes > room) {
    throw DataFormatError(file.string() + ": truncated: the data of shape " + c10::str(shape) +
                          " needs " + std::to_string(bytes) + " bytes, found " +
                          (in.compressed() ? "at most " + std::to_string(room) +
                                                 " (the most this gzip file can inflate to)"
                                           : std::to_string(room)));
  }
  auto tensor = torch::empty(shape, torch::TensorOptions().dtype(type->dtype));
  in.readExactly(tensor.data_ptr(), bytes, "the data of shape " + c10::str(tensor.sizes()));
  if (!in.atEnd()) {
    throw DataFormatError(file.string() + ": unexpected data after the " + std::to_string(bytes) +
                          " bytes the header announces (shape " + c10::str(tensor.sizes()) + ")");
  }
  swapToHost(tensor, type->bytes);
  return tensor;
}

// The first candidate that exists; a candidate that cannot be looked at (EACCES, ELOOP, EIO, ...)
// is an error saying what errno says, not a missing file.
std::optional<std::filesystem::path> firstExisting(const std::vector<std::filesystem::path>& paths) {
  for (const auto& p : paths) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(p, ec)) return p;
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      throw DataFileError(p.string() + ": cannot access: " + ec.message());
  }
  return std::nullopt;
}

}  // namespace

torch::Tensor readIdx(const std::filesystem::path& file) {
  return readIdxExpecting(file, std::nullopt, "");
}

torch::Tensor readIdxImages(const std::filesystem::path& file) {
  auto images = readIdxExpecting(file, kIdxImagesMagic, "IDX images: unsigned byte, 3 dimensions");
  return images.unsqueeze(1);  // [N, 1, rows, cols]: the channel dimension models expect
}

torch::Tensor readIdxLabels(const std::filesystem::path& file, int64_t numClasses) {
  auto labels = readIdxExpecting(file, kIdxLabelsMagic, "IDX labels: unsigned byte, 1 dimension");
  auto bad = (labels >= numClasses).nonzero();
  if (bad.numel() > 0) {
    int64_t at = bad[0][0].item<int64_t>();
    throw DataFormatError(file.string() + ": label " + std::to_string(labels[at].item<int>()) +
                          " at index " + std::to_string(at) + " is out of range [0, " +
                          std::to_string(numClasses) + ")");
  }
  return labels.to(torch::kLong);
}

MnistFiles findMnistFiles(const std::filesystem::path& dir, Split split) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      throw DataFileError(dir.string() + ": cannot access data directory: " + ec.message());
    throw DataFileError(dir.string() + ": missing data directory (expected MNIST-format files such "
                        "as train-images-idx3-ubyte.gz)");
  }
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  const std::vector<std::filesystem::path> dirs = {dir, dir / "raw", dir / "MNIST" / "raw",
                                                   dir / "FashionMNIST" / "raw"};
  auto find = [&](const std::string& what, const std::string& ubyte) {
    std::vector<std::filesystem::path> candidates;
    for (const auto& d : dirs) {
      for (const auto& name : {prefix + "-" + what + "-" + ubyte, prefix + "-" + what + "." + ubyte}) {
        candidates.push_back(d / name);
        candidates.push_back(d / (name + ".gz"));
      }
    }
    auto found = firstExisting(candidates);
    if (!found) {
      throw DataFileError(dir.string() + ": missing file " + prefix + "-" + what + "-" + ubyte +
                          "[.gz] (also looked in raw/, MNIST/raw/, FashionMNIST/raw/)");
    }
    return *found;
  };
  return {find("images", "idx3-ubyte"), find("labels", "idx1-ubyte")};
}

InMemoryDataset readMnist(const std::filesystem::path& dir, Split split, DatasetInfo info) {
  auto files = findMnistFiles(dir, split);
  auto images = readIdxImages(files.images);
  auto labels = readIdxLabels(files.labels, info.numClasses > 0 ? info.numClasses : 256);
  if (images.size(0) != labels.size(0)) {
    throw DataFormatError(files.labels.string() + ": " + std::to_string(labels.size(0)) +
                          " labels but " + files.images.string() + " has " +
                          std::to_string(images.size(0)) + " images");
  }
  return InMemoryDataset(std::move(images), std::move(labels), std::move(info));
}

} // namespace ctorch::data
