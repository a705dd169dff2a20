#include <ctorch/models/linear.hpp>

#include <torch/torch.h>

namespace ctorch::models {

LinearRegression::LinearRegression(int64_t inFeatures, int64_t outFeatures) : Model("LinearRegression") {
  // Borrow nn.Linear's initialisation (kaiming-uniform weight, uniform bias), keep only its tensors.
  torch::nn::Linear init(inFeatures, outFeatures);
  weight = register_parameter("weight", init->weight.detach().clone());
  bias = register_parameter("bias", init->bias.detach().clone());
}

torch::Tensor LinearRegression::forward(torch::Tensor input) {
  return torch::nn::functional::linear(input, weight, bias);
}

} // namespace ctorch::models
