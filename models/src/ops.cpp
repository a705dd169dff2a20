#include <ctorch/models/ops.hpp>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ctorch::models {

namespace {

bool fastPath(const at::Tensor& x) {
  return x.defined() && x.device().is_cpu() && x.layout() == at::kStrided && x.scalar_type() == at::kFloat &&
         x.dim() == 4 && x.is_contiguous() && x.size(2) >= 2 && x.size(3) >= 2 && x.numel() > 0 &&
         x.size(3) < (int64_t{1} << 30);
}

// One output: LibTorch's CPU max-pool kernel starts from the window's first position and takes a
// later element when `val > max || isnan(val)` (row-major order); the same rule gives the same
// index for ties and NaNs. `a` and `b` are the window's two input rows, r0/r1 their plane offsets.
inline void poolOne(const float* a, const float* b, int64_t r0, int64_t r1, int64_t j, float* out, int64_t* index) {
  const float v0 = a[2 * j], v1 = a[2 * j + 1], v2 = b[2 * j], v3 = b[2 * j + 1];
  float best = v0;
  int64_t at = r0 + 2 * j;
  if (v1 > best || std::isnan(v1)) { best = v1; at = r0 + 2 * j + 1; }
  if (v2 > best || std::isnan(v2)) { best = v2; at = r1 + 2 * j; }
  if (v3 > best || std::isnan(v3)) { best = v3; at = r1 + 2 * j + 1; }
  out[j] = best;
  index[j] = at;
}

// One output row of a plane. With SSE2, four outputs at a time, branch-free (on ReLU activations
// the comparisons are unpredictable, and a scalar loop was ten times slower: docs/performance.md).
void poolRow(const float* a, const float* b, int64_t r0, int64_t r1, int64_t w, int64_t ow, float* out, int64_t* index) {
  int64_t j = 0;
#if defined(__SSE2__)
  const __m128i one = _mm_set1_epi32(1), down = _mm_set1_epi32(static_cast<int>(w)),
                diag = _mm_set1_epi32(static_cast<int>(w + 1));
  // take(m, v, best, off, k): where m, best = v and off = k.
  auto take = [](__m128 m, __m128 v, __m128& best, __m128i k, __m128i& off) {
    best = _mm_or_ps(_mm_and_ps(m, v), _mm_andnot_ps(m, best));
    const __m128i mi = _mm_castps_si128(m);
    off = _mm_or_si128(_mm_and_si128(mi, k), _mm_andnot_si128(mi, off));
  };
  for (; j + 4 <= ow; j += 4) {
    const __m128 a0 = _mm_loadu_ps(a + 2 * j), a1 = _mm_loadu_ps(a + 2 * j + 4);
    const __m128 b0 = _mm_loadu_ps(b + 2 * j), b1 = _mm_loadu_ps(b + 2 * j + 4);
    const __m128 ae = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 ao = _mm_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 1, 3, 1));
    const __m128 be = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(2, 0, 2, 0));
    const __m128 bo = _mm_shuffle_ps(b0, b1, _MM_SHUFFLE(3, 1, 3, 1));
    __m128 best = ae;
    __m128i off = _mm_setzero_si128();
    take(_mm_or_ps(_mm_cmpgt_ps(ao, best), _mm_cmpunord_ps(ao, ao)), ao, best, one, off);
    take(_mm_or_ps(_mm_cmpgt_ps(be, best), _mm_cmpunord_ps(be, be)), be, best, down, off);
    take(_mm_or_ps(_mm_cmpgt_ps(bo, best), _mm_cmpunord_ps(bo, bo)), bo, best, diag, off);
    _mm_storeu_ps(out + j, best);
    alignas(16) std::int32_t offsets[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(offsets), off);
    const int64_t base = r0 + 2 * j;
    for (int k = 0; k < 4; ++k) index[j + k] = base + 2 * k + offsets[k];
  }
#else
  (void)w;
#endif
  for (; j < ow; ++j) poolOne(a, b, r0, r1, j, out, index);
}

// Values and int64 flat indices within each HxW plane, as at::max_pool2d_with_indices returns them.
std::pair<at::Tensor, at::Tensor> forwardKernel(const at::Tensor& x) {
  const int64_t planes = x.size(0) * x.size(1), h = x.size(2), w = x.size(3);
  const int64_t oh = h / 2, ow = w / 2;
  auto out = at::empty({x.size(0), x.size(1), oh, ow}, x.options());
  auto idx = at::empty({x.size(0), x.size(1), oh, ow}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  int64_t* id = idx.data_ptr<int64_t>();
  at::parallel_for(0, planes, 16, [=](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* plane = in + p * h * w;
      for (int64_t i = 0; i < oh; ++i) {
        const int64_t r0 = 2 * i * w, r1 = r0 + w;
        poolRow(plane + r0, plane + r1, r0, r1, w, ow, o + (p * oh + i) * ow, id + (p * oh + i) * ow);
      }
    }
  });
  return {out, idx};
}

class MaxPool2x2Function : public torch::autograd::Function<MaxPool2x2Function> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    auto [out, idx] = forwardKernel(x);
    ctx->save_for_backward({x, idx});
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {at::max_pool2d_with_indices_backward(grads[0], saved[0], {2, 2}, {2, 2}, {0, 0}, {1, 1},
                                                 /*ceil_mode=*/false, saved[1])};
  }
};

} // namespace

at::Tensor maxPool2x2(const at::Tensor& input) {
  if (!fastPath(input)) return torch::max_pool2d(input, 2);
  if (!torch::GradMode::is_enabled() || !input.requires_grad()) return forwardKernel(input).first;
  return MaxPool2x2Function::apply(input);
}

} // namespace ctorch::models
