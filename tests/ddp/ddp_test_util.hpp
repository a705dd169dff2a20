// Small helpers shared by the ddp test sources: worker arguments, tensor bytes as hex, a port
// in the Slurm-derived range.
#pragma once

#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace ddptest {

// "key=value" worker arguments.
inline std::string arg(const std::vector<std::string>& args, const std::string& key, const std::string& fallback = "") {
  for (const auto& a : args)
    if (a.rfind(key + "=", 0) == 0) return a.substr(key.size() + 1);
  return fallback;
}

inline long argInt(const std::vector<std::string>& args, const std::string& key, long fallback) {
  auto v = arg(args, key);
  return v.empty() ? fallback : std::stol(v);
}

// The bytes of the module's parameters, as hex: two replicas print the same line iff bit-identical.
inline std::string paramsHex(const std::vector<torch::Tensor>& params) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (const auto& p : params) {
    auto c = p.detach().contiguous();
    auto* bytes = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < c.nbytes(); ++i) {
      out.push_back(digits[bytes[i] >> 4]);
      out.push_back(digits[bytes[i] & 15]);
    }
  }
  return out;
}

// A port in [20000, 31999] (contract::slurmDerivedPort's range, below the kernel's ephemeral range
// where no outgoing connection takes one), for rank 0 to host on; withFreshPort runs again with
// another when a server already holds it. Never probed by binding: a probe closes before use.
inline int portInSlurmRange() {
  static std::mt19937 gen(std::random_device{}());
  return std::uniform_int_distribution<int>(20000, 31999)(gen);
}

} // namespace ddptest
