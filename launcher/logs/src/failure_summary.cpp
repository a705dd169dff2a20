#include "ctorch/launcher/failure_summary.hpp"

#include "ctorch/contract/worker_contract.hpp"

#include <nlohmann/json.hpp>

#include <cmath>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <sstream>

namespace ctorch::launcher {

namespace {

std::string firstLine(const std::string& s) {
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

std::string pad(const std::string& s, std::size_t width) {
  return s.size() >= width ? s : s + std::string(width - s.size(), ' ');
}

} // namespace

std::optional<ErrorFileInfo> readErrorFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  nlohmann::json j;
  try {
    in >> j;
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (!j.is_object() || !j.contains("message")) return std::nullopt;
  ErrorFileInfo info;
  const auto& m = j["message"];
  if (m.is_string()) {
    info.message = m.get<std::string>();
  } else if (m.is_object()) {
    if (m.contains("message") && m["message"].is_string()) info.message = m["message"].get<std::string>();
    if (m.contains("extraInfo") && m["extraInfo"].is_object()) {
      const auto& x = m["extraInfo"];
      if (x.contains("py_callstack") && x["py_callstack"].is_string())
        info.callstack = x["py_callstack"].get<std::string>();
      if (x.contains(contract::error_file::kRetry) && x[contract::error_file::kRetry].is_string())
        info.retryNever = x[contract::error_file::kRetry].get<std::string>() == contract::error_file::kRetryNever;
      if (x.contains("timestamp")) {
        // torchrun writes whole seconds ("1700000000"); others may write "1700000000.123".
        try {
          const auto& ts = x["timestamp"];
          double secs = 0;
          if (ts.is_string()) {
            std::string text = ts.get<std::string>();
            std::size_t used = 0;
            secs = std::stod(text, &used);
            if (used != text.size()) throw std::invalid_argument(text);
            info.timestampHasMillis = text.find('.') != std::string::npos;
          } else if (ts.is_number()) {
            secs = ts.get<double>();
            info.timestampHasMillis = ts.is_number_float();
          } else {
            throw std::invalid_argument("timestamp");
          }
          info.timestamp = std::chrono::system_clock::time_point(
              std::chrono::duration_cast<std::chrono::system_clock::duration>(
                  std::chrono::milliseconds(std::llround(secs * 1000.0))));
        } catch (const std::exception&) {
          info.timestamp.reset();
          info.timestampHasMillis = false;
        }
      }
    }
  } else {
    info.message = m.dump();
  }
  return info;
}

std::string formatTime(std::chrono::system_clock::time_point t, bool millis) {
  auto sinceEpochMs = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
  std::time_t secs = static_cast<std::time_t>(sinceEpochMs / 1000);
  std::tm tm{};
  ::localtime_r(&secs, &tm);
  std::ostringstream os;
  os << std::put_time(&tm, "%Y-%m-%d %H:%M:%S");
  if (millis) os << '.' << std::setw(3) << std::setfill('0') << sinceEpochMs % 1000;
  return os.str();
}

std::string formatFailureSummary(const FailureReport& r) {
  std::ostringstream os;
  const std::string rule(78, '=');
  os << rule << "\n";
  os << r.program << " FAILED: " << r.failures.size() << " of " << r.numWorkers
     << (r.numWorkers == 1 ? " worker" : " workers") << " failed (attempt " << r.attempt + 1
     << " of " << r.maxRestarts + 1 << ", run id " << r.runId << ")";
  if (r.stoppedByAgent > 0)
    os << "; " << r.stoppedByAgent << " stopped by ctorchrun";
  os << "\n" << std::string(78, '-') << "\n";

  struct Row {
    std::string cells[7];
  };
  std::vector<Row> rows;
  rows.push_back({{"rank", "local", "host", "pid", "exit", "time", "error"}});
  for (std::size_t i = 0; i < r.failures.size(); ++i) {
    const auto& f = r.failures[i];
    std::string err;
    if (f.error && !f.error->message.empty()) {
      err = firstLine(f.error->message);
    } else if (!f.errorFile.empty()) {
      err = "<no error file>";
    }
    // The error file's own time when it has one (to the precision it has), else the exit time.
    bool fromFile = f.error && f.error->timestamp;
    std::string when = fromFile ? formatTime(*f.error->timestamp, f.error->timestampHasMillis) : formatTime(f.time);
    rows.push_back({{std::to_string(f.globalRank) + (i == 0 ? "*" : ""), std::to_string(f.localRank),
                     f.host, std::to_string(f.pid), f.status.describe(), when, err}});
  }
  std::size_t width[7] = {};
  for (const auto& row : rows)
    for (int c = 0; c < 6; ++c) width[c] = std::max(width[c], row.cells[c].size());
  for (const auto& row : rows) {
    os << "  ";
    for (int c = 0; c < 6; ++c) os << pad(row.cells[c], width[c]) << "  ";
    os << row.cells[6] << "\n";
  }
  if (!r.failures.empty()) {
    const auto& root = r.failures.front();
    os << "  * root cause (first failure observed): rank " << root.globalRank << ", "
       << root.status.describe() << "\n";
    if (!root.errorFile.empty()) {
      os << "    error file: " << root.errorFile.string() << (root.error ? "" : " (not written)") << "\n";
      // Where the traceback would have come from (it is on the worker's stderr meanwhile).
      if (!root.error && root.status.signal == 0)
        os << (r.python ? "    (Python writes its traceback there when main() is decorated with @record from "
                          "torch.distributed.elastic.multiprocessing.errors)\n"
                        : "    (a C++ program writes it with ctorch::runRecorded or ctorch::recordError)\n");
    }
    if (root.error && !root.error->callstack.empty()) {
      os << "    traceback:\n";
      std::istringstream cs(root.error->callstack);
      std::string line;
      while (std::getline(cs, line)) os << "      " << line << "\n";
    }
  }
  os << rule << "\n";
  return os.str();
}

} // namespace ctorch::launcher
