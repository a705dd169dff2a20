#include "ctorch/launcher/cli.hpp"

#include "ctorch/contract/worker_contract.hpp"
#include "ctorch/launcher/exit_status.hpp"

#include <CLI/CLI.hpp>

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

  opt("nnodes", o.nnodes, "Number of nodes, N or MIN:MAX (elastic)")->capture_default_str();
  opt("nproc-per-node", o.nprocPerNode,
      "Workers per node: a number, 'gpu' (visible NVIDIA GPUs), 'cpu' (CPU count) or 'auto'")
      ->capture_default_str();
  boolFlag("standalone", o.standalone,
           "Single node on localhost: the store on a free port, a random run id (ignores "
           "--rdzv-backend/--rdzv-endpoint/--rdzv-id)");
  app.add_option(flag("node-rank").names,
                 [&o](const CLI::results_t& r) {
                   o.nodeRank = r.front();
                   return true;
                 },
                 "Rank of this node (static rendezvous)")
      ->envname(flag("node-rank").env)
      ->type_name("INT");
  opt("master-addr", o.masterAddr, "Address of node 0, where the workers' store lives (static)")
      ->capture_default_str();
  opt("master-port", o.masterPort, "Port of the workers' store on node 0 (static)")->capture_default_str();
  opt("rdzv-backend", o.rdzvBackend, "Rendezvous backend")->capture_default_str();
  opt("rdzv-endpoint", o.rdzvEndpoint, "Rendezvous endpoint HOST[:PORT]");
  opt("rdzv-id", o.rdzvId, "Job id shared by all nodes of one job")->capture_default_str();
  opt("rdzv-conf", o.rdzvConf, "Rendezvous settings key1=value1,key2=value2");
  opt("max-restarts", o.maxRestarts, "Restarts of the worker group before failing")->capture_default_str();
  opt("monitor-interval", o.monitorInterval,
      "Seconds (accepted for torchrun compatibility: exits are detected at once here)")
      ->capture_default_str();
  opt("role", o.role, "Role of the workers (ROLE_NAME, log prefix)")->capture_default_str();
  opt("log-dir", o.logDir,
      "Directory for <run_id>/attempt_<k>/<local_rank>/{stdout,stderr}.log and error.json "
      "(default: a temporary directory)");
  opt("redirects", o.redirects,
      "Send worker streams to their log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per "
      "local rank 0:3,1:1",
      "-r")
      ->capture_default_str();
  opt("tee", o.tee, "Copy worker streams to their log files too (same values as --redirects)", "-t")
      ->capture_default_str();
  opt("local-ranks-filter", o.localRanksFilter,
      "Show only these local ranks on the console, e.g. 0 or 0,1 (files are unaffected)");
  opt("local-addr", o.localAddr, "Address of this node for the rendezvous");
  opt("shutdown-timeout", o.shutdownTimeout,
      "Seconds between SIGTERM and SIGKILL when stopping workers")
      ->capture_default_str();
  opt("signals-to-handle", o.signalsToHandle,
      "Signals forwarded to the workers, comma-separated")
      ->capture_default_str();
  boolFlag("module", o.module, "Run the program as a Python module (python -u -m ...)", "-m");
  boolFlag("no-python", o.noPython, "Execute the program directly, even if it ends in .py");
  boolFlag("run-path", o.runPath, "Run the program as a Python script");
  app.add_option("--log-level", o.logLevel,
                 "Launcher log level: trace, debug, info, warn, error, critical, off "
                 "(default: SPDLOG_LEVEL, else info)");
  opt("slurm", o.slurm,
      "Under srun, fill what is not given (--nnodes, node rank, rendezvous endpoint and id, "
      "--nproc-per-node) from the Slurm step: auto, on (fail outside a step) or off")
      ->capture_default_str();
  std::string startMethod;
  app.add_option("--start-method,--start_method", startMethod,
                 "Accepted for torchrun compatibility (workers are always new processes)")
      ->envname("PET_START_METHOD");
}

std::string contractFooter() {
  std::ostringstream os;
  os << "\nThe program runs under Python (PYTHON_EXEC, else python3, with -u) when it ends in .py or "
        "with -m/--run-path;\notherwise it is executed directly. Everything after it is passed on "
        "untouched. Every flag is also\nread from PET_<FLAG> (e.g. PET_NPROC_PER_NODE), and "
        "torchrun's underscore spellings are accepted.\n";
  os << "\nExit status:\n"
        "  0    every worker succeeded\n"
        "  N    otherwise: the exit code of the root-cause worker (the first one to fail), not a "
        "blanket 1;\n"
        "       128+S when that worker died of signal S (e.g. 139 for SIGSEGV)\n"
        "  128+S  ctorchrun itself was stopped by signal S (after forwarding it and the grace "
        "period)\n";
  os << "  " << contract::kExitFailure << "    launcher failure    " << contract::kExitUsage
     << "  bad command line    " << contract::kExitRendezvousFailed << "  rendezvous failed\n";
  os << "  " << contract::kExitCannotExecute << "  program not executable    "
     << contract::kExitNotFound << "  program not found\n";
  os << "\nWorker contract (environment of every worker, as torchrun sets it):\n";
  std::size_t width = 0;
  for (const auto& v : contract::kWorkerVariables) width = std::max(width, std::string(v.name).size());
  for (const auto& v : contract::kWorkerVariables) {
    std::string name = v.name;
    os << "  " << name << std::string(width - name.size() + 2, ' ') << v.meaning << "\n";
  }
  os << "  TORCHELASTIC_ERROR_FILE takes torchrun's JSON: {\"message\": {\"message\": \"<Type>: "
        "<what>\",\n  \"extraInfo\": {\"py_callstack\": \"...\", \"timestamp\": \"<unix s>\"}}}; "
        "ctorchrun shows it in its failure summary.\n";
  return os.str();
}

} // namespace

std::string helpText() {
  RawOptions o;
  bool version = false;
  CLI::App app("ctorchrun: a native, torchrun-compatible launcher for distributed training "
               "(C++/LibTorch or Python workers)",
               "ctorchrun");
  build(app, o, version);
  app.footer(contractFooter());
  // CLI11's own usage line knows nothing about the program and its arguments: replace it.
  std::string text = app.help();
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
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : storage) argv.push_back(s.data());
  try {
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
  for (const auto& kv : c.rdzvConf) os << " " << kv.first << "=" << kv.second;
  os << " | role " << c.role << " | max restarts " << c.maxRestarts << " | shutdown timeout "
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
