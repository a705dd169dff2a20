// Counter-based seed mixing (SplitMix64's finalizer): ResilienceOptions::stepSeed's per-step seeds
// and the data pipeline's augmentation draws are pure functions of (seed, a, b), so a resumed run draws the same.
#pragma once

#include <cstdint>

namespace ctorch {

constexpr std::uint64_t splitMix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A seed for draw (a, b) of the stream `seed`, e.g. (rank, step) or (epoch, sample index).
constexpr std::uint64_t mixBits(std::uint64_t seed, std::uint64_t a, std::uint64_t b) {
  return splitMix64(splitMix64(splitMix64(seed) ^ a) ^ b);
}

} // namespace ctorch
