// The shape of ctorch-train's command line, checked before CLI11 parses it (argument_check.cpp):
// unknown flags with a "did you mean", missing values, values that are not numbers. Private to
// command_line.cpp, which adds the flags and records each one's kind of value.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace ctorch::train {

enum class ValueKind { kFlag, kInt64, kInt32, kNumber, kText };

// The flags ctorch-train knows, by their kebab spelling ("--batch-size").
using FlagKinds = std::map<std::string, ValueKind>;

// A whole number that fits the kind (kInt64 or kInt32), as strtoll reads it with nothing left over.
bool isWholeNumber(const std::string& text, ValueKind kind);

// Throws UsageError for the first argument that is not a known option, lacks its value, or has a
// value that is not a number where one is needed. `typed` are the arguments as given, `args` the
// same with kebab flag names.
void checkArguments(const std::vector<std::string>& typed, const std::vector<std::string>& args,
                    const FlagKinds& known);

}  // namespace ctorch::train
