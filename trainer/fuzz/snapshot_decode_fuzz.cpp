// libFuzzer target: ctorch::decodeSnapshot on arbitrary bytes (issue 12). Any outcome but a
// SnapshotError (or a clean return) is a finding: a crash, a sanitizer report, a hang, another
// exception type escaping. Built by scripts/fuzz.sh, outside the normal build.
// Each input is decoded twice: as the file's bytes, and as data.pkl inside an archive with valid
// CRC-32s (random bytes almost never pass the CRC check, so without this the pickle scan, the
// unpickler and the tensor checks would rarely be reached).
// With CTORCH_FUZZ_SEED_DIR set, writes a small valid snapshot and its data.pkl there as seeds.
#include "ctorch/snapshot.hpp"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <sstream>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("CTORCH_FUZZ_SEED_DIR");
  if (dir == nullptr) return 0;
  ctorch::Snapshot s;
  s.header.modelName = "seed";
  s.header.config = {{"lr", "0.1"}};
  s.modelState.insert("weight", at::arange(6, at::kFloat).reshape({2, 3}));
  s.modelState.insert("bias", at::zeros({2}));
  s.optimizerType = "SGD";
  s.optimizerState.insert("state", c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  s.userState.insert("history", c10::List<double>({0.5, 0.25}));
  s.userState.insert("note", std::string("seed"));
  const auto bytes = ctorch::encodeSnapshot(s);
  std::ofstream(std::string(dir) + "/valid-snapshot.pt", std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  caffe2::serialize::PyTorchStreamReader reader(&in);
  auto [pkl, size] = reader.getRecord("data.pkl");
  std::ofstream(std::string(dir) + "/valid-data.pkl", std::ios::binary)
      .write(static_cast<const char*>(pkl.get()), static_cast<std::streamsize>(size));
  return 0;
}

namespace {
// The input as data.pkl, with data/0 .. data/3 records of 64 bytes for persistent ids to name.
std::vector<char> asArchive(const std::uint8_t* data, std::size_t size) {
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, std::size_t n) {
    const auto* c = static_cast<const char*>(p);
    out.insert(out.end(), c, c + n);
    return n;
  });
  static const char kStorage[64] = {1, 2, 3};
  for (int i = 0; i < 4; ++i) writer.writeRecord("data/" + std::to_string(i), kStorage, sizeof kStorage);
  writer.writeRecord("data.pkl", data, size);
  writer.writeEndOfFile();
  return out;
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::vector<char> bytes(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  try {
    (void)ctorch::decodeSnapshot(bytes, "fuzz/snapshot.pt");
  } catch (const ctorch::SnapshotError&) {
    // The expected outcome for nearly every input: named and refused.
  }
  try {
    (void)ctorch::decodeSnapshot(asArchive(data, size), "fuzz/snapshot.pt");
  } catch (const ctorch::SnapshotError&) {
  }
  return 0;
}
