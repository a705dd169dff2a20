// Recording a worker's fatal error where torchrun and ctorchrun look for it: the JSON file named by
// TORCHELASTIC_ERROR_FILE, in the schema Python's @record (torch.distributed.elastic) writes, so the
// launcher's failure summary shows the C++ exception instead of just an exit code.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <string>

namespace ctorch {

// Writes, atomically, to $TORCHELASTIC_ERROR_FILE:
//   {"message": {"message": "<Type>: <what>",
//                "extraInfo": {"py_callstack": "<details>", "timestamp": "<unix seconds>"}}}
// <Type> is the demangled C++ type (e.g. ctorch::SnapshotCorrupt); <details> adds nested exceptions
// and LibTorch's backtrace where there is one. Returns true when written; false when the variable is
// unset or empty, or when writing failed (then a warning goes to stderr). Never throws: it runs on
// the way out of a failing program.
// ctorch::ConfigError (ResumeRefused included) and SnapshotIncompatible are recorded as not worth
// retrying (extraInfo.ctorch_retry = "never": ctorchrun then does not restart the group for them).
bool recordError(const std::exception& error);
// The same, saying whether a restart could help (false: a deterministic error of the caller's, e.g.
// its own configuration errors).
bool recordError(const std::exception& error, bool retryable);
// The same with a message of the caller's (no exception at hand, e.g. a failed check).
bool recordErrorMessage(const std::string& message, const std::string& details = "", bool retryable = true);

// "<Type>: <what>" for an exception, as Python's f"{type(e).__name__}: {e}" (LibTorch errors
// without their backtrace).
std::string describeException(const std::exception& error);

// A LibTorch backtrace ("frame #3: <symbol> + 0x12 (0x... in lib.so)" lines) without the frames
// that carry no symbol: each run of "<unknown function>" frames becomes one line saying how many
// were left out. Other lines are kept as they are. Used for the error file's details.
std::string trimBacktrace(const std::string& text);

// The JSON text of an error file (ASCII only, as Python's json.dump writes it).
std::string errorFileJson(const std::string& message, const std::string& details,
                          std::chrono::system_clock::time_point when, bool retryable = true);

// Runs `body` the way Python's @record runs a main function: its return value is the exit code; an
// escaping exception is recorded in the error file, printed to stderr as one line, and becomes exit
// code 1 (ctorch::contract::kExitFailure) -- except ctorch::Stopped (a stop signal before there was
// anything to save), which becomes 75 (kExitPreempted) with no record.
//   int main(int argc, char** argv) { return ctorch::runRecorded([&] { return realMain(argc, argv); }); }
int runRecorded(const std::function<int()>& body);

} // namespace ctorch
