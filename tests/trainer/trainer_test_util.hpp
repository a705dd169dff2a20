// Helpers of the trainer tests: running the real ctorch-train (alone or under the real ctorchrun),
// finding one worker's pid, waiting for a line of output, and comparing saved weights bit for bit.
#pragma once

#include "multiproc.hpp"

#include "ctorch_catch.hpp"
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

namespace traintest {

namespace fs = std::filesystem;
using ctorch::test::Process;
using ctorch::test::ProcessResult;
using ctorch::test::SpawnOptions;

inline const char* trainExe() { return CTORCH_TRAIN_EXE; }
inline const char* launcherExe() { return CTORCHRUN_EXE; }

// Environment of a process started outside any launcher: no torchrun/Slurm variables inherited from
// the test's own environment (CTest may run under Slurm or torchrun).
inline std::vector<std::string> launcherVariables() {
  return {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
          "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_ERROR_FILE",
          "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID", "OMP_NUM_THREADS"};
}

// ctorch-train alone (a world of 1) in `dir`.
inline SpawnOptions trainAlone(const fs::path& dir, std::vector<std::string> args,
                               std::chrono::seconds timeout = std::chrono::seconds(120)) {
  SpawnOptions o;
  o.argv = {trainExe()};
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.unsetEnv = launcherVariables();
  o.setEnv["OMP_NUM_THREADS"] = "1";
  o.cwd = dir;
  o.timeout = timeout;
  return o;
}

// Launcher flags for a test whose workers are to stop gracefully (SIGTERM: save, exit 75): a grace
// period no loaded machine outlasts, so that a slow save is never cut short by SIGKILL. Such a test
// also checks that the launcher never said "grace period over".
inline std::vector<std::string> gracefulStop(std::vector<std::string> launcherArgs = {}) {
  launcherArgs.insert(launcherArgs.end(), {"--shutdown-timeout", "120"});
  return launcherArgs;
}

// ctorch-train under `ctorchrun --standalone --nproc-per-node N [launcherArgs] ctorch-train args`.
// The launcher's grace period between SIGTERM and SIGKILL is short (3 s) unless launcherArgs give
// one (gracefulStop()): tests stop and kill workers on purpose.
inline SpawnOptions trainUnderLauncher(const fs::path& dir, int nproc, std::vector<std::string> args,
                                       std::vector<std::string> launcherArgs = {},
                                       std::chrono::seconds timeout = std::chrono::seconds(150)) {
  SpawnOptions o;
  o.argv = {launcherExe(), "--standalone", "--nproc-per-node", std::to_string(nproc), "--log-dir",
            (dir / "launcher-logs").string()};
  if (std::find(launcherArgs.begin(), launcherArgs.end(), "--shutdown-timeout") == launcherArgs.end())
    o.argv.insert(o.argv.end(), {"--shutdown-timeout", "3"});
  o.argv.insert(o.argv.end(), launcherArgs.begin(), launcherArgs.end());
  o.argv.push_back(trainExe());
  o.argv.insert(o.argv.end(), args.begin(), args.end());
  o.unsetEnv = launcherVariables();
  o.cwd = dir;
  o.timeout = timeout;
  return o;
}

inline std::string show(const ProcessResult& r) { return r.describe() + "\n--- output ---\n" + r.output; }

// The state dict a run wrote (ctorch::saveStateDict / torch.save format), in file order.
inline std::vector<std::pair<std::string, at::Tensor>> loadWeights(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  REQUIRE(in);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto value = torch::jit::pickle_load(bytes);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : value.toGenericDict()) out.emplace_back(item.key().toStringRef(), item.value().toTensor());
  return out;
}

// Exact equality of names, dtypes, shapes and every bit; returns what differs ("" when identical).
inline std::string bitDifference(const fs::path& a, const fs::path& b) {
  const auto x = loadWeights(a), y = loadWeights(b);
  if (x.size() != y.size()) return "different numbers of tensors";
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i].first != y[i].first) return "names differ: " + x[i].first + " vs " + y[i].first;
    const auto& s = x[i].second;
    const auto& t = y[i].second;
    if (s.dtype() != t.dtype() || s.sizes() != t.sizes()) return x[i].first + ": dtype or shape differs";
    const auto sc = s.contiguous(), tc = t.contiguous();
    if (std::memcmp(sc.data_ptr(), tc.data_ptr(), sc.nbytes()) != 0) {
      const double diff = (s.to(torch::kDouble) - t.to(torch::kDouble)).abs().max().item<double>();
      return x[i].first + " differs (max abs difference " + std::to_string(diff) + ")";
    }
  }
  return "";
}

// Waits until the output so far matches `pattern` (returns the match) or the process ends / the
// time runs out (returns nullopt).
inline std::optional<std::smatch> waitForOutput(Process& p, const std::regex& pattern, std::chrono::seconds timeout,
                                                std::string* seen = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  static thread_local std::string text;
  while (std::chrono::steady_clock::now() < deadline) {
    text = p.outputSoFar();
    std::smatch m;
    if (std::regex_search(text, m, pattern)) {
      if (seen) *seen = text;
      return m;
    }
    if (!p.running()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (seen) *seen = p.outputSoFar();
  return std::nullopt;
}

// The pid of the ctorch-train process with RANK=rank running in directory `cwd` (unique to the
// test), or -1.
inline int findWorkerPid(const fs::path& cwd, int rank) {
  std::error_code ec;
  const fs::path wanted = fs::canonical(cwd, ec);
  DIR* proc = opendir("/proc");
  if (!proc) return -1;
  int found = -1;
  while (dirent* e = readdir(proc)) {
    const int pid = std::atoi(e->d_name);
    if (pid <= 0) continue;
    std::ifstream cmd("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(cmd)), std::istreambuf_iterator<char>());
    if (cmdline.find("ctorch-train") == std::string::npos || cmdline.find("ctorchrun") != std::string::npos) continue;
    if (fs::read_symlink("/proc/" + std::to_string(pid) + "/cwd", ec) != wanted) continue;
    std::ifstream env("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
    std::string environ((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
    if (environ.find(std::string("\0RANK=", 6) + std::to_string(rank) + '\0') != std::string::npos ||
        environ.rfind("RANK=" + std::to_string(rank) + '\0', 0) == 0) {
      found = pid;
      break;
    }
  }
  closedir(proc);
  return found;
}

inline int countMatches(const std::string& text, const std::regex& pattern) {
  return static_cast<int>(std::distance(std::sregex_iterator(text.begin(), text.end(), pattern), std::sregex_iterator()));
}

inline bool havePythonTorch() {
  SpawnOptions o;
  o.argv = {"/usr/bin/python3", "-c", "import torch"};
  o.timeout = std::chrono::seconds(60);
  return access("/usr/bin/python3", X_OK) == 0 && ctorch::test::run(o).ok();
}

inline bool haveFashionMnist() {
  return fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
}

// The trainer tests' argument set: a linear model on 512 synthetic samples, 16 a batch (seconds a
// run). `with(kToy, {...})` adds to one.
const std::vector<std::string> kToy = {"--model", "linear", "--dataset", "synthetic-regression",
                                       "--synthetic-size", "512", "--batch-size", "16", "--test-limit", "64",
                                       "--log-interval", "4", "--lr", "0.05"};

inline std::vector<std::string> with(std::vector<std::string> base, const std::vector<std::string>& more) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

}  // namespace traintest
