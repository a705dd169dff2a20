#include <ctorch/data/dataset.hpp>

#include <sstream>

#include <torch/torch.h>

#include <ctorch/data/error.hpp>

namespace ctorch::data {

Split parseSplit(const std::string& text) {
  if (text == "train") return Split::Train;
  if (text == "test") return Split::Test;
  throw DataOptionsError("invalid split '" + text + "' (expected train or test)");
}

const char* toString(Split split) { return split == Split::Train ? "train" : "test"; }

Normalization Normalization::mnist() { return {{0.1307}, {0.3081}}; }
Normalization Normalization::fashionMnist() { return {{0.2860}, {0.3530}}; }
// The per-channel mean and (population) std of CIFAR-10's 50,000 training images. The often-copied
// (0.2023, 0.1994, 0.2010) is the mean of per-image stds, not the dataset's std.
Normalization Normalization::cifar10() {
  return {{0.4914, 0.4822, 0.4465}, {0.2470, 0.2435, 0.2616}};
}

void Normalization::validate(int64_t channels) const {
  auto sizeOk = [&](size_t n) { return n == 1 || static_cast<int64_t>(n) == channels; };
  if (!sizeOk(mean.size()) || !sizeOk(std.size())) {
    throw DataOptionsError("normalization " + describe() + " does not fit " +
                           std::to_string(channels) + " channel(s): give 1 or " +
                           std::to_string(channels) + " values");
  }
  for (double s : std) {
    if (!(s > 0)) throw DataOptionsError("normalization std " + std::to_string(s) + " must be > 0");
  }
}

std::string Normalization::describe() const {
  auto list = [](const std::vector<double>& v) {
    std::ostringstream out;
    out << '(';
    for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
    out << ')';
    return out.str();
  };
  return "mean " + list(mean) + " std " + list(std);
}

Normalization computeNormalization(const torch::Tensor& images) {
  if (images.dim() < 2 || images.size(0) == 0) {
    throw DataOptionsError("computeNormalization needs images [N, C, ...] with N > 0");
  }
  torch::NoGradGuard noGrad;
  // Sums in double (60,000 x 784 values summed in float lose ~4 digits), a chunk at a time so that
  // a double copy of the whole dataset never exists.
  const int64_t n = images.size(0), channels = images.size(1);
  constexpr int64_t kChunk = 4096;
  auto sum = torch::zeros({channels}, torch::kDouble), squares = torch::zeros({channels}, torch::kDouble);
  for (int64_t start = 0; start < n; start += kChunk) {
    auto x = images.narrow(0, start, std::min(kChunk, n - start)).to(torch::kDouble);
    if (images.scalar_type() == torch::kByte) x.div_(255.0);
    auto perChannel = x.transpose(0, 1).reshape({channels, -1});
    sum += perChannel.sum(1);
    squares += perChannel.square().sum(1);
  }
  const double count = static_cast<double>(images.numel() / channels);
  auto mean = sum / count;
  auto std = (squares / count - mean.square()).clamp_min(0).sqrt();
  Normalization result;
  for (int64_t c = 0; c < channels; ++c) {
    result.mean.push_back(mean[c].item<double>());
    result.std.push_back(std[c].item<double>());
  }
  return result;
}

InMemoryDataset::InMemoryDataset(torch::Tensor inputs, torch::Tensor targets, DatasetInfo info)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), info_(std::move(info)) {
  if (!inputs_.defined() || !targets_.defined() || inputs_.dim() < 1 || targets_.dim() < 1) {
    throw DataOptionsError("dataset '" + info_.name + "': inputs and targets must be tensors [N, ...]");
  }
  if (inputs_.size(0) != targets_.size(0)) {
    throw DataOptionsError("dataset '" + info_.name + "': " + std::to_string(inputs_.size(0)) +
                           " inputs but " + std::to_string(targets_.size(0)) + " targets");
  }
  if (info_.normalization && inputs_.dim() >= 2) info_.normalization->validate(inputs_.size(1));
}

std::vector<int64_t> InMemoryDataset::sampleShape() const {
  auto sizes = inputs_.sizes();
  return {sizes.begin() + 1, sizes.end()};
}

InMemoryDataset InMemoryDataset::head(int64_t n) const {
  if (n < 0) throw DataOptionsError("head(" + std::to_string(n) + "): size must be >= 0");
  if (n >= size()) return *this;
  return InMemoryDataset(inputs_.narrow(0, 0, n), targets_.narrow(0, 0, n), info_);
}

void InMemoryDataset::checkIndices(const torch::Tensor& indices) const {
  if (!indices.defined() || indices.dim() != 1 || indices.scalar_type() != torch::kLong ||
      !indices.device().is_cpu()) {
    throw DataOptionsError("dataset '" + info_.name + "': indices must be a 1-D Long CPU tensor");
  }
  // index_select would throw too, but with a multi-line c10::Error; say it in one line. A scalar
  // scan of B integers costs less than the tensor ops that would do the same.
  auto idx = indices.contiguous();
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t n = size();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    if (p[i] < 0 || p[i] >= n) {
      throw DataOptionsError("dataset '" + info_.name + "': index " + std::to_string(p[i]) +
                             " out of range [0, " + std::to_string(n) + ")");
    }
  }
}

Batch InMemoryDataset::select(const torch::Tensor& indices) const {
  checkIndices(indices);
  Batch batch;
  batch.indices = indices;
  batch.inputs = inputs_.index_select(0, indices);
  batch.targets = targets_.index_select(0, indices);
  return batch;
}

Batch InMemoryDataset::select(const std::vector<int64_t>& indices) const {
  return select(indexTensor(indices));
}

torch::Tensor indexTensor(const std::vector<int64_t>& indices) {
  auto t = torch::empty({static_cast<int64_t>(indices.size())}, torch::kLong);
  std::copy(indices.begin(), indices.end(), t.data_ptr<int64_t>());
  return t;
}

} // namespace ctorch::data
