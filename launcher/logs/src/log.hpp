// The launcher's named spdlog loggers (internal: spdlog stays out of public headers).
#pragma once

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace ctorch::launcher {

// The logger `name` ("ctorchrun", "agent", "rendezvous", "store", ...), created on first use,
// writing to stderr.
spdlog::logger& log(const std::string& name);

// --log-level when given, else SPDLOG_LEVEL (spdlog's syntax, e.g. "debug" or
// "info,agent=debug"), else info.
void configureLogging(const std::string& level);

// Text for ctorchrun's stderr that is not a log line (the failure summary). Like the log lines,
// it never blocks: on a pipe or socket nobody reads, what does not fit a bounded buffer is dropped
// and counted ("[... N bytes dropped: console not read]" once the console moves again).
void writeConsoleErr(const std::string& text);
// At the end: up to `timeout` for stderr to take what waits; returns the bytes of ctorchrun's own
// lines dropped over the run.
std::uint64_t drainConsoleErr(std::chrono::milliseconds timeout);

} // namespace ctorch::launcher
