// Channels-last (NHWC) memory format for convolutional models: the layout the fastest convolution
// kernels of cuDNN (and of oneDNN on the CPU) work in. Python writes model.to(memory_format=
// torch.channels_last) and x.to(memory_format=...); LibTorch's Module::to has no such overload.
#pragma once

#include <c10/core/MemoryFormat.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstddef>

namespace ctorch {

// Converts every 4-D parameter and buffer of `module` and its descendants (convolution weights;
// everything else is left as is), and the gradient of such a parameter if it has one, to `format`,
// in place: each keeps its Tensor object (set_data), so references already held (an optimizer's
// parameter list) stay valid and see the new layout. Values are unchanged. Returns how many tensors
// it converted (0: nothing in `module` is 4-D, and `format` makes no difference to it).
//
// When to call it:
// - before wrapping the module in DistributedDataParallel. DDP's Reducer lays each gradient's view
//   of its bucket out after the parameter's strides when it is built; parameters converted later
//   still get the right gradients, but each one is then copied into a bucket view of the other
//   layout at every step.
// - before the optimizer's first step, so that its state (momentum, Adam's moments: made like the
//   parameters) is in the same layout; an optimizer built earlier is fine.
// - not with FullyShardedDataParallel (nor before it): FSDP keeps each unit's parameters as views of
//   one flat contiguous buffer, which undoes the conversion, and converting afterwards would cut the
//   parameters off their shards.
// Snapshots are unaffected: they hold contiguous copies, and restoring copies values into whatever
// layout the parameters have, so a snapshot of either layout resumes in either.
std::size_t toMemoryFormat(torch::nn::Module& module, at::MemoryFormat format);

// `tensor` in `format` when it is 4-D (a batch of images), else `tensor` itself: what a converted
// model's input goes through each step (x.to(memory_format=...) in Python). No copy when it is in
// that format already.
at::Tensor toMemoryFormat(const at::Tensor& tensor, at::MemoryFormat format);

// Whether `module` holds a 4-D parameter or buffer: the models channels-last applies to.
bool hasFourDimensionalTensors(const torch::nn::Module& module);

// "contiguous", "channels-last" or "channels-last-3d" (Preserve: "preserve"), as flags spell them.
const char* memoryFormatName(at::MemoryFormat format);

}  // namespace ctorch
