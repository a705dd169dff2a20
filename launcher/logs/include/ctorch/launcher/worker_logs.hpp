// Worker output and the log directory. Console lines get torchrun's "[<role><rank>]:" prefix
// ("[<host>:<role><rank>]:" with several nodes) and are written whole, so lines of different
// workers never interleave mid-line (on a terminal, partial lines pass at once, for progress bars).
// --redirects sends a stream to its file only, --tee to the console and the file,
// --local-ranks-filter hides other ranks from the console. Files live in
// <log-dir>/<run_id>_<random>/attempt_<k>/<local_rank>/{stdout,stderr}.log (torchrun's layout: one
// directory per run), next to the error.json that TORCHELASTIC_ERROR_FILE points to (a temporary
// <log-dir> when none is given, removed after a run that neither failed nor wrote output files).
#pragma once

#include "ctorch/launcher/console_writer.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/process_context.hpp"
#include "ctorch/launcher/rendezvous.hpp"

#include <chrono>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::launcher {

// Splits a byte stream into lines; pure (unit-tested).
class LineSplitter {
 public:
  explicit LineSplitter(std::size_t maxLine = 64 * 1024) : maxLine_(maxLine) {}
  // Appends data; calls emit(line) for every complete line (without '\n'). A line longer than
  // maxLine is emitted in maxLine pieces.
  template <typename Emit>
  void feed(std::string_view data, Emit&& emit) {
    while (!data.empty()) {
      std::size_t nl = data.find('\n');
      std::size_t take = nl == std::string_view::npos ? data.size() : nl;
      if (pending_.size() + take >= maxLine_ && nl == std::string_view::npos) {
        std::size_t room = maxLine_ - pending_.size();
        pending_.append(data.substr(0, room));
        emit(std::string_view(pending_));
        pending_.clear();
        data.remove_prefix(room);
        continue;
      }
      pending_.append(data.substr(0, take));
      if (nl == std::string_view::npos) return;
      emit(std::string_view(pending_));
      pending_.clear();
      data.remove_prefix(nl + 1);
    }
  }
  // Emits what is left (a last line without '\n').
  template <typename Emit>
  void finish(Emit&& emit) {
    if (!pending_.empty()) emit(std::string_view(pending_));
    pending_.clear();
  }
  bool empty() const { return pending_.empty(); }

 private:
  std::size_t maxLine_;
  std::string pending_;
};

// How one stream of one local rank is routed (pure decision from the flags).
struct StreamRoute {
  bool console = true;  // prefixed lines to the agent's stdout/stderr
  bool file = false;    // <rank dir>/{stdout,stderr}.log
};
StreamRoute routeFor(const LaunchConfig& config, int localRank, Stream stream);
// Whether --redirects/--tee send any stream of any rank to a file.
bool writesFiles(const LaunchConfig& config);

std::string consolePrefix(const std::string& role, int rank, const std::string& host, bool multiNode);

class WorkerLogs : public OutputSink {
 public:
  struct WorkerFiles {
    OutputSpec out;
    OutputSpec err;
    std::filesystem::path rankDir;
    std::filesystem::path errorFile;
  };

  // consoleOut/consoleErr: where prefixed worker lines go (the agent's stdout and stderr).
  explicit WorkerLogs(const LaunchConfig& config, int consoleOut = 1, int consoleErr = 2);
  ~WorkerLogs() override;
  WorkerLogs(const WorkerLogs&) = delete;
  WorkerLogs& operator=(const WorkerLogs&) = delete;

  // Creates (afresh) <base>/<run_id>_<random>/attempt_<attempt>/<local_rank>/ for every local
  // worker; the run directory is created once per WorkerLogs (logged at info level).
  std::vector<WorkerFiles> beginAttempt(const RendezvousInfo& info, int attempt);
  // Flushes unfinished lines and closes tee files.
  void endAttempt();
  // A spare took this local rank over (--spare-workers): its output comes through the agent, so a
  // stream that goes only to its file (--redirects) is written to that file by the agent.
  void adoptSpare(int localRank, const WorkerFiles& files);

  void onOutput(int localRank, Stream stream, std::string_view data) override;
  void onClosed(int localRank, Stream stream) override;

  // The console never blocks the agent (see console_writer.hpp): while a console has output
  // waiting, the agent watches these fds for POLLOUT and calls flushConsoles().
  std::vector<int> blockedConsoles() const;
  void flushConsoles();
  // At the end: gives the consoles up to `timeout` to take what is left; returns the bytes that
  // were dropped over the whole run because a console was not read.
  std::uint64_t drainConsoles(std::chrono::milliseconds timeout);

  const std::filesystem::path& baseDir() const { return base_; }
  bool temporary() const { return temporary_; }
  bool kept() const { return keep_; }
  // <base>/<run_id>_<random> once the first attempt began; empty before.
  const std::filesystem::path& runDir() const { return runDir_; }
  // A temporary log directory is removed at destruction unless kept (e.g. after a failure).
  void keep() { keep_ = true; }
  // The log files the agent writes (--tee, and --redirects of an adopted spare) that a write failed
  // on (a full disk): "<file>: <error> after <N> bytes", each said once as a warning when it
  // happened; ctorchrun repeats them at the end.
  const std::vector<std::string>& fileErrors() const { return fileErrors_; }

 private:
  struct Channel {
    bool console = false;
    int teeFd = -1;
    std::filesystem::path teePath;   // the file teeFd writes (for the message when it fails)
    std::uint64_t teeBytes = 0;      // written to it so far
    LineSplitter lines;
    // On a terminal, partial lines pass at once (progress bars): where the cursor is.
    bool midLine = false;
    bool afterCR = false;
  };
  struct RankState {
    std::string prefix;
    Channel out;
    Channel err;
  };
  Channel& channel(int localRank, Stream stream);
  // A spare (negative local rank until it takes a rank over): its lines reach the console with a
  // "[<role> spare]:" prefix -- what it says while it waits (a refused assignment) is not lost.
  RankState* stateOf(int localRank);
  void writeConsole(Stream stream, const std::string& text);
  ConsoleWriter& console(Stream stream) { return stream == Stream::Stdout ? *consoleOut_ : *consoleErr_; }
  const std::filesystem::path& runDir(const std::string& runId);
  void appendTerminal(Channel& ch, const std::string& prefix, std::string_view data);
  void closeChannel(Channel& c, Stream stream, const std::string& prefix);
  // Writes to the channel's tee file; on failure says so once, closes it and records it.
  void writeTee(Channel& ch, std::string_view data);
  std::vector<std::string> fileErrors_;

  const LaunchConfig& config_;
  std::map<int, RankState> spares_;
  std::unique_ptr<ConsoleWriter> consoleOut_;
  std::unique_ptr<ConsoleWriter> consoleErr_;
  std::filesystem::path base_;
  std::filesystem::path runDir_;
  bool temporary_ = false;
  bool keep_ = false;
  std::vector<RankState> ranks_;
  std::string batch_;
};

} // namespace ctorch::launcher
