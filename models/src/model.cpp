#include <ctorch/models/model.hpp>

#include <fstream>

#include <torch/serialize.h>
#include <torch/torch.h>

namespace ctorch::models {

torch::OrderedDict<std::string, torch::Tensor> stateDict(const torch::nn::Module& module) {
  // Python's state_dict visits each module's own parameters, then its buffers, then recurses into
  // children; LibTorch's named_parameters/named_buffers each recurse separately. Walk the modules in
  // the same order as Python so that the keys come out in Python's order too.
  torch::OrderedDict<std::string, torch::Tensor> out;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      out.insert(prefix + p.key(), p.value());
    }
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false)) {
      out.insert(prefix + b.key(), b.value());
    }
  }
  return out;
}

int64_t parameterCount(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

} // namespace ctorch::models
