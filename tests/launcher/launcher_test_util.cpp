#include "launcher_test_util.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <fstream>
#include <iterator>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

namespace ctorch::launcher_test {

test::SpawnOptions ctorchrunSpawn(const std::vector<std::string>& args,
                                  const std::map<std::string, std::string>& env,
                                  std::chrono::milliseconds timeout) {
  test::SpawnOptions so;
  so.argv = {ctorchrunBin()};
  bool hasLevel = false;
  for (const auto& a : args)
    if (a == "--log-level") hasLevel = true;
  if (!hasLevel) {
    so.argv.push_back("--log-level");
    so.argv.push_back("warn");
  }
  so.argv.insert(so.argv.end(), args.begin(), args.end());
  so.timeout = timeout;
  so.setEnv = env;
  // A test may itself run under a launcher or Slurm: start from a clean slate.
  so.unsetEnv = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "SPDLOG_LEVEL",
                 "PET_NPROC_PER_NODE", "PET_NNODES", "PET_MASTER_PORT", "PET_STANDALONE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES"};
  if (!env.count("PYTHON_EXEC")) so.setEnv["PYTHON_EXEC"] = kSystemPython;
  return so;
}

test::ProcessResult runCtorchrun(const std::vector<std::string>& args,
                                 const std::map<std::string, std::string>& env,
                                 std::chrono::milliseconds timeout) {
  return test::run(ctorchrunSpawn(args, env, timeout));
}

std::vector<int> processesMarked(const std::string& mark) {
  std::vector<int> out;
  const std::string needle = "CTORCH_TEST_MARK=" + mark;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    std::string base = "/proc/" + std::string(e->d_name);
    std::ifstream stat(base + "/stat");
    std::string statLine;
    std::getline(stat, statLine);
    auto close = statLine.rfind(')');
    if (close != std::string::npos && close + 2 < statLine.size() && statLine[close + 2] == 'Z') continue;
    std::ifstream env(base + "/environ", std::ios::binary);
    std::string content((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
    std::size_t pos = 0;
    while (pos < content.size()) {
      std::size_t nul = content.find('\0', pos);
      std::string entry = content.substr(pos, nul == std::string::npos ? std::string::npos : nul - pos);
      if (entry == needle) {
        out.push_back(static_cast<int>(pid));
        break;
      }
      if (nul == std::string::npos) break;
      pos = nul + 1;
    }
  }
  ::closedir(d);
  return out;
}

void killMarked(const std::string& mark) {
  for (int pid : processesMarked(mark)) ::kill(pid, SIGKILL);
}

std::string uniqueMark(const std::string& tag) {
  static std::atomic<int> counter{0};
  std::random_device rd;
  return tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++) + "-" +
         std::to_string(rd() % 100000);
}

std::vector<std::string> linesWith(const std::string& output, const std::string& prefix) {
  std::vector<std::string> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) out.push_back(line);
  return out;
}

std::map<int, std::map<std::string, std::string>> envByRank(const std::string& output,
                                                            const std::string& role) {
  std::map<int, std::map<std::string, std::string>> out;
  std::istringstream in(output);
  std::string line;
  const std::string open = "[" + role;
  while (std::getline(in, line)) {
    if (line.rfind(open, 0) != 0) continue;
    auto close = line.find("]:");
    if (close == std::string::npos) continue;
    int rank = std::stoi(line.substr(open.size(), close - open.size()));
    std::string rest = line.substr(close + 2);
    if (rest.rfind("ENV ", 0) != 0) continue;
    auto eq = rest.find('=');
    out[rank][rest.substr(4, eq - 4)] = rest.substr(eq + 1);
  }
  return out;
}

std::string rejoinTailedLines(const std::string& output, const std::string& role) {
  const std::regex header("\\[" + role + "([0-9]+)\\]:");
  std::map<int, std::string> pending;  // a rank's line so far, until its '\n' comes
  std::string out;
  auto it = std::sregex_iterator(output.begin(), output.end(), header);
  const auto end = std::sregex_iterator();
  if (it == end) return output;
  out.append(output, 0, static_cast<std::size_t>(it->position()));
  for (; it != end; ++it) {
    const int rank = std::stoi((*it)[1].str());
    const std::size_t from = static_cast<std::size_t>(it->position() + it->length());
    auto next = std::next(it);
    const std::size_t to = next == end ? output.size() : static_cast<std::size_t>(next->position());
    // One tailer write is a header and at most one line: what follows its '\n' is torchrun's own.
    const std::size_t nl = output.find('\n', from);
    if (nl == std::string::npos || nl >= to) {
      pending[rank].append(output, from, to - from);
    } else {
      out.append(it->str()).append(pending[rank]).append(output, from, nl + 1 - from);
      pending[rank].clear();
      out.append(output, nl + 1, to - nl - 1);
    }
  }
  for (auto& [rank, rest] : pending)
    if (!rest.empty()) out.append("[" + role + std::to_string(rank) + "]:").append(rest).push_back('\n');
  return out;
}

int connectLoopback(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool pythonHasTorch() {
  static int cached = -1;
  if (cached < 0) {
    test::SpawnOptions so;
    so.argv = {kSystemPython, "-c", "import torch.distributed"};
    so.timeout = std::chrono::seconds(180);  // a slow import on a busy machine is not "no torch"
    cached = test::run(so).ok() ? 1 : 0;
  }
  return cached == 1;
}

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds deadline) {
  auto end = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= end) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

} // namespace ctorch::launcher_test
