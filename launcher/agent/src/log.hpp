// The launcher's named spdlog loggers (internal: spdlog stays out of public headers).
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace ctorch::launcher {

// The logger `name` ("ctorchrun", "agent", "rendezvous", "store", ...), created on first use,
// writing to stderr.
spdlog::logger& log(const std::string& name);

// --log-level when given, else SPDLOG_LEVEL (spdlog's syntax, e.g. "debug" or
// "info,agent=debug"), else info.
void configureLogging(const std::string& level);

} // namespace ctorch::launcher
