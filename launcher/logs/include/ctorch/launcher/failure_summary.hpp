// The end-of-run failure report: reading a worker's TORCHELASTIC_ERROR_FILE (torchrun's JSON
// schema, both forms) and the table ctorchrun prints on stderr, the first failure marked as the
// root cause. Pure formatting; the agent collects the records.
#pragma once

#include "ctorch/launcher/exit_status.hpp"

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::launcher {

struct ErrorFileInfo {
  std::string message;    // first line is what the table shows
  std::string callstack;  // extraInfo.py_callstack, if any
  std::optional<std::chrono::system_clock::time_point> timestamp;
  bool timestampHasMillis = false;  // torchrun writes whole seconds: shown without a fraction
  bool retryNever = false;          // extraInfo.ctorch_retry == "never" (contract::error_file::kRetry)
};

// Reads an error file; nullopt when it does not exist or cannot be parsed (a worker that dies
// while writing it must not break the summary).
std::optional<ErrorFileInfo> readErrorFile(const std::filesystem::path& path);

struct FailureRecord {
  int globalRank = 0;
  int localRank = 0;
  std::string host;
  pid_t pid = 0;
  ExitStatus status;
  std::chrono::system_clock::time_point time;
  std::filesystem::path errorFile;
  std::optional<ErrorFileInfo> error;
};

struct FailureReport {
  std::string program;
  bool python = false;    // the program runs under Python (the hint for a missing error file)
  std::string runId;
  int attempt = 0;        // restart count of the failed attempt
  int maxRestarts = 0;
  int numWorkers = 0;
  int stoppedByAgent = 0; // workers stopped because another one failed
  std::vector<FailureRecord> failures;  // in the order observed; [0] is the root cause
};

// "2024-05-01 12:00:00.123" in local time ("2024-05-01 12:00:00" without millis).
std::string formatTime(std::chrono::system_clock::time_point t, bool millis = true);

std::string formatFailureSummary(const FailureReport& report);

} // namespace ctorch::launcher
