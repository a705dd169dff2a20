// Small helpers shared by the ddp test sources: worker arguments, tensor bytes as hex, a free port
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

// A port in [20000, 31999] (contract::slurmDerivedPort's range) that was free a moment ago.
inline int freePortInSlurmRange() {
  std::mt19937 gen(static_cast<unsigned>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::uniform_int_distribution<int> pick(20000, 31999);
  for (int attempt = 0; attempt < 200; ++attempt) {
    int port = pick(gen);
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (ok) return port;
  }
  return -1;
}

} // namespace ddptest
