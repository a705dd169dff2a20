// Which kernels a multi-tensor optimizer runs: names, the dispatcher's answer on fused kernels, and
// the device-side step counts the fused kernels read.
#include "ctorch/optim.hpp"

#include <ATen/core/dispatch/Dispatcher.h>

namespace ctorch::optim {

std::string toString(Kernels kernels) {
  switch (kernels) {
    case Kernels::kAuto: return "auto";
    case Kernels::kFused: return "fused";
    case Kernels::kForEach: return "foreach";
    case Kernels::kPerParameter: return "per-parameter";
  }
  return "auto";
}

std::optional<Kernels> kernelsFromString(const std::string& text) {
  for (Kernels k : {Kernels::kAuto, Kernels::kFused, Kernels::kForEach, Kernels::kPerParameter})
    if (text == toString(k)) return k;
  if (text == "per_parameter") return Kernels::kPerParameter;
  return std::nullopt;
}

bool hasFusedKernel(const std::string& optimizer, c10::DeviceType device, at::ScalarType dtype) {
  const char* op = optimizer == "SGD"     ? "aten::_fused_sgd_"
                   : optimizer == "Adam"  ? "aten::_fused_adam_"
                   : optimizer == "AdamW" ? "aten::_fused_adamw_"
                                          : nullptr;
  if (!op) return false;
  // The kernels take float, double, half and bfloat16 (PyTorch's _get_fused_kernels_supported_devices
  // and its dtype check).
  if (dtype != at::kFloat && dtype != at::kDouble && dtype != at::kHalf && dtype != at::kBFloat16) return false;
  c10::DispatchKey key;
  if (device == c10::DeviceType::CPU) key = c10::DispatchKey::CPU;
  else if (device == c10::DeviceType::CUDA) key = c10::DispatchKey::CUDA;
  else return false;
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  return handle.has_value() && handle->hasKernelForDispatchKey(key);
}

namespace detail {

std::vector<at::Tensor> StepTensors::advance(const std::vector<at::Tensor>& params,
                                             const std::vector<std::int64_t>& steps) {
  std::vector<at::Tensor> out(params.size()), increment;
  for (std::size_t i = 0; i < params.size(); ++i) {
    Entry& e = entries_[params[i].unsafeGetTensorImpl()];
    if (e.tensor.defined() && e.value + 1 == steps[i] && e.tensor.device() == params[i].device()) {
      increment.push_back(e.tensor);
    } else {
      // A new parameter, or a state restored (or advanced) without this optimizer's step: the state's
      // count is the truth.
      e.tensor = at::full({}, static_cast<double>(steps[i]),
                          at::TensorOptions().dtype(at::kFloat).device(params[i].device()));
    }
    e.value = steps[i];
    out[i] = e.tensor;
  }
  if (!increment.empty()) at::_foreach_add_(increment, 1);
  return out;
}

} // namespace detail
} // namespace ctorch::optim
