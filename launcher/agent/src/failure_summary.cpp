#include "ctorch/launcher/failure_summary.hpp"

#include <nlohmann/json.hpp>

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
      if (x.contains("timestamp")) {
        try {
          long long secs = x["timestamp"].is_string() ? std::stoll(x["timestamp"].get<std::string>())
                                                      : x["timestamp"].get<long long>();
          info.timestamp = std::chrono::system_clock::time_point(std::chrono::seconds(secs));
        } catch (const std::exception&) {
        }
      }
    }
  } else {
    info.message = m.dump();
  }
  return info;
}

std::string formatTime(std::chrono::system_clock::time_point t) {
  std::time_t secs = std::chrono::system_clock::to_time_t(t);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() % 1000;
  std::tm tm{};
  ::localtime_r(&secs, &tm);
  std::ostringstream os;
  os << std::put_time(&tm, "%Y-%m-%d %H:%M:%S") << '.' << std::setw(3) << std::setfill('0') << ms;
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
    auto when = f.error && f.error->timestamp ? *f.error->timestamp : f.time;
    rows.push_back({{std::to_string(f.globalRank) + (i == 0 ? "*" : ""), std::to_string(f.localRank),
                     f.host, std::to_string(f.pid), f.status.describe(), formatTime(when), err}});
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
    if (!root.errorFile.empty())
      os << "    error file: " << root.errorFile.string() << (root.error ? "" : " (not written)") << "\n";
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
