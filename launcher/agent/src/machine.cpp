#include "ctorch/launcher/machine.hpp"

#include <unistd.h>

#include <cctype>
#include <climits>
#include <system_error>

namespace ctorch::launcher {

namespace fs = std::filesystem;

int countNvidiaDevices(const fs::path& procRoot, const fs::path& devRoot) {
  std::error_code ec;
  int n = 0;
  fs::path gpus = procRoot / "driver" / "nvidia" / "gpus";
  if (fs::is_directory(gpus, ec)) {
    for (const auto& e : fs::directory_iterator(gpus, ec)) {
      (void)e;
      ++n;
    }
    return n;
  }
  for (const auto& e : fs::directory_iterator(devRoot, ec)) {
    std::string name = e.path().filename().string();
    if (name.size() > 6 && name.rfind("nvidia", 0) == 0) {
      bool digits = true;
      for (std::size_t i = 6; i < name.size(); ++i)
        if (!std::isdigit(static_cast<unsigned char>(name[i]))) digits = false;
      if (digits) ++n;
    }
  }
  return n;
}

int visibleGpuCount(int physical, const std::optional<std::string>& cvd) {
  if (!cvd) return physical;
  if (physical <= 0) return 0;
  int n = 0;
  std::size_t start = 0;
  const std::string& s = *cvd;
  while (start <= s.size()) {
    std::size_t comma = s.find(',', start);
    std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(0, 1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    if (item.rfind("GPU-", 0) == 0 || item.rfind("MIG-", 0) == 0) {
      ++n;
    } else {
      bool digits = !item.empty() && item.size() < 9;
      for (char c : item)
        if (!std::isdigit(static_cast<unsigned char>(c))) digits = false;
      if (!digits) break;
      int idx = std::stoi(item);
      if (idx >= physical) break;
      ++n;
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return n;
}

int onlineCpuCount() {
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

std::string hostName() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

} // namespace ctorch::launcher
