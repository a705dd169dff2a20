// Small files of pickled values for the sharding tests' save-then-resume workers (torch::pickle_save /
// pickle_load), shared by the ZeRO and FSDP tests.
#pragma once

#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace sharding_test {

inline void writeValue(const std::filesystem::path& file, const c10::IValue& value) {
  const auto bytes = torch::pickle_save(value);
  std::ofstream(file, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline c10::IValue readValue(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes);
}

// A string-keyed dict read back from a file.
inline c10::Dict<std::string, c10::IValue> itemDict(const c10::IValue& value) {
  return c10::impl::toTypedDict<std::string, c10::IValue>(value.toGenericDict());
}

} // namespace sharding_test
