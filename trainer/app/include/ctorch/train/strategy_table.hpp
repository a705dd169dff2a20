// ctorch-train's ways of sharing a step in one table (strategy_table.cpp): each entry names the flags
// that ask for it, what it does not do (each refusal the one line the user reads), how the model line
// and the recovery line speak of it, and how to make it. TrainOptions::validate checks the options
// against the entries they ask for once (checkStrategy); makeStrategy makes the chosen one. A new
// strategy is a class in strategy.cpp and one entry in the table.
#pragma once

#include "ctorch/train/options.hpp"

#include <memory>
#include <string>
#include <vector>

namespace ctorch::models {
class Model;
}

namespace ctorch::train {

class Strategy;

// What an option asks of a strategy; in a refusal, each is named by its flags as typed.
enum class Feature {
  kSharding,            // "--sharding X": another strategy's flag
  kParameterServer,     // "--sync parameter-server": another strategy's flag
  kLossScaling,         // "--amp float16 (loss scaling)"
  kAmp,                 // "--amp": autocast of any type
  kCudaGraphs,          // "--cuda-graphs"
  kClipping,            // "--clip-grad-norm"
  kAccumulation,        // "--grad-accum-steps N"
  kChannelsLast,        // "--memory-format channels-last"
  kShardCopies,         // "--shard-copies N": in-place recovery of sharded state
  kFsdpMixedPrecision,  // "--fsdp-param-dtype T" (else "--fsdp-reduce-dtype T")
};

// A feature an entry does not support, and the one line that refuses it: "{flags}" becomes the
// entry's flags as typed, "{feature}" the feature's.
struct Refusal {
  Feature feature;
  const char* message;
};

// Whether a lost rank's state can come back in place (ctorchrun --recovery in-place), or only from the
// snapshot files with a group restart.
enum class InPlaceRecovery {
  kYes,               // every rank holds the whole state
  kWithShardCopies,   // sharded state: with --shard-copies 1
  kNo,
};

struct StrategyEntry {
  const char* name;
  // Its flags are given, and them as typed ("--sharding full", "--pipeline-stages 2").
  bool (*chosenBy)(const TrainOptions&);
  std::string (*flags)(const TrainOptions&);
  // What it does not support, refused in this order after what its own flags need (checkOwn).
  std::vector<Refusal> refuses;
  void (*checkOwn)(const TrainOptions&);  // null: nothing beyond their ranges
  InPlaceRecovery inPlaceRecovery;
  // What a data rank is called in the model line.
  const char* dataRankNoun;
  // Why --memory-format auto stays contiguous on CUDA for a convolutional model (null: it does not).
  const char* contiguousBecause;
  // Collective: every rank makes it at the same point, over the model on its device already.
  std::unique_ptr<Strategy> (*make)(const TrainOptions&, const std::shared_ptr<models::Model>&);
};

// Every entry: one per --sharding value's kind (DDP, ZeRO-1, FSDP, hybrid FSDP), then the parameter
// server and the pipeline, which run over an unsharded (DDP) state. The flags of a run ask for one
// --sharding entry and maybe one of the later ones, which is then the one chosen (the last asked for).
const std::vector<StrategyEntry>& strategyTable();
const StrategyEntry& chosenStrategy(const TrainOptions& o);
// Throws UsageError with the first refusal, in table order, of an entry the options ask for; the
// entries after the --sharding ones refuse each other's flags and those of a sharded run.
void checkStrategy(const TrainOptions& o);
// The flags that turn in-place recovery off in this run ("--sync parameter-server", "--sharding full
// --shard-copies 0"); empty when it recovers in place.
std::string inPlaceRecoveryOffWith(const TrainOptions& o);

} // namespace ctorch::train
