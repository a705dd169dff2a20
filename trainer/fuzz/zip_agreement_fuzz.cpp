// libFuzzer target: the zip layer's two readings agree (issue 47). For every input that
// ctorch's zip check accepts, LibTorch's reader (PyTorchStreamReader over miniz) must open it and
// list the very same records: names (after the archive's folder), in the same order, each at the
// same data offset with the same size and the same bytes. A disagreement, a reader that refuses
// what the check accepted, a crash or a sanitizer report is a finding. Built by scripts/fuzz.sh,
// outside the normal build. With CTORCH_FUZZ_SEED_DIR set, writes a small valid snapshot there.
#include "ctorch/snapshot.hpp"
#include "snapshot/zip_check.hpp"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = std::getenv("CTORCH_FUZZ_SEED_DIR");
  if (dir == nullptr) return 0;
  ctorch::Snapshot s;
  s.header.modelName = "seed";
  s.modelState.insert("weight", at::arange(6, at::kFloat).reshape({2, 3}));
  s.modelState.insert("bias", at::zeros({2}));
  s.optimizerType = "SGD";
  s.optimizerState.insert("state", c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  const auto bytes = ctorch::encodeSnapshot(s);
  // A seed the check refuses would leave the comparison below unexercised.
  const auto zip = ctorch::detail::checkZipArchive(bytes.data(), bytes.size());
  if (!zip.problems.empty()) {
    std::fprintf(stderr, "zip_agreement_fuzz: the seed is refused: %s\n", zip.problems.front().detail.c_str());
    std::abort();
  }
  std::ofstream(std::string(dir) + "/valid-snapshot.pt", std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return 0;
}

namespace {
[[noreturn]] void disagree(const std::string& what) {
  std::fprintf(stderr, "zip_agreement_fuzz: the check and LibTorch's reader disagree: %s\n", what.c_str());
  std::abort();
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* bytes = reinterpret_cast<const char*>(data);
  const auto zip = ctorch::detail::checkZipArchive(bytes, size);
  if (!zip.problems.empty()) return 0;  // refused: nothing reaches LibTorch's reader
  std::istringstream in(std::string(bytes, size));
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(&in);
  } catch (const c10::Error& e) {
    // The reader also parses the version record's text: refusing that is a content rule, checked
    // after the zip layer (format.cpp), not a different reading of the archive.
    if (std::strstr(e.what(), "version") != nullptr) return 0;
    disagree(std::string("the reader refuses an accepted archive: ") + e.what());
  }
  try {
    const auto names = reader->getAllRecords();
    if (names.size() != zip.records.size())
      disagree(std::to_string(zip.records.size()) + " records checked, " + std::to_string(names.size()) + " listed");
    const std::string& first = zip.records.front().name;
    const std::string folder = first.substr(0, first.find('/') + 1);
    for (std::size_t i = 0; i < names.size(); ++i) {
      const auto& rec = zip.records[i];
      if (folder + names[i] != rec.name) disagree("record " + std::to_string(i) + ": '" + rec.name + "' vs '" + names[i] + "'");
      const auto offset = reader->getRecordOffset(names[i]);
      auto [ptr, length] = reader->getRecord(names[i]);
      if (offset != rec.dataOffset || length != rec.size)
        disagree("'" + rec.name + "' at " + std::to_string(rec.dataOffset) + " (" + std::to_string(rec.size) +
                 " bytes) vs at " + std::to_string(offset) + " (" + std::to_string(length) + " bytes)");
      if (length > 0 && std::memcmp(ptr.get(), bytes + rec.dataOffset, length) != 0)
        disagree("'" + rec.name + "' holds other bytes");
    }
  } catch (const c10::Error& e) {
    disagree(std::string("the reader fails on an accepted archive: ") + e.what());
  }
  return 0;
}
