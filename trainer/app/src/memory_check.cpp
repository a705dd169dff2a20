#include "ctorch/train/memory_check.hpp"

#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace ctorch::train {

namespace {

std::optional<std::int64_t> readNumberFile(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return std::nullopt;
  try {
    return static_cast<std::int64_t>(std::stoll(text));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The cgroup limit less its usage, v2 ("0::/path") or v1 (the memory controller's line).
std::optional<std::int64_t> cgroupHeadroom() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find(':'), second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
    std::optional<std::int64_t> limit, usage;
    if (line.rfind("0::", 0) == 0) {
      limit = readNumberFile("/sys/fs/cgroup" + path + "/memory.max");
      usage = readNumberFile("/sys/fs/cgroup" + path + "/memory.current");
    } else if (controllers.find("memory") != std::string::npos) {
      limit = readNumberFile("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes");
      usage = readNumberFile("/sys/fs/cgroup/memory" + path + "/memory.usage_in_bytes");
    }
    // v1 reports "no limit" as a huge number; anything above 2^60 is no limit.
    if (limit && usage && *limit < (std::int64_t{1} << 60)) return std::max<std::int64_t>(0, *limit - *usage);
  }
  return std::nullopt;
}

}  // namespace

std::int64_t batchBytesPerRank(const BatchMemoryInputs& in) {
  const std::int64_t perSample = in.inputBytes * (2 + in.prefetch) + in.activationBytes;
  return in.batchSize * perSample;
}

std::string formatBytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, ++u;
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buffer;
}

std::string checkBatchSize(const BatchMemoryInputs& in) {
  const std::string value = "--batch-size '" + std::to_string(in.batchSize) + "'";
  if (in.shardSize > 0 && in.batchSize > in.shardSize)
    return value + " is larger than this rank's share of the training set (" + std::to_string(in.shardSize) +
           " of " + std::to_string(in.datasetSize) + " samples over " + std::to_string(in.worldSize) +
           (in.worldSize == 1 ? " rank" : " ranks") + "): use at most " + std::to_string(in.shardSize);
  if (!in.availableBytes) return "";
  const std::int64_t perSample = in.inputBytes * (2 + in.prefetch) + in.activationBytes;
  const std::int64_t need = batchBytesPerRank(in) * in.localRanks;
  if (perSample <= 0 || need <= *in.availableBytes) return "";
  std::ostringstream os;
  os << value << " needs about " << formatBytes(need) << " of memory ("
     << formatBytes(in.inputBytes) << " of input x " << (2 + in.prefetch) << " copies";
  if (in.activationBytes > 0) os << " + " << formatBytes(in.activationBytes) << " of activations";
  os << " per sample";
  if (in.localRanks > 1) os << ", x " << in.localRanks << " ranks on this node";
  os << "), but " << formatBytes(*in.availableBytes) << " is available (" << in.availableSource
     << "): use at most --batch-size " << std::max<std::int64_t>(1, *in.availableBytes / (perSample * in.localRanks))
     << ", with --grad-accum-steps for a larger effective batch";
  return os.str();
}

std::optional<std::int64_t> parseMemAvailable(const std::string& meminfo) {
  std::istringstream in(meminfo);
  std::string line;
  while (std::getline(in, line)) {
    long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %lld kB", &kib) == 1) return static_cast<std::int64_t>(kib) * 1024;
  }
  return std::nullopt;
}

std::optional<std::int64_t> availableMemory(std::string& source) {
  std::ifstream in("/proc/meminfo");
  std::stringstream text;
  text << in.rdbuf();
  auto available = parseMemAvailable(text.str());
  if (available) source = "MemAvailable";
  if (const auto cgroup = cgroupHeadroom(); cgroup && (!available || *cgroup < *available)) {
    available = cgroup;
    source = "cgroup memory limit less usage";
  }
  return available;
}

std::optional<std::int64_t> heapBytesInUse() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 m = mallinfo2();
  return static_cast<std::int64_t>(m.uordblks + m.hblkhd);
#else
  return std::nullopt;
#endif
}

}  // namespace ctorch::train
