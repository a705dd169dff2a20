#include <ctorch/models/registry.hpp>

#include <algorithm>

#include <ctorch/models/linear.hpp>
#include <ctorch/models/mnist_cnn.hpp>
#include <ctorch/models/resnet.hpp>
#include <ctorch/models/simple_cnn.hpp>

namespace ctorch::models {
namespace {

void requireRange(const std::string& model, const char* what, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    throw ModelOptionsError("model '" + model + "': " + what + " " + std::to_string(value) +
                            " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
}

}  // namespace

std::vector<std::string> modelNames() { return {"linear", "mnist-cnn", "simple-cnn", "resnet18"}; }

void ModelOptions::validate() const {
  auto names = modelNames();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    std::string known;
    for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
    throw ModelOptionsError("unknown model '" + name + "' (known: " + known + ")");
  }
  constexpr int64_t kMaxSize = 1 << 20;
  if (name == "linear") {
    requireRange(name, "in features", inFeatures, 1, kMaxSize);
    requireRange(name, "out features", outFeatures, 1, kMaxSize);
    return;
  }
  requireRange(name, "input channels", inChannels, 1, 1024);
  requireRange(name, "classes", numClasses, 1, kMaxSize);
  // The smallest input each architecture's fixed convolutions and pools leave non-empty.
  const int64_t minSize = name == "mnist-cnn" ? 6 : name == "simple-cnn" ? 16 : 1;
  requireRange(name, "image size", imageSize, minSize, 4096);
}

std::shared_ptr<Model> createModel(const ModelOptions& o) {
  o.validate();
  if (o.name == "linear") return std::make_shared<LinearRegression>(o.inFeatures, o.outFeatures);
  if (o.name == "mnist-cnn") return std::make_shared<MnistCnn>(o.inChannels, o.numClasses, o.imageSize);
  if (o.name == "simple-cnn") {
    return std::make_shared<SimpleConvNet>(o.inChannels, o.numClasses, o.imageSize);
  }
  return std::make_shared<ResNet18>(o.inChannels, o.numClasses);
}

} // namespace ctorch::models
