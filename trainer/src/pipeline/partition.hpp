// The pipeline's pure pieces below the public API (ctorch/pipeline.hpp), for the library and its
// tests: the partition of parameter counts balancedPartition() is made of, and an action list as
// text. Not installed.
#pragma once

#include "ctorch/pipeline.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace ctorch {

// balancedPartition() over the children's parameter counts: each of `stages` contiguous stages (at
// least one child each) with the largest count as small as it can be; ties go to the earlier cut.
// Throws ConfigError when there are fewer children than stages or stages < 1.
std::vector<std::size_t> balancedPartitionOfCounts(const std::vector<std::int64_t>& childParameterCounts, int stages);

// "F0 F1 B0 B1": for logs and tests.
std::string describeActions(const std::vector<PipelineAction>& actions);

} // namespace ctorch
