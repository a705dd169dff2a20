// How each of strategy.cpp's strategies is made (private to the app): the table's `make` column
// (strategy_table.cpp).
#pragma once

#include "ctorch/train/strategy.hpp"

namespace ctorch::train {

// DDP with the whole optimizer, or ZeRO-1's share of it (--sharding optimizer).
std::unique_ptr<Strategy> makeDataParallel(const TrainOptions& o, const std::shared_ptr<models::Model>& model);
// FSDP (--sharding grad-op|full|hybrid|hybrid-grad-op).
std::unique_ptr<Strategy> makeFullySharded(const TrainOptions& o, const std::shared_ptr<models::Model>& model);
std::unique_ptr<Strategy> makeParameterServing(const TrainOptions& o, const std::shared_ptr<models::Model>& model);
std::unique_ptr<Strategy> makePipelined(const TrainOptions& o, const std::shared_ptr<models::Model>& model);

} // namespace ctorch::train
