// Models by name for the trainer: linear, mnist-cnn, simple-cnn, resnet18, with one validated
// options struct. An unknown name is a one-line error listing the known ones.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <ctorch/models/model.hpp>

namespace ctorch::models {

// An invalid model name or option; the message names the bad value.
class ModelOptionsError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct ModelOptions {
  std::string name = "mnist-cnn";
  int64_t inChannels = 1;    // image models
  int64_t numClasses = 10;   // image models
  int64_t imageSize = 28;    // image models: height = width
  int64_t inFeatures = 20;   // linear
  int64_t outFeatures = 1;   // linear
  // Throws ModelOptionsError (unknown name, size out of range for the architecture, ...).
  void validate() const;
};

std::vector<std::string> modelNames();

// Validates the options and builds the model, initialised from torch's global generator (seed it
// with torch::manual_seed first for reproducible weights).
std::shared_ptr<Model> createModel(const ModelOptions& options);

} // namespace ctorch::models
