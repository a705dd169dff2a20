// Batch transforms, vectorised over the batch: uint8 -> float in [0, 1], normalisation, and the
// CIFAR augmentation (random crop with zero padding, horizontal flip). The augmentation of a sample
// is a pure function of (seed, epoch, global sample index): a resumed run, other batch boundaries
// or another world size see exactly the same augmented samples.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/types.h>

#include <ctorch/data/dataset.hpp>

namespace ctorch::data {

// uint8 [B, ...] -> float [B, ...] / 255 (torchvision's ToTensor); float input is returned as is.
torch::Tensor toFloat(const torch::Tensor& inputs);

// (x - mean[c]) / std[c] over dimension 1 of float [B, C, ...] (or [B, F] with a single value).
torch::Tensor normalize(const torch::Tensor& inputs, const Normalization& normalization);

struct AugmentOptions {
  uint64_t seed = 0;          // the run's seed; each rank uses the same one (keys are global indices)
  int64_t padding = 4;        // crop offsets are uniform in [0, 2 * padding] in both directions
  bool randomCrop = true;
  bool horizontalFlip = true; // with probability 1/2
  // Throws DataOptionsError if padding < 0 or padding > 64.
  void validate() const;
};

// What the augmentation does to one sample.
struct CropFlip {
  int64_t top = 0;    // row offset into the padded image, in [0, 2 * padding]
  int64_t left = 0;   // column offset into the padded image
  bool flip = false;
};

class RandomCropFlip {
 public:
  explicit RandomCropFlip(AugmentOptions options);

  const AugmentOptions& options() const { return options_; }

  // The decision for one sample: a pure function of (seed, epoch, index).
  CropFlip decide(int64_t epoch, int64_t index) const;

  // Augments images [B, C, H, W] (any dtype) whose global sample indices are `indices` (Long [B]).
  // The padding takes the value `fill[c]` per channel (size 1 or C; empty means 0); pass the
  // normalised value of a zero pixel when the images are already normalised.
  torch::Tensor apply(const torch::Tensor& images, const torch::Tensor& indices, int64_t epoch,
                      const torch::Tensor& fill = {}) const;

 private:
  AugmentOptions options_;
};

// 64 well-mixed bits from (seed, a, b) by SplitMix64 (Steele et al., 2014); the building block of
// every deterministic decision in this library.
uint64_t mixBits(uint64_t seed, uint64_t a, uint64_t b);

} // namespace ctorch::data
