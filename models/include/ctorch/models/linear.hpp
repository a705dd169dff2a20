// The torchrun tutorial's model: torch.nn.Linear(20, 1). Its parameters are registered directly as
// `weight` and `bias`, the state-dict keys of a bare nn.Linear in Python.
#pragma once

#include <ctorch/models/model.hpp>

namespace ctorch::models {

class LinearRegression : public Model {
 public:
  LinearRegression(int64_t inFeatures = 20, int64_t outFeatures = 1);
  torch::Tensor forward(torch::Tensor input) override;  // [B, in] -> [B, out]
  ModelOutput output() const override { return ModelOutput::Values; }

  torch::Tensor weight, bias;
};

} // namespace ctorch::models
