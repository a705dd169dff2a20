#include "ctorch/launcher/cli.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/exit_status.hpp"
#include "ctorch/launcher/rendezvous.hpp"
#include "ctorch/text/text.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <sstream>

namespace ctorch::launcher {

namespace {

// One flag: its kebab name, torchrun's underscore name and the PET_ variable.
struct FlagNames {
  std::string names;  // CLI11 name list
  std::string env;
};

FlagNames flag(const std::string& kebab, const std::string& shortName = "") {
  std::string underscore = kebab;
  for (auto& c : underscore)
    if (c == '-') c = '_';
  std::string upper = underscore;
  for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  std::string names = (shortName.empty() ? "" : shortName + ",") + "--" + kebab;
  if (underscore != kebab) names += ",--" + underscore;
  return {names, "PET_" + upper};
}

void build(CLI::App& app, RawOptions& o, bool& version) {
  app.prefix_command();
  app.set_help_flag("-h,--help", "Print this help and exit");
  app.add_flag("--version", version, "Print the version and exit");
  auto opt = [&](const std::string& kebab, std::string& target, const std::string& help,
                 const std::string& shortName = "") {
    auto f = flag(kebab, shortName);
    return app.add_option(f.names, target, help)->envname(f.env);
  };
  auto boolFlag = [&](const std::string& kebab, bool& target, const std::string& help,
                      const std::string& shortName = "") {
    auto f = flag(kebab, shortName);
    return app.add_flag(f.names, target, help)->envname(f.env);
  };

  opt("nnodes", o.nnodes, "Number of nodes, N or MIN:MAX (elastic)")->capture_default_str()->type_name("N|MIN:MAX");
  opt("nproc-per-node", o.nprocPerNode,
      "Workers per node: a number, 'gpu' (visible NVIDIA GPUs), 'cpu' (CPU count) or 'auto'")
      ->capture_default_str()
      ->type_name("N|gpu|cpu|auto");
  boolFlag("standalone", o.standalone,
           "Single node on localhost: the store on a free port, a random run id (ignores "
           "--rdzv-backend/--rdzv-endpoint/--rdzv-id)");
  app.add_option(flag("node-rank").names,
                 [&o](const CLI::results_t& r) {
                   o.nodeRank = r.front();
                   return true;
                 },
                 "Rank of this node (static rendezvous; default 0, under srun SLURM_NODEID; c10d "
                 "assigns ranks itself)")
      ->envname(flag("node-rank").env)
      ->type_name("INT");
  opt("master-addr", o.masterAddr, "Address of node 0, where the workers' store lives (static)")
      ->capture_default_str()
      ->type_name("ADDR");
  opt("master-port", o.masterPort, "Port of the workers' store on node 0 (static; 0: a free port, one node only)")
      ->capture_default_str()
      ->type_name("PORT");
  std::string backends;
  for (const auto& b : availableRendezvousBackends()) backends += (backends.empty() ? "" : "|") + b;
  opt("rdzv-backend", o.rdzvBackend, "Rendezvous backend: " + backends)
      ->capture_default_str()
      ->type_name(backends);
  opt("rdzv-endpoint", o.rdzvEndpoint,
      "Rendezvous endpoint (c10d default: localhost:29400; static: --master-addr:--master-port)")
      ->type_name("HOST[:PORT]");
  opt("rdzv-id", o.rdzvId, "Job id shared by all nodes of one job")->capture_default_str()->type_name("ID");
  opt("rdzv-conf", o.rdzvConf, "Rendezvous settings key1=value1,key2=value2")->type_name("K=V,...");
  opt("max-restarts", o.maxRestarts, "Restarts of the worker group before failing")
      ->capture_default_str()
      ->type_name("INT");
  opt("recovery", o.recovery,
      "After a worker fails: restart (every worker restarts, as torchrun) or in-place (only the "
      "failed or hung worker is replaced; the others keep their state and re-form the group with "
      "it; needs a program on ctorch's resilience API, docs/in-place-recovery.md). Each "
      "replacement counts against --max-restarts")
      ->capture_default_str()
      ->type_name("restart|in-place");
  opt("spare-workers", o.spareWorkers,
      "With --recovery in-place: processes per node started ahead (program loaded, waiting) that take "
      "a failed worker's rank over at once instead of a new process starting")
      ->capture_default_str()
      ->type_name("N");
  opt("preloaded-workers", o.preloadedWorkers,
      "With --recovery in-place: processes per node started ahead with LibTorch loaded, waiting before "
      "their program's main(); a failed worker's replacement starts from one instead of a new process "
      "(auto: 1 when --spare-workers is 0; needs a program linked with ctorch's library)")
      ->capture_default_str()
      ->type_name("N|auto");
  boolFlag("store-failover", o.storeFailover,
           "With --rdzv-backend c10d: every agent keeps a standby rendezvous store, so that losing the "
           "store's host (node rank 0's, say) leaves the others training: they re-form on the next node's "
           "standby (needs 3 nodes or more: only a majority of the last round goes on; "
           "docs/store-failover.md)");
  opt("monitor-interval", o.monitorInterval,
      "Seconds (accepted for torchrun compatibility: exits are detected at once here)")
      ->capture_default_str()
      ->type_name("SECONDS");
  opt("role", o.role, "Role of the workers (ROLE_NAME, log prefix)")->capture_default_str()->type_name("NAME");
  opt("log-dir", o.logDir,
      "Directory for <run_id>_<random>/attempt_<k>/<local_rank>/{stdout,stderr}.log and error.json, "
      "one directory per run (default: a temporary directory, kept when a worker failed or with "
      "-r/-t; its path is logged)")
      ->type_name("DIR");
  opt("redirects", o.redirects,
      "Send worker streams to their log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per "
      "local rank 0:3,1:1",
      "-r")
      ->capture_default_str()
      ->type_name("0-3|R:V,...");
  opt("tee", o.tee, "Copy worker streams to their log files too (same values as --redirects)", "-t")
      ->capture_default_str()
      ->type_name("0-3|R:V,...");
  opt("local-ranks-filter", o.localRanksFilter,
      "Show only these local ranks on the console, e.g. 0 or 0,1 (files are unaffected; each must "
      "be below --nproc-per-node)")
      ->type_name("RANKS");
  opt("local-addr", o.localAddr, "Address of this node for the rendezvous")->type_name("ADDR");
  opt("shutdown-timeout", o.shutdownTimeout,
      "Seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str()
      ->type_name("SECONDS");
  opt("signals-to-handle", o.signalsToHandle,
      "Signals forwarded to the workers, comma-separated (copies of one signal within 1 s, e.g. "
      "from `timeout` or Slurm, are one stop)")
      ->capture_default_str()
      ->type_name("SIGNALS");
  boolFlag("module", o.module, "Run the program as a Python module (python -u -m ...)", "-m");
  boolFlag("no-python", o.noPython, "Execute the program directly, even if it ends in .py");
  boolFlag("run-path", o.runPath, "Run the program as a Python script");
  opt("log-level", o.logLevel,
      "Launcher log level: trace, debug, info, warn, error, critical, off "
      "(default: SPDLOG_LEVEL, else info)")
      ->type_name("LEVEL");
  opt("slurm", o.slurm,
      "Under srun, fill what is not given (--nnodes, node rank, rendezvous endpoint and id, "
      "--nproc-per-node) from the Slurm step: auto, on (fail outside a step) or off")
      ->capture_default_str()
      ->type_name("auto|on|off");
  std::string startMethod;
  app.add_option("--start-method,--start_method", startMethod,
                 "Accepted for torchrun compatibility (workers are always new processes)")
      ->envname("PET_START_METHOD")
      ->type_name("METHOD");
}

std::string contractFooter() {
  std::ostringstream os;
  os << "\nThe program runs under Python (PYTHON_EXEC, else python3, with -u) when it ends in .py or "
        "with -m/--run-path;\notherwise it is executed directly. Everything after it is passed on "
        "untouched. Every flag is also\nread from PET_<FLAG> (e.g. PET_NPROC_PER_NODE); torchrun's "
        "underscore spellings and unambiguous\nprefixes (--nproc 2) are accepted.\n";
  os << "\nExit status:\n"
        "  0    every worker succeeded\n"
        "  N    otherwise: the exit code of the root-cause worker (the first one to fail), not a "
        "blanket 1;\n"
        "       128+S when that worker died of signal S (e.g. 139 for SIGSEGV)\n"
        "  128+S  ctorchrun itself was stopped by signal S (after forwarding it and the grace "
        "period)\n"
        "  75   stopped by a signal, and every worker exited 75 (state saved, "
        "contract::kExitPreempted):\n"
        "       the job can be requeued\n"
        "  74   a worker could not write a file the run needs (disk full, I/O error; "
        "contract::kExitWriteFailed):\n"
        "       every rank stopped at the same step, not restarted; free space and run again to resume\n";
  os << "  " << contract::kExitFailure << "    launcher failure    " << contract::kExitUsage
     << "  bad command line    " << contract::kExitRendezvousFailed << "  rendezvous failed\n";
  os << "  " << contract::kExitCannotExecute << "  program not executable    "
     << contract::kExitNotFound << "  program not found\n";
  os << "\nWorker contract (environment of every worker, as torchrun sets it):\n";
  std::size_t width = 0;
  for (const auto& v : contract::kWorkerVariables) width = std::max(width, std::string(v.name).size());
  for (const auto& v : contract::kInPlaceVariables) width = std::max(width, std::string(v.name).size());
  for (const auto& v : contract::kWorkerVariables) {
    std::string name = v.name;
    os << "  " << name << std::string(width - name.size() + 2, ' ') << v.meaning << "\n";
  }
  os << "ctorchrun also sets:\n";
  for (const auto& v : contract::kCtorchVariables) {
    std::string name = v.name;
    os << "  " << name << std::string(width > name.size() ? width - name.size() + 2 : 2, ' ') << v.meaning << "\n";
  }
  os << "With --recovery in-place (docs/in-place-recovery.md), also:\n";
  for (const auto& v : contract::kInPlaceVariables) {
    std::string name = v.name;
    os << "  " << name << std::string(width - name.size() + 2, ' ') << v.meaning << "\n";
  }
  os << "  TORCHELASTIC_ERROR_FILE takes torchrun's JSON: {\"message\": {\"message\": \"<Type>: "
        "<what>\",\n  \"extraInfo\": {\"py_callstack\": \"...\", \"timestamp\": \"<unix s>\"}}}; "
        "ctorchrun shows it in its failure summary.\n";
  return os.str();
}

// torchrun (argparse) accepts any unambiguous prefix of a long option: --nproc 2. CLI11 does not,
// so the options before the training program are spelled out first. An ambiguous prefix is an
// error naming the candidates.
std::vector<std::string> expandPrefixes(const CLI::App& app, const std::vector<std::string>& args) {
  std::vector<std::string> out = args;
  auto options = app.get_options();
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::string& a = out[i];
    if (a == "--" || a.size() < 2 || a[0] != '-') break;  // the training program starts here
    const CLI::Option* found = nullptr;
    if (a.rfind("--", 0) == 0) {
      auto eq = a.find('=');
      std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::vector<const CLI::Option*> matches;
      std::string spelled;
      for (const CLI::Option* o : options) {
        for (const auto& l : o->get_lnames()) {
          if (l == name) {
            matches = {o};
            spelled = l;
            break;
          }
          if (l.rfind(name, 0) == 0 && std::find(matches.begin(), matches.end(), o) == matches.end()) {
            matches.push_back(o);
            spelled = l;
          }
        }
        if (!spelled.empty() && spelled == name) break;
      }
      if (matches.size() > 1) {
        std::vector<std::string> names;
        for (const auto* m : matches) names.push_back("--" + m->get_lnames().front());
        throw CLI::ParseError("ambiguous option '" + a + "' could match " + text::join(names, ", "), CLI::ExitCodes::ExtrasError);
      }
      if (matches.size() == 1) {
        found = matches.front();
        if (spelled != name) out[i] = "--" + spelled + (eq == std::string::npos ? "" : a.substr(eq));
        if (eq != std::string::npos) continue;
      }
    } else {
      for (const CLI::Option* o : options)
        for (const auto& sn : o->get_snames())
          if (a == "-" + sn) found = o;
    }
    if (!found) continue;  // unknown: CLI11 reports it, or it is the program's own
    if (found->get_items_expected_max() > 0) ++i;  // skip the value (flags take none)
  }
  return out;
}

} // namespace

std::string helpText() {
  RawOptions o;
  bool version = false;
  CLI::App app("ctorchrun: a native, torchrun-compatible launcher for distributed training "
               "(C++/LibTorch or Python workers)",
               "ctorchrun");
  build(app, o, version);
  // The footer (worker contract, exit codes) is appended as it is written: CLI11 2.4+ reflows a
  // footer given to app.footer() into paragraphs, which would merge its table rows.
  // CLI11's own usage line knows nothing about the program and its arguments: replace it.
  std::string text = app.help();
  if (!text.empty() && text.back() != '\n') text += '\n';
  text += "\n" + contractFooter();
  if (text.back() != '\n') text += '\n';
  auto usage = text.find("Usage:");
  if (usage != std::string::npos) {
    auto eol = text.find('\n', usage);
    text.replace(usage, eol - usage, "Usage: ctorchrun [options] training_program [program args...]");
  }
  return text;
}

CommandLine parseCommandLine(const std::vector<std::string>& args) {
  CommandLine result;
  bool version = false;
  CLI::App app("ctorchrun", "ctorchrun");
  build(app, result.options, version);
  std::vector<std::string> storage;
  storage.push_back("ctorchrun");
  std::vector<char*> argv;
  try {
    auto expanded = expandPrefixes(app, args);
    storage.insert(storage.end(), expanded.begin(), expanded.end());
    for (auto& s : storage) argv.push_back(s.data());
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::CallForHelp&) {
    result.exitNow = true;
    result.exitCode = 0;
    result.message = helpText();
    return result;
  } catch (const CLI::ParseError& e) {
    result.exitNow = true;
    result.exitCode = contract::kExitUsage;
    std::string what = e.what();
    if (what.empty()) what = e.get_name();
    result.message = "ctorchrun: error: " + what + " (see --help)\n";
    return result;
  }
  if (version) {
    result.exitNow = true;
    result.message = std::string("ctorchrun ") + kVersion + "\n";
    return result;
  }
  result.options.command = app.remaining();
  for (const CLI::Option* option : app.get_options()) {
    if (option->count() == 0 || option->get_lnames().empty()) continue;
    result.options.givenFlags.push_back(option->get_lnames().front());
  }
  return result;
}

std::string describeConfig(const LaunchConfig& c) {
  std::ostringstream os;
  os << "ctorchrun " << kVersion << ": " << c.nprocPerNode << " worker(s)";
  if (c.nprocSource != std::to_string(c.nprocPerNode)) os << " [" << c.nprocSource << "]";
  os << " of";
  for (const auto& a : c.workerArgv) os << ' ' << a;
  os << " | nodes " << (c.elastic() ? std::to_string(c.minNodes) + ":" + std::to_string(c.maxNodes)
                                    : std::to_string(c.maxNodes));
  if (c.nodeRank) os << " (node rank " << *c.nodeRank << ")";
  os << " | rendezvous " << c.rdzvBackend;
  if (c.rdzvBackend != "standalone")
    os << " " << c.rdzvEndpointHost << ":" << c.rdzvEndpointPort;
  os << " id " << c.rdzvId;
  for (const auto& kv : c.rdzvConf.entries) os << " " << kv.first << "=" << kv.second;
  os << " | role " << c.role << " | max restarts " << c.maxRestarts
     << (c.inPlaceRecovery ? " | recovery in-place" : "")
     << (c.spareWorkers > 0 ? " | spare workers " + std::to_string(c.spareWorkers) : "")
     << (c.preloadedWorkers > 0 ? " | preloaded workers " + std::to_string(c.preloadedWorkers) : "")
     << (c.storeFailover ? " | store failover" : "") << " | shutdown timeout "
     << c.shutdownTimeout.count() / 1000.0 << "s | signals";
  for (std::size_t i = 0; i < c.signalsToHandle.size(); ++i)
    os << (i ? "," : " ") << signalName(c.signalsToHandle[i]);
  os << " | logs " << (c.logDir ? c.logDir->string() : "<temporary>");
  auto spec = [](const StdSpec& s) {
    if (!s.mapped) return std::to_string(static_cast<int>(s.all));
    std::string out;
    for (const auto& [r, v] : s.perRank) out += (out.empty() ? "" : ",") + std::to_string(r) + ":" + std::to_string(static_cast<int>(v));
    return out;
  };
  os << " redirects " << spec(c.redirects) << " tee " << spec(c.tee);
  if (c.localRanksFilter) {
    os << " local-ranks-filter ";
    bool first = true;
    for (int r : *c.localRanksFilter) {
      os << (first ? "" : ",") << r;
      first = false;
    }
  }
  os << " | host " << c.hostname;
  return os.str();
}

} // namespace ctorch::launcher
