// The common base of every model here, so a trainer and DistributedDataParallel can hold any of them
// as one type, plus the state-dict helpers that make their weights readable from Python.
#pragma once

#include <filesystem>
#include <string>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

namespace ctorch::models {

// What forward() returns, so a trainer picks the loss: cross entropy on logits, NLL on
// log-probabilities, MSE on values.
enum class ModelOutput { Logits, LogProbabilities, Values };

class Model : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual torch::Tensor forward(torch::Tensor input) = 0;
  virtual ModelOutput output() const = 0;
  // The model as a sequence of its own modules (sharing their parameters and buffers; the functional
  // steps of forward() as torch::nn::Functional), whose forward is forward()'s, bit for bit: what a
  // pipeline cuts into stages (ctorch::pipelineSplit). Its children are named by their place in it
  // ("3.weight"). An empty holder (Sequential(nullptr)) when the model is not such a sequence.
  virtual torch::nn::Sequential sequential() { return torch::nn::Sequential(nullptr); }
};

// Parameters and buffers by their dotted names, in registration order: the keys of Python's
// module.state_dict() for the same architecture.
torch::OrderedDict<std::string, torch::Tensor> stateDict(const torch::nn::Module& module);

// Number of elements of all parameters (trainable or not).
int64_t parameterCount(const torch::nn::Module& module);

} // namespace ctorch::models
