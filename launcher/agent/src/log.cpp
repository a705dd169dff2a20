#include "log.hpp"

#include "ctorch/launcher/logging.hpp"

#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>

namespace ctorch::launcher {

namespace {

constexpr const char* kPattern = "[%H:%M:%S.%e] [%n] [%^%l%$] %v";
std::mutex gMutex;

spdlog::sink_ptr sharedSink() {
  static spdlog::sink_ptr sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  return sink;
}

void applyPatternOnce() {
  static std::once_flag once;
  std::call_once(once, [] { spdlog::set_pattern(kPattern); });
}

} // namespace

spdlog::logger& log(const std::string& name) {
  std::lock_guard<std::mutex> lock(gMutex);
  applyPatternOnce();
  if (auto existing = spdlog::get(name)) return *existing;
  auto logger = std::make_shared<spdlog::logger>(name, sharedSink());
  // Registers it and applies the global pattern and the level (per-logger SPDLOG_LEVEL entries too).
  spdlog::initialize_logger(logger);
  return *logger;
}

void configureLogging(const std::string& level) {
  applyPatternOnce();
  spdlog::set_level(spdlog::level::info);
  if (level.empty()) {
    spdlog::cfg::load_env_levels();
  } else {
    spdlog::set_level(spdlog::level::from_str(level));
  }
}

void setLogLevel(const std::string& level) { configureLogging(level); }

} // namespace ctorch::launcher
