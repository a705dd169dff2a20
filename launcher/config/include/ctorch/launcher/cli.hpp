// The ctorchrun command line: torchrun's flags in kebab-case and in torchrun's underscore
// spelling, each also read from torchrun's PET_<FLAG> variable; everything after the training
// program goes to the program untouched. Produces RawOptions (validated later, once, by
// makeLaunchConfig) or the text to print for --help / --version / a usage error.
#pragma once

#include "ctorch/launcher/launch_config.hpp"

#include <string>
#include <vector>

namespace ctorch::launcher {

struct CommandLine {
  RawOptions options;
  bool exitNow = false;  // --help, --version or a usage error: print `message`, exit `exitCode`
  int exitCode = 0;
  std::string message;
};

CommandLine parseCommandLine(const std::vector<std::string>& args);  // args without argv[0]

// The full --help text (ends with the exit codes and the worker contract).
std::string helpText();

// One-line summary of a resolved configuration, logged once at start.
std::string describeConfig(const LaunchConfig& config);

inline constexpr const char* kVersion = "0.1.0";

} // namespace ctorch::launcher
