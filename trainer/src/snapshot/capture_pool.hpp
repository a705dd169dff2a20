// Buffers reused from one snapshot capture to the next (ResilienceOptions::reuseCaptureBuffers).
// Private to the library. While a CapturePoolScope is alive on a thread, captureSnapshot's copies
// on that thread go into the pool's tensors, in capture order, when the shape and type match and
// nothing else holds the buffer any more (the previous snapshot's write finished); otherwise a
// fresh copy is made and kept for the next time.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace ctorch::detail {

struct CapturePool {
  std::vector<at::Tensor> tensors;
};

class CapturePoolScope {
 public:
  explicit CapturePoolScope(CapturePool* pool);  // null: no reuse (a no-op scope)
  ~CapturePoolScope();
  CapturePoolScope(const CapturePoolScope&) = delete;
  CapturePoolScope& operator=(const CapturePoolScope&) = delete;

 private:
  CapturePool* previous_;
  std::size_t previousNext_;
};

} // namespace ctorch::detail
