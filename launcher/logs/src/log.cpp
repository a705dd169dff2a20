#include "log.hpp"

#include "ctorch/launcher/logging.hpp"

#include "ctorch/launcher/console_writer.hpp"

#include <spdlog/cfg/env.h>
#include <spdlog/details/null_mutex.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <unistd.h>

#include <mutex>

namespace ctorch::launcher {

namespace {

constexpr const char* kPattern = "[%H:%M:%S.%e] [%n] [%^%l%$] %v";
std::mutex gMutex;

// ctorchrun's stderr when it is not a terminal: every line goes through a ConsoleWriter, so a pipe
// nobody reads (| less paused, a stuck log shipper) never blocks the agent (issue 27.8).
std::mutex gConsoleMutex;
ConsoleWriter& stderrConsole() {
  static ConsoleWriter writer(STDERR_FILENO);
  return writer;
}

class ConsoleSink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::lock_guard<std::mutex> lock(gConsoleMutex);
    stderrConsole().write(std::string_view(formatted.data(), formatted.size()));
  }
  void flush_() override {
    std::lock_guard<std::mutex> lock(gConsoleMutex);
    stderrConsole().flush();
  }
};

spdlog::sink_ptr sharedSink() {
  // A terminal keeps the colours (and a person reading it); anything else cannot block the agent.
  static spdlog::sink_ptr sink = ::isatty(STDERR_FILENO) == 1
                                     ? spdlog::sink_ptr(std::make_shared<spdlog::sinks::stderr_color_sink_mt>())
                                     : spdlog::sink_ptr(std::make_shared<ConsoleSink>());
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

void writeConsoleErr(const std::string& text) {
  std::lock_guard<std::mutex> lock(gConsoleMutex);
  stderrConsole().write(text);
}

std::uint64_t drainConsoleErr(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(gConsoleMutex);
  stderrConsole().drain(timeout);
  return stderrConsole().droppedBytes();
}

} // namespace ctorch::launcher
