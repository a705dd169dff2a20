// ctorchrun: parse the command line, validate it once, then hand over to the agent. Only here are
// exceptions turned into exit codes.
#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/cli.hpp"
#include "ctorch/launcher/elastic_agent.hpp"
#include "ctorch/launcher/errors.hpp"
#include "ctorch/launcher/launch_config.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/launcher/signals.hpp"
#include "ctorch/launcher/supervised_process_context.hpp"
#include "ctorch/launcher/worker_logs.hpp"
#include "ctorch/text/text.hpp"
#include "../src/log.hpp"

#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <iostream>

namespace {

void printLine(const std::string& text) {
  std::string s = text;
  if (s.empty() || s.back() != '\n') s += '\n';
  [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, s.data(), s.size());
}

int launch(int argc, char** argv) {
  using namespace ctorch::launcher;
  CommandLine cl = parseCommandLine(std::vector<std::string>(argv + 1, argv + argc));
  if (cl.exitNow) {
    if (cl.exitCode == 0) {
      std::cout << cl.message << std::flush;
    } else {
      printLine(cl.message);
    }
    return cl.exitCode;
  }
  EnvLookup env = processEnvironment();
  LaunchConfig config = makeLaunchConfig(cl.options, env, MachineProbe::real(env));
  configureLogging(config.logLevel);
  for (const auto& line : config.slurmLines) log("ctorchrun").info("slurm: {}", line);
  for (const auto& line : config.slurmWarnings) log("ctorchrun").warn("slurm: {}", line);
  log("ctorchrun").info("{}", describeConfig(config));
  if (!config.pythonChoice.empty()) log("ctorchrun").info("Python interpreter: {}", config.pythonChoice);
  if (!config.pythonWarning.empty()) log("ctorchrun").warn("{}", config.pythonWarning);
  if (!config.inheritedLauncherVariables.empty()) {
    const std::string names = ctorch::text::join(config.inheritedLauncherVariables, ", ");
    log("ctorchrun").warn("ignoring {} from the environment: ctorchrun sets these for its workers itself (left in "
                          "a shell or a batch script they would make workers wait as spares or use a stale key)",
                          names);
  }
  if (!config.recoveryWarning.empty()) log("ctorchrun").warn("{}", config.recoveryWarning);
  if (config.inPlaceRecovery)
    log("ctorchrun").info("in-place recovery: its commands travel on a control channel that the job's key "
                          "authenticates, never through the store ({})",
                          config.controlKeySource);

  // Before any thread exists (the store starts one): the signals we handle are read from a
  // signalfd, never delivered; the workers get the mask we started with.
  std::vector<int> handled = config.signalsToHandle;
  handled.push_back(SIGCHLD);
  // SIGPIPE is blocked, not ignored: a closed console gives EPIPE instead of killing the agent,
  // and workers (which start with the original mask) keep the default disposition.
  std::vector<int> blocked = handled;
  blocked.push_back(SIGPIPE);
  sigset_t original = blockSignals(blocked);
  // Orphaned grandchildren come to us, not to init, so nothing escapes being reaped.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);

  auto rendezvous = createRendezvousHandler(config);
  WorkerLogs logs(config);
  SupervisedProcessContextOptions po;
  po.sink = &logs;
  po.leftoverGrace = config.shutdownTimeout;
  po.workerMask = original;
  SupervisedProcessContext processes(po);
  SignalWatcher signals(handled);
  AgentOptions ao;
  ao.reapOrphans = true;
  ElasticAgent agent(config, *rendezvous, processes, logs, signals, ao);
  int code = agent.run();
  if (logs.temporary() && logs.kept())
    log("ctorchrun").info("worker logs and error files kept in {}",
                          (logs.runDir().empty() ? logs.baseDir() : logs.runDir()).string());
  // Log files that a write failed on (each said when it happened): once more at the end.
  if (!logs.fileErrors().empty()) {
    std::string files;
    for (const auto& e : logs.fileErrors()) files += (files.empty() ? "" : "; ") + e;
    log("ctorchrun").warn("{} worker log file(s) are incomplete: {}", logs.fileErrors().size(), files);
  }
  // A console nobody reads must not keep ctorchrun from exiting: a short wait, then drop.
  if (auto dropped = logs.drainConsoles(std::chrono::seconds(2)))
    log("ctorchrun").warn("{} bytes of worker output were dropped: the console was not read (the log "
                          "files of --tee/--redirects are complete)",
                          dropped);
  // ctorchrun's own lines on an unread stderr: the same short wait, then dropped.
  drainConsoleErr(std::chrono::seconds(1));
  return code;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return launch(argc, argv);
  } catch (const ctorch::launcher::LauncherError& e) {
    printLine(std::string("ctorchrun: error: ") + e.what());
    return e.exitCode();
  } catch (const std::exception& e) {
    printLine(std::string("ctorchrun: error: ") + e.what());
    return ctorch::contract::kExitFailure;
  }
}
