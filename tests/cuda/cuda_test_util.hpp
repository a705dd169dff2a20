// What the CUDA tests (tests/cuda) share: whether a GPU is there or the CPU stands in for it
// (CTORCH_CUDA_TESTS_ON_CPU=1), the device a rank uses, deterministic kernels, the workers' environment.
#pragma once

#include "ctorch_catch.hpp"

#include <ATen/Context.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace cudatest {

inline bool onCpuInstead() {
  const char* v = std::getenv("CTORCH_CUDA_TESTS_ON_CPU");
  return v && std::string(v) == "1";
}
inline bool haveCuda() { return torch::cuda::is_available(); }
inline int gpuCount() { return haveCuda() ? static_cast<int>(torch::cuda::device_count()) : 0; }

#define REQUIRE_GPU_OR_CPU_STAND_IN()                                                                     \
  do {                                                                                                   \
    if (!::cudatest::haveCuda() && !::cudatest::onCpuInstead())                                          \
      CTORCH_SKIP("no CUDA device is visible to this LibTorch");                                         \
  } while (false)
#define REQUIRE_GPU()                                                                                    \
  do {                                                                                                   \
    if (!::cudatest::haveCuda()) CTORCH_SKIP("no CUDA device is visible to this LibTorch");              \
  } while (false)

// cuda:LOCAL_RANK (cuda:0 when this process sees one GPU), or the CPU standing in for it.
inline torch::Device testDevice(int localRank = 0) {
  if (!haveCuda()) return torch::kCPU;
  const int n = gpuCount();
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(n == 1 ? 0 : localRank % n));
}

inline void deterministic() {
  at::globalContext().setDeterministicCuDNN(true);
  at::globalContext().setBenchmarkCuDNN(false);
}

inline std::map<std::string, std::string> workerEnv() {
  return {{"CUBLAS_WORKSPACE_CONFIG", ":4096:8"}, {"OMP_NUM_THREADS", "1"}};
}

inline std::string arg(const std::vector<std::string>& args, const std::string& key, const std::string& fallback) {
  for (const auto& a : args)
    if (a.rfind(key + "=", 0) == 0) return a.substr(key.size() + 1);
  return fallback;
}

// Two values (nested dicts, lists, tuples, tensors on any device), compared bit for bit; `why` says
// where the first difference is.
inline bool ivalueEqual(const c10::IValue& a, const c10::IValue& b, const std::string& where, std::string& why) {
  if (a.isTensor() && b.isTensor()) {
    const auto x = a.toTensor().to(torch::kCPU), y = b.toTensor().to(torch::kCPU);
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes() || !torch::equal(x, y)) {
      why = where + " differs";
      return false;
    }
    return true;
  }
  if (a.isGenericDict() && b.isGenericDict()) {
    auto da = a.toGenericDict(), db = b.toGenericDict();
    if (da.size() != db.size()) {
      why = where + " has " + std::to_string(da.size()) + " and " + std::to_string(db.size()) + " entries";
      return false;
    }
    for (const auto& e : da) {
      auto it = db.find(e.key());
      if (it == db.end()) {
        why = where + " lacks " + e.key().tagKind();
        return false;
      }
      std::ostringstream k;
      k << e.key();
      if (!ivalueEqual(e.value(), it->value(), where + "[" + k.str() + "]", why)) return false;
    }
    return true;
  }
  if (a.isList() && b.isList()) {
    auto la = a.toListRef(), lb = b.toListRef();
    if (la.size() != lb.size()) {
      why = where + " lengths differ";
      return false;
    }
    for (size_t i = 0; i < la.size(); ++i)
      if (!ivalueEqual(la[i], lb[i], where + "[" + std::to_string(i) + "]", why)) return false;
    return true;
  }
  if (a.isTuple() && b.isTuple()) {
    const auto& ta = a.toTupleRef().elements();
    const auto& tb = b.toTupleRef().elements();
    if (ta.size() != tb.size()) {
      why = where + " tuple lengths differ";
      return false;
    }
    for (size_t i = 0; i < ta.size(); ++i)
      if (!ivalueEqual(ta[i], tb[i], where + "(" + std::to_string(i) + ")", why)) return false;
    return true;
  }
  bool same = false;
  if (a.isInt() && b.isInt()) same = a.toInt() == b.toInt();
  else if (a.isDouble() && b.isDouble()) same = a.toDouble() == b.toDouble();
  else if (a.isBool() && b.isBool()) same = a.toBool() == b.toBool();
  else if (a.isString() && b.isString()) same = a.toStringRef() == b.toStringRef();
  else if (a.isNone() && b.isNone()) same = true;
  if (!same) why = where + " differs (" + a.tagKind() + ", " + b.tagKind() + ")";
  return same;
}

} // namespace cudatest
