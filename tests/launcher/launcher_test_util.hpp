// Helpers shared by the launcher tests: running ctorchrun and fake_worker, finding tagged
// processes in /proc, and the Python peer.
#pragma once

#include "multiproc.hpp"

#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher_test {

// CTORCH_TEST_CTORCHRUN runs the tests against another build (e.g. to see a new test fail on the
// binary from before a fix).
inline const char* ctorchrunBin() {
  const char* other = std::getenv("CTORCH_TEST_CTORCHRUN");
  return other && *other ? other : CTORCHRUN_BIN;
}
inline const char* fakeWorkerBin() { return FAKE_WORKER_BIN; }
inline std::string dataDir() { return LAUNCHER_TEST_DATA; }
inline const char* kSystemPython = "/usr/bin/python3";

// Runs ctorchrun with `args`; the launcher's own logs are at warn level unless args say otherwise.
// The timeout only ends a run that hangs (then killed, timedOut): nothing is expected to take long.
test::ProcessResult runCtorchrun(const std::vector<std::string>& args,
                                 const std::map<std::string, std::string>& env = {},
                                 std::chrono::milliseconds timeout = std::chrono::seconds(120));

test::SpawnOptions ctorchrunSpawn(const std::vector<std::string>& args,
                                  const std::map<std::string, std::string>& env = {},
                                  std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Processes whose environment holds CTORCH_TEST_MARK=<mark> (zombies excluded).
std::vector<int> processesMarked(const std::string& mark);
// Kills them (cleanup after a failed test).
void killMarked(const std::string& mark);
std::string uniqueMark(const std::string& tag);

// Lines of `output` that start with `prefix`.
std::vector<std::string> linesWith(const std::string& output, const std::string& prefix);

// "[default1]:ENV RANK=1" lines -> rank -> {KEY: VALUE}.
std::map<int, std::map<std::string, std::string>> envByRank(const std::string& output,
                                                            const std::string& role = "default");

// torchrun's own console output with its workers' lines made whole again. Its log tailer
// (torch/distributed/elastic/multiprocessing/tail_log.py) writes "<header><whatever readline() returned>",
// so a line the worker had only half written when it was read comes out as two pieces, each with the
// header, maybe with other ranks' lines between: "[default0]:ENV RANK=0[default0]:\n". Each piece is
// joined to the rest of its rank's line; torchrun's own lines (no header) pass through.
std::string rejoinTailedLines(const std::string& output, const std::string& role = "default");

// A TCP connection to 127.0.0.1:port (a raw store client in tests); -1 if it cannot connect.
int connectLoopback(int port);

// Lines a server-thread callback writes (a store's debugLog, the control plane's log), read on the
// test's thread.
class LogLines {
 public:
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(line);
    };
  }
  std::vector<std::string> all() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }
  // How many lines contain `text`.
  std::size_t count(const std::string& text) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::size_t n = 0;
    for (const auto& l : lines_) n += l.find(text) != std::string::npos;
    return n;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;
};

// Whether /usr/bin/python3 can import torch (cached).
bool pythonHasTorch();

// Polls `pred` every 5 ms until true or the deadline; returns its last value.
bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds deadline);

} // namespace ctorch::launcher_test
