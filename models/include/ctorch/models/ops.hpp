// Faster CPU kernels for layers the seeds' models use, computing exactly what LibTorch's own do.
#pragma once

#include <ATen/core/Tensor.h>

namespace ctorch::models {

// max_pool2d with a 2x2 window and stride 2 (no padding, floor mode): the same values, the same
// argmax indices and therefore the same gradients, bit for bit, as torch::max_pool2d(x, 2) —
// including its tie-breaking (the first maximum in row-major window order) and NaN propagation.
// For a contiguous float32 NCHW CPU tensor it runs its own forward kernel, many times faster than
// LibTorch 1.13's (docs/performance.md has the figures); the backward is
// LibTorch's max_pool2d_with_indices_backward on those indices. Anything else (other dtypes,
// devices, layouts, 3-d input) goes to torch::max_pool2d unchanged.
at::Tensor maxPool2x2(const at::Tensor& input);

} // namespace ctorch::models
