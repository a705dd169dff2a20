// ctorch-train: parse the command line, run the training, turn the outcome into an exit code.
// Everything else lives in ctorch_train_core (trainer/app/src) so tests can drive it in-process.
#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/data/error.hpp>
#include <ctorch/error_file.hpp>
#include <ctorch/errors.hpp>
#include <ctorch/models/registry.hpp>
#include <ctorch/snapshot.hpp>
#include <ctorch/train/options.hpp>
#include <ctorch/stop_signal.hpp>
#include <ctorch/train/trainer.hpp>

#include <unistd.h>

#include <iostream>

namespace {

// Configuration that cannot work, found after parsing (a missing data file, a snapshot of another
// run, a bad environment): recorded like any failure, but the exit code says "fix the input".
int configurationFailure(const std::exception& e) {
  ctorch::recordError(e, /*retryable=*/false);  // ctorchrun does not restart the group for it
  std::cerr << "ctorch-train: error: " << e.what() << std::endl;
  return ctorch::contract::kExitUsage;
}

// Any other failure of the project's own (a peer lost, a collective timed out): recorded with its type
// for the launcher's summary, printed as its message alone (it names what failed), exit code 1.
int ownFailure(const std::exception& e) {
  ctorch::recordError(e);
  std::cerr << "ctorch-train: error: " << e.what() << std::endl;
  return ctorch::contract::kExitFailure;
}

int trainMain(int argc, char** argv) {
  auto parsed = ctorch::train::parseCommandLine(argc, argv);
  if (!parsed.options) {
    (parsed.toStderr ? std::cerr : std::cout) << parsed.message << std::flush;
    if (parsed.exitCode != 0) {  // a bad command line: in the error file, and not worth a restart
      std::string first = parsed.message.substr(0, parsed.message.find('\n'));
      const std::string prefix = "ctorch-train: error: ";
      if (first.rfind(prefix, 0) == 0) first.erase(0, prefix.size());
      ctorch::recordErrorMessage("ctorch::train::UsageError: " + first, parsed.message, /*retryable=*/false);
    }
    return parsed.exitCode;
  }
  ctorch::installStopHandlers();
  ctorch::train::RunHooks hooks;
  hooks.terminal = isatty(STDOUT_FILENO) == 1;
  try {
    return ctorch::train::runTraining(*parsed.options, hooks).exitCode();
  } catch (const ctorch::train::UsageError& e) {
    return configurationFailure(e);
  } catch (const ctorch::ConfigError& e) {
    return configurationFailure(e);
  } catch (const ctorch::SnapshotIncompatible& e) {
    return configurationFailure(e);
  } catch (const ctorch::SamplerResumeRefused& e) {
    return configurationFailure(e);
  } catch (const ctorch::data::DataError& e) {  // a data file missing, unreadable or malformed; a bad data option
    return configurationFailure(e);
  } catch (const ctorch::models::ModelOptionsError& e) {
    return configurationFailure(e);
  } catch (const ctorch::WriteFailed& e) {  // a full or failing disk: every rank stopped together
    ctorch::recordError(e);
    std::cerr << "ctorch-train: error: " << e.what() << std::endl;
    return ctorch::contract::kExitWriteFailed;
  } catch (const ctorch::Stopped& e) {  // a spare stopped before it held a rank: nothing to save
    std::cerr << "ctorch-train: " << e.what() << std::endl;
    return ctorch::contract::kExitPreempted;
  } catch (const ctorch::Error& e) {
    return ownFailure(e);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Anything else escaping is recorded in TORCHELASTIC_ERROR_FILE and becomes exit code 1.
  return ctorch::runRecorded([&] { return trainMain(argc, argv); });
}
