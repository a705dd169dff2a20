// Log level control for the launcher's named loggers, without exposing spdlog.
#pragma once

#include <string>

namespace ctorch::launcher {

// "trace", "debug", "info", "warn", "error", "critical", "off"; empty: SPDLOG_LEVEL, else info.
void setLogLevel(const std::string& level);

} // namespace ctorch::launcher
