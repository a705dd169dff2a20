#include "ctorch/launcher/machine.hpp"

#include "ctorch/text/text.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <climits>
#include <chrono>
#include <system_error>
#include <thread>

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
  for (const auto& piece : text::split(*cvd, ',')) {
    const std::string item(text::trim(piece, text::kWhiteSpace));
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

bool pythonFindsTorch(const std::string& python) {
  const char* code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') else 1)";
  pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, STDIN_FILENO);
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
    }
    ::execl(python.c_str(), python.c_str(), "-c", code, static_cast<char*>(nullptr));
    _exit(127);
  }
  // A broken interpreter must not hang ctorchrun's start: 10 s, then it counts as "no torch".
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (r < 0 && errno != EINTR) return false;
    if (std::chrono::steady_clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

} // namespace ctorch::launcher
