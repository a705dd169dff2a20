#include <ctorch/data/transforms.hpp>

#include <torch/torch.h>

#include <ctorch/data/error.hpp>
#include <ctorch/mix_bits.hpp>

namespace ctorch::data {
namespace {

// mean/std as a float tensor broadcasting over [B, C, ...].
torch::Tensor channelTensor(const std::vector<double>& values, int64_t dims) {
  std::vector<float> v(values.begin(), values.end());
  auto t = torch::tensor(v, torch::kFloat);
  std::vector<int64_t> shape(static_cast<size_t>(std::max<int64_t>(dims, 2)), 1);
  shape[1] = t.numel();
  return t.view(shape);
}

}  // namespace

uint64_t mixBits(uint64_t seed, uint64_t a, uint64_t b) { return ctorch::mixBits(seed, a, b); }

torch::Tensor toFloat(const torch::Tensor& inputs) {
  if (inputs.scalar_type() == torch::kByte) return inputs.to(torch::kFloat).div_(255);
  return inputs;
}

torch::Tensor normalize(const torch::Tensor& inputs, const Normalization& normalization) {
  if (inputs.dim() < 2) throw DataOptionsError("normalize needs inputs [B, C, ...]");
  normalization.validate(inputs.size(1));
  auto mean = channelTensor(normalization.mean, inputs.dim());
  auto std = channelTensor(normalization.std, inputs.dim());
  // Same two operations as torchvision's Normalize (sub_ then div_), so results match bit for bit.
  return inputs.sub(mean).div_(std);
}

void AugmentOptions::validate() const {
  if (padding < 0 || padding > 64) {
    throw DataOptionsError("augmentation padding " + std::to_string(padding) +
                           " must be in [0, 64]");
  }
}

RandomCropFlip::RandomCropFlip(AugmentOptions options) : options_(options) { options_.validate(); }

CropFlip RandomCropFlip::decide(int64_t epoch, int64_t index) const {
  uint64_t bits = mixBits(options_.seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(index));
  const uint64_t span = 2 * static_cast<uint64_t>(options_.padding) + 1;
  CropFlip d;
  // Disjoint 16-bit fields; the modulo bias (at most 17 in 65536) is irrelevant for augmentation.
  if (options_.randomCrop) {
    d.top = static_cast<int64_t>((bits & 0xffff) % span);
    d.left = static_cast<int64_t>(((bits >> 16) & 0xffff) % span);
  } else {
    d.top = d.left = options_.padding;
  }
  d.flip = options_.horizontalFlip && ((bits >> 32) & 1) != 0;
  return d;
}

torch::Tensor RandomCropFlip::apply(const torch::Tensor& images, const torch::Tensor& indices,
                                    int64_t epoch, const torch::Tensor& fill) const {
  if (images.dim() != 4) {
    throw DataOptionsError("crop/flip augmentation needs images [B, C, H, W], got " +
                           c10::str(images.sizes()));
  }
  const int64_t b = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  if (indices.dim() != 1 || indices.size(0) != b) {
    throw DataOptionsError("crop/flip augmentation: " + std::to_string(indices.numel()) +
                           " indices for " + std::to_string(b) + " images");
  }
  if (b == 0) return images;
  const int64_t p = options_.padding, hp = h + 2 * p, wp = w + 2 * p;

  // The per-sample decisions are scalar arithmetic; everything on pixels is batched.
  auto top = torch::empty({b}, torch::kLong), left = torch::empty({b}, torch::kLong),
       flip = torch::empty({b}, torch::kBool);
  auto idx = indices.contiguous().to(torch::kLong);
  const int64_t* ip = idx.data_ptr<int64_t>();
  auto* tp = top.data_ptr<int64_t>();
  auto* lp = left.data_ptr<int64_t>();
  auto* fp = flip.data_ptr<bool>();
  for (int64_t i = 0; i < b; ++i) {
    auto d = decide(epoch, ip[i]);
    tp[i] = d.top;
    lp[i] = d.left;
    fp[i] = d.flip;
  }

  // Padded canvas [B, C, hp, wp] filled per channel, the images in its centre.
  auto padded = torch::empty({b, c, hp, wp}, images.options());
  if (fill.defined() && fill.numel() > 0) {
    if (fill.numel() != 1 && fill.numel() != c) {
      throw DataOptionsError("crop/flip fill has " + std::to_string(fill.numel()) +
                             " values for " + std::to_string(c) + " channels");
    }
    padded.copy_(fill.to(images.scalar_type()).reshape({1, -1, 1, 1}).expand({b, c, hp, wp}));
  } else {
    padded.zero_();
  }
  padded.narrow(2, p, h).narrow(3, p, w).copy_(images);

  // Source position of each output pixel in the flattened padded image:
  // (top + i) * wp + left + (flip ? w - 1 - j : j).
  auto rows = top.view({b, 1}) + torch::arange(h, torch::kLong).view({1, h});      // [B, H]
  auto j = torch::arange(w, torch::kLong).view({1, w});
  auto cols = left.view({b, 1}) + torch::where(flip.view({b, 1}), (w - 1) - j, j);  // [B, W]
  auto source = (rows.view({b, h, 1}) * wp + cols.view({b, 1, w})).view({b, 1, h * w});
  auto out = padded.view({b, c, hp * wp}).gather(2, source.expand({b, c, h * w}));
  return out.view({b, c, h, w});
}

} // namespace ctorch::data
