// Byte surgery for crafted snapshots: archives written by LibTorch's own writer, their pickle
// rewritten, and the zip structures of a writer-produced archive located and patched, so that a
// crafted file follows the format of the build it is made with.
#pragma once

#include "fixtures.hpp"
#include "multiproc.hpp"

#include <caffe2/serialize/inline_container.h>

#include <zlib.h>

#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace snaptest {

inline std::string asString(const std::vector<char>& v) { return std::string(v.begin(), v.end()); }

// A torch.save-style archive of the given records (CRCs computed by LibTorch's writer).
inline std::vector<char> archiveOf(const std::vector<std::pair<std::string, std::string>>& records) {
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, std::size_t n) {
    const auto* c = static_cast<const char*>(p);
    out.insert(out.end(), c, c + n);
    return n;
  });
  for (const auto& [name, data] : records) writer.writeRecord(name, data.data(), data.size());
  writer.writeEndOfFile();
  return out;
}

// Re-writes an archive with its data.pkl changed by `edit` (every other record kept) and `extra`
// records added before data.pkl.
inline std::vector<char> withPickle(const std::vector<char>& archive,
                                    const std::function<void(std::string&)>& edit,
                                    const std::vector<std::pair<std::string, std::string>>& extra = {}) {
  std::istringstream in(asString(archive));
  caffe2::serialize::PyTorchStreamReader reader(&in);
  std::vector<std::pair<std::string, std::string>> records;
  for (const auto& name : reader.getAllRecords()) {
    if (name == "version" || name == ".data/version") continue;  // the writer adds its own
    auto [data, size] = reader.getRecord(name);
    std::string bytes(static_cast<const char*>(data.get()), size);
    if (name == "data.pkl") {
      edit(bytes);
      records.insert(records.end(), extra.begin(), extra.end());
    }
    records.emplace_back(name, std::move(bytes));
  }
  return archiveOf(records);
}

inline void replaceOnce(std::string& s, const std::string& from, const std::string& to) {
  const auto at = s.find(from);
  REQUIRE(at != std::string::npos);
  REQUIRE(s.find(from, at + 1) == std::string::npos);
  s.replace(at, from.size(), to);
}

inline std::string le32(std::uint32_t v) {
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
  return out;
}

inline std::uint64_t getLe(const std::vector<char>& b, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b.at(at + i));
  return v;
}

inline void putLe(std::vector<char>& b, std::size_t at, int bytes, std::uint64_t v) {
  for (int i = 0; i < bytes; ++i) b.at(at + i) = static_cast<char>(v >> (8 * i));
}

inline std::uint32_t crcOf(const char* p, std::size_t n) {
  return static_cast<std::uint32_t>(crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(p),
                                          static_cast<uInt>(n)));
}

// Where the zip structures of a writer-produced archive are (its end record is its last 22 bytes).
struct ZipLayout {
  struct Entry {
    std::string name;
    std::size_t central = 0;  // its central directory entry
    std::size_t local = 0;    // its local header
    std::size_t data = 0;     // its first data byte
    std::size_t size = 0;
  };
  std::size_t end = 0;
  std::size_t locator = 0, end64 = 0;  // 0: none
  std::size_t directory = 0;
  std::vector<Entry> entries;
  const Entry& entry(const std::string& name) const {
    for (const auto& e : entries)
      if (e.name == name) return e;
    FAIL("no record " << name);
    return entries.front();
  }
};

inline ZipLayout layoutOf(const std::vector<char>& zip) {
  ZipLayout z;
  z.end = zip.size() - 22;
  REQUIRE(getLe(zip, z.end, 4) == 0x06054b50u);
  if (getLe(zip, z.end - 20, 4) == 0x07064b50u) {
    z.locator = z.end - 20;
    z.end64 = getLe(zip, z.locator + 8, 8);
  }
  z.directory = getLe(zip, z.end + 16, 4);
  std::size_t at = z.directory;
  for (std::uint64_t i = 0, n = getLe(zip, z.end + 10, 2); i < n; ++i) {
    REQUIRE(getLe(zip, at, 4) == 0x02014b50u);
    ZipLayout::Entry e;
    const auto nameLen = getLe(zip, at + 28, 2);
    e.name.assign(zip.data() + at + 46, nameLen);
    e.central = at;
    e.local = getLe(zip, at + 42, 4);
    e.data = e.local + 30 + getLe(zip, e.local + 26, 2) + getLe(zip, e.local + 28, 2);
    e.size = getLe(zip, at + 24, 4);
    z.entries.push_back(e);
    at += 46 + nameLen + getLe(zip, at + 30, 2) + getLe(zip, at + 32, 2);
  }
  return z;
}

// The archive moved `by` bytes into a file: every offset it holds shifted (records, directory,
// zip64 end record).
inline std::vector<char> relocated(std::vector<char> zip, std::uint64_t by) {
  const auto z = layoutOf(zip);
  for (const auto& e : z.entries) putLe(zip, e.central + 42, 4, e.local + by);
  putLe(zip, z.end + 16, 4, z.directory + by);
  if (z.locator != 0) {
    putLe(zip, z.locator + 8, 8, z.end64 + by);
    putLe(zip, z.end64 + 48, 8, getLe(zip, z.end64 + 48, 8) + by);
  }
  return zip;
}

// Renames a record in its central directory entry and its local header (same length, so nothing
// moves; names are outside the CRC-32).
inline void renameRecord(std::vector<char>& zip, const std::string& from, const std::string& to) {
  REQUIRE(from.size() == to.size());
  const auto e = layoutOf(zip).entry(from);
  std::copy(to.begin(), to.end(), zip.begin() + static_cast<std::ptrdiff_t>(e.central + 46));
  std::copy(to.begin(), to.end(), zip.begin() + static_cast<std::ptrdiff_t>(e.local + 30));
}

// The worker's result: how the crafted file was judged and whether the search went on.
struct Outcome {
  ctorch::test::ProcessResult process;
  bool has(const std::string& text) const { return process.output.find(text) != std::string::npos; }
};

// What --resume auto does in `dir`, in a child (the worker resume_newest_valid of
// snapshot_hostile_test.cpp: a crash or a hang must not take the test with it); it must skip snapshot.pt and resume from the good snapshot.pt.1 (epoch 2).
inline Outcome resumeIn(const ctorch::test::TempDir& dir, std::chrono::seconds timeout) {
  ctorch::test::SpawnOptions so;
  so.argv = {ctorch::test::selfExe().string(), "--ctorch-worker", "resume_newest_valid",
             (dir / "snapshot.pt").string()};
  so.timeout = timeout;
  Outcome o{ctorch::test::run(so)};
  INFO(o.process.output);
  CHECK(o.process.ok());
  CHECK(o.has("resumed from snapshot.pt.1 at epoch 2"));
  return o;
}

// snapshot.pt = crafted, snapshot.pt.1 and .2 good (epochs 2 and 1).
inline Outcome resumeBeside(const std::vector<char>& crafted, const std::string& tag) {
  ctorch::test::TempDir dir("snap-crafted-" + tag);
  ctorch::test::writeFile(dir / "snapshot.pt", asString(crafted));
  ctorch::test::writeFile(dir / "snapshot.pt.1", asString(encoded(populatedSnapshot(2))));
  ctorch::test::writeFile(dir / "snapshot.pt.2", asString(encoded(populatedSnapshot(1))));
  return resumeIn(dir, std::chrono::seconds(60));
}


} // namespace snaptest
