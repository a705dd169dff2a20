#include "ctorch/launcher/worker_logs.hpp"

#include "ctorch/launcher/errors.hpp"
#include "log.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>

namespace ctorch::launcher {

namespace fs = std::filesystem;

StreamRoute routeFor(const LaunchConfig& c, int localRank, Stream stream) {
  auto has = [&](const StdSpec& spec) {
    StdStreams s = spec.forRank(localRank);
    return stream == Stream::Stdout ? hasOut(s) : hasErr(s);
  };
  bool redirect = has(c.redirects);
  bool tee = has(c.tee);
  bool hidden = c.localRanksFilter && !c.localRanksFilter->count(localRank);
  StreamRoute r;
  r.file = redirect || tee;  // tee is "into the file and onto the console", as torchrun
  r.console = !hidden && (tee || !redirect);
  return r;
}

std::string consolePrefix(const std::string& role, int rank, const std::string& host, bool multiNode) {
  if (multiNode && !host.empty()) return "[" + host + ":" + role + std::to_string(rank) + "]:";
  return "[" + role + std::to_string(rank) + "]:";
}

WorkerLogs::WorkerLogs(const LaunchConfig& config, int consoleOut, int consoleErr)
    : config_(config),
      consoleOut_(std::make_unique<ConsoleWriter>(consoleOut)),
      consoleErr_(std::make_unique<ConsoleWriter>(consoleErr)) {
  std::error_code ec;
  if (config.logDir) {
    base_ = *config.logDir;
    fs::create_directories(base_, ec);
    if (ec) throw UsageError("--log-dir '" + base_.string() + "': cannot create it: " + ec.message());
  } else {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = (fs::path(tmp && *tmp ? tmp : "/tmp") / "ctorchrun_XXXXXX").string();
    if (!::mkdtemp(templ.data()))
      throw LauncherError("cannot create a temporary log directory " + templ + ": " +
                          std::strerror(errno));
    base_ = templ;
    temporary_ = true;
    // Redirected or tee'd output lives only in these files: never delete them.
    if (writesFiles(config)) keep_ = true;
  }
}

bool writesFiles(const LaunchConfig& c) {
  for (const StdSpec* spec : {&c.redirects, &c.tee}) {
    if (!spec->mapped && spec->all != StdStreams::None) return true;
    for (const auto& [rank, streams] : spec->perRank)
      if (streams != StdStreams::None) return true;
  }
  return false;
}

const fs::path& WorkerLogs::runDir(const std::string& runId) {
  if (runDir_.empty()) {
    // torchrun's <log_dir>/<run_id>_<random>: a reused --log-dir or a requeued Slurm job with the
    // same run id never overwrites an earlier run's logs.
    std::string templ = (base_ / (runId + "_XXXXXX")).string();
    if (!::mkdtemp(templ.data()))
      throw LauncherError("cannot create the log directory " + templ + ": " + std::strerror(errno));
    runDir_ = templ;
    log("agent").info("worker logs and error files: {}", runDir_.string());
  }
  return runDir_;
}

WorkerLogs::~WorkerLogs() {
  endAttempt();
  if (temporary_ && !keep_) {
    std::error_code ec;
    fs::remove_all(base_, ec);
  }
}

std::vector<WorkerLogs::WorkerFiles> WorkerLogs::beginAttempt(const RendezvousInfo& info, int attempt) {
  endAttempt();
  fs::path attemptDir = runDir(info.runId) / ("attempt_" + std::to_string(attempt));
  std::error_code ec;
  fs::remove_all(attemptDir, ec);  // a re-rendezvous reuses the attempt number, as torchrun
  fs::create_directories(attemptDir, ec);
  if (ec) throw LauncherError("cannot create log directory " + attemptDir.string() + ": " + ec.message());

  const int n = info.localNproc();
  std::vector<WorkerFiles> files(static_cast<std::size_t>(n));
  ranks_.clear();
  ranks_.resize(static_cast<std::size_t>(n));
  const std::string& host = info.nodeHosts.empty() ? config_.hostname
                                                   : info.nodeHosts[static_cast<std::size_t>(info.nodeRank)];
  for (int lr = 0; lr < n; ++lr) {
    auto& f = files[static_cast<std::size_t>(lr)];
    auto& st = ranks_[static_cast<std::size_t>(lr)];
    f.rankDir = attemptDir / std::to_string(lr);
    fs::create_directories(f.rankDir, ec);
    if (ec) throw LauncherError("cannot create log directory " + f.rankDir.string() + ": " + ec.message());
    f.errorFile = f.rankDir / "error.json";
    st.prefix = consolePrefix(config_.role, info.globalRank(lr), host.empty() ? config_.hostname : host,
                              info.numNodes > 1);
    for (Stream s : {Stream::Stdout, Stream::Stderr}) {
      StreamRoute route = routeFor(config_, lr, s);
      OutputSpec& spec = s == Stream::Stdout ? f.out : f.err;
      Channel& ch = s == Stream::Stdout ? st.out : st.err;
      fs::path file = f.rankDir / (s == Stream::Stdout ? "stdout.log" : "stderr.log");
      spec.toAgent = route.console;
      if (route.file) spec.file = file;
      ch.console = route.console;
      if (route.console && route.file) {
        ch.teeFd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644);
        ch.teePath = file;
        ch.teeBytes = 0;
        if (ch.teeFd < 0)
          throw LauncherError("cannot open log file " + file.string() + ": " + std::strerror(errno));
      }
    }
  }
  return files;
}

WorkerLogs::RankState* WorkerLogs::stateOf(int localRank) {
  if (localRank >= 0) {
    if (static_cast<std::size_t>(localRank) >= ranks_.size()) return nullptr;
    return &ranks_[static_cast<std::size_t>(localRank)];
  }
  auto [it, added] = spares_.try_emplace(localRank);
  if (added) {
    it->second.prefix = "[" + config_.role + " spare]:";
    it->second.out.console = it->second.err.console = true;
  }
  return &it->second;
}

WorkerLogs::Channel& WorkerLogs::channel(int localRank, Stream stream) {
  RankState* st = stateOf(localRank);
  return stream == Stream::Stdout ? st->out : st->err;
}


void WorkerLogs::writeTee(Channel& ch, std::string_view data) {
  const char* p = data.data();
  std::size_t left = data.size();
  while (left > 0) {
    const ssize_t n = ::write(ch.teeFd, p, left);
    if (n > 0) {
      p += n;
      left -= static_cast<std::size_t>(n);
      ch.teeBytes += static_cast<std::uint64_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // ENOSPC, EDQUOT, EIO, EFBIG: the file ends here. Said once; the console keeps the lines.
    const int err = n < 0 ? errno : ENOSPC;
    ::close(ch.teeFd);
    ch.teeFd = -1;
    const std::string what = ch.teePath.string() + ": " + std::strerror(err) + " after " +
                             std::to_string(ch.teeBytes) + " bytes";
    fileErrors_.push_back(what);
    log("agent").warn("cannot write the log file {}; it stops there{}", what,
                      ch.console ? " (the lines go on to the console)" : "");
    return;
  }
}

void WorkerLogs::writeConsole(Stream stream, const std::string& text) {
  if (text.empty()) return;
  console(stream).write(text);
}

std::vector<int> WorkerLogs::blockedConsoles() const {
  std::vector<int> fds;
  for (const auto* c : {consoleOut_.get(), consoleErr_.get()})
    if (c->pending()) fds.push_back(c->pollFd());
  return fds;
}

void WorkerLogs::flushConsoles() {
  consoleOut_->flush();
  consoleErr_->flush();
}

std::uint64_t WorkerLogs::drainConsoles(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto* c : {consoleOut_.get(), consoleErr_.get()}) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    c->drain(std::max(left, std::chrono::milliseconds(0)));
  }
  return consoleOut_->droppedBytes() + consoleErr_->droppedBytes();
}

// A terminal shows partial lines at once (tqdm's "\r 45%|####"): every piece that starts a line
// (after '\n' or '\r') gets the prefix, a lone '\r' or the '\n' of "\r\n" does not.
void WorkerLogs::appendTerminal(Channel& ch, const std::string& prefix, std::string_view data) {
  std::size_t i = 0;
  while (i < data.size()) {
    std::size_t j = data.find_first_of("\r\n", i);
    std::size_t end = j == std::string_view::npos ? data.size() : j + 1;
    std::string_view piece = data.substr(i, end - i);
    bool bare = piece.size() == 1 && (piece[0] == '\r' || (piece[0] == '\n' && ch.afterCR));
    if (!ch.midLine && !bare) batch_.append(prefix);
    batch_.append(piece);
    char last = piece.back();
    ch.midLine = last != '\n' && last != '\r';
    ch.afterCR = last == '\r';
    i = end;
  }
}

void WorkerLogs::onOutput(int localRank, Stream stream, std::string_view data) {
  RankState* st = stateOf(localRank);
  if (!st) return;
  Channel& ch = stream == Stream::Stdout ? st->out : st->err;
  if (ch.teeFd >= 0) writeTee(ch, data);
  if (!ch.console) return;
  const std::string& prefix = st->prefix;
  batch_.clear();
  if (console(stream).isTerminal()) {
    appendTerminal(ch, prefix, data);
  } else {
    // All complete lines of this chunk go out in one write: whole lines, never a partial one.
    ch.lines.feed(data, [&](std::string_view line) {
      batch_.append(prefix).append(line).push_back('\n');
    });
  }
  writeConsole(stream, batch_);
}

void WorkerLogs::closeChannel(Channel& ch, Stream stream, const std::string& prefix) {
  if (ch.console) {
    batch_.clear();
    ch.lines.finish([&](std::string_view line) { batch_.append(prefix).append(line).push_back('\n'); });
    if (ch.midLine) batch_.push_back('\n');
    ch.midLine = ch.afterCR = false;
    writeConsole(stream, batch_);
  }
  if (ch.teeFd >= 0) {
    ::close(ch.teeFd);
    ch.teeFd = -1;
  }
}

void WorkerLogs::onClosed(int localRank, Stream stream) {
  if (localRank < 0) {
    if (auto it = spares_.find(localRank); it != spares_.end())
      closeChannel(stream == Stream::Stdout ? it->second.out : it->second.err, stream, it->second.prefix);
    return;
  }
  if (static_cast<std::size_t>(localRank) >= ranks_.size()) return;
  // The partial line goes out now; the tee file stays open until the attempt ends: a replacement of
  // this worker (--recovery in-place) writes on into it.
  Channel& ch = channel(localRank, stream);
  const int tee = ch.teeFd;
  ch.teeFd = -1;
  closeChannel(ch, stream, ranks_[static_cast<std::size_t>(localRank)].prefix);
  ch.teeFd = tee;
}

void WorkerLogs::adoptSpare(int localRank, const WorkerFiles& files) {
  if (localRank < 0 || static_cast<std::size_t>(localRank) >= ranks_.size()) return;
  for (Stream s : {Stream::Stdout, Stream::Stderr}) {
    Channel& ch = channel(localRank, s);
    const OutputSpec& spec = s == Stream::Stdout ? files.out : files.err;
    if (ch.teeFd >= 0 || spec.toAgent || !spec.file) continue;
    ch.teeFd = ::open(spec.file->c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_APPEND, 0644);
    ch.teePath = *spec.file;
    struct stat st {};
    ch.teeBytes = ch.teeFd >= 0 && ::fstat(ch.teeFd, &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
  }
}

void WorkerLogs::endAttempt() {
  for (auto& st : ranks_) {
    closeChannel(st.out, Stream::Stdout, st.prefix);
    closeChannel(st.err, Stream::Stderr, st.prefix);
  }
  for (auto& [tag, st] : spares_) {
    closeChannel(st.out, Stream::Stdout, st.prefix);
    closeChannel(st.err, Stream::Stderr, st.prefix);
  }
  spares_.clear();
}

} // namespace ctorch::launcher
