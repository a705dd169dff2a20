// One reading of the zip (issue 47): the archive ctorch checks must be the archive LibTorch reads.
// Crafted files, each made from a genuine snapshot of this build, where a lenient reader and a
// careful one would see different records: an archive hidden in the end record's comment, bytes
// after the end, duplicate names, overlapping records, a local header naming another record, zip64
// end records that disagree, a record flagged as a directory. Each is refused and named; the next
// good snapshot resumes. And for genuine archives, ctorch's record list is LibTorch's.
#include "crafting.hpp"
#include "fixtures.hpp"
#include "snapshot/zip_check.hpp"

#include "multiproc.hpp"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <sstream>

using namespace snaptest;
using ctorch::test::TempDir;
using Kind = ctorch::SnapshotCorrupt::Kind;

namespace {

// Each record as "name @ data offset + size", in central-directory order.
using RecordList = std::vector<std::string>;
std::string describe(const std::string& name, std::uint64_t offset, std::uint64_t size) {
  return name + " @ " + std::to_string(offset) + " + " + std::to_string(size);
}

RecordList checkedRecords(const std::vector<char>& bytes) {
  const auto zip = ctorch::detail::checkZipArchive(bytes.data(), bytes.size());
  INFO((zip.problems.empty() ? std::string() : zip.problems.front().detail));
  REQUIRE(zip.problems.empty());
  RecordList out;
  for (const auto& r : zip.records) out.push_back(describe(r.name, r.dataOffset, r.size));
  return out;
}

// What LibTorch's reader (miniz) opens, named with the archive's folder as the zip check names them.
RecordList readerRecords(const std::vector<char>& bytes) {
  std::istringstream in(asString(bytes));
  caffe2::serialize::PyTorchStreamReader reader(&in);
  const auto first = layoutOf(bytes).entries.front().name;
  const auto folder = first.substr(0, first.find('/') + 1);
  RecordList out;
  for (const auto& name : reader.getAllRecords()) {
    auto [data, size] = reader.getRecord(name);
    out.push_back(describe(folder + name, reader.getRecordOffset(name), size));
  }
  return out;
}

// Two storage records whose names have the same length ("archive/data/0", "archive/data/1").
std::pair<std::string, std::string> twoStorageNames(const ZipLayout& z) {
  for (const auto& a : z.entries)
    for (const auto& b : z.entries)
      if (&a != &b && a.name.find("/data/") != std::string::npos &&
          b.name.find("/data/") != std::string::npos && a.name.size() == b.name.size())
        return {a.name, b.name};
  FAIL("no two storage records of the same name length");
  return {};
}

std::string refusal(const std::vector<char>& bytes, Kind expected = Kind::Damaged) {
  std::string msg;
  const auto kind = corruptionOf(bytes, &msg);
  INFO(msg);
  CHECK(kind == expected);
  return msg;
}

// A lying snapshot: the marker (64 floats, a 256-byte record) declares a storage of 2^28 floats
// and a view over all of it. Its own content checks pass; hashing it reads 1 GB past its buffer.
std::vector<char> lyingArchive() {
  auto top = torch::jit::pickle_load(encoded(populatedSnapshot(3))).toGenericDict();
  auto marker = top.at("USER_STATE").toGenericDict().at("marker").toTensor();
  marker.unsafeGetTensorImpl()->set_sizes_contiguous({std::int64_t(1) << 28});
  return withPickle(torch::jit::pickle_save(top), [](std::string& pkl) {
    replaceOnce(pkl, std::string("K\x40tQ", 4), "J" + le32(1u << 28) + "tQ");
  });
}

// `genuine` whose end record's comment holds `hidden`, moved to where it lies in the file; the
// hidden end record's own comment length points past the end (a careful reader skips it).
std::vector<char> hiddenInComment(const std::vector<char>& genuine, const std::vector<char>& hidden) {
  auto out = genuine;
  putLe(out, out.size() - 2, 2, hidden.size());
  auto moved = relocated(hidden, genuine.size());
  putLe(moved, moved.size() - 2, 2, 0xFFFF);
  out.insert(out.end(), moved.begin(), moved.end());
  return out;
}

} // namespace

TEST_CASE("genuine archives: the zip check's records are LibTorch's records", "[snapshot][zip]") {
  // Names, data offsets and sizes, in central-directory order, for what this build's writer makes:
  // a snapshot, pickle_save's archive, and records of odd sizes (empty, unaligned).
  const auto snapshot = encoded(populatedSnapshot(3));
  const auto top = torch::jit::pickle_load(snapshot);
  for (const auto& bytes : {snapshot, torch::jit::pickle_save(top),
                            archiveOf({{"data.pkl", "\x80\x02N."}, {"empty", ""}, {"odd", std::string(77, 'x')}})}) {
    const auto checked = checkedRecords(bytes);
    CHECK(checked == readerRecords(bytes));
    CHECK(checked.size() >= 2);
  }
}

TEST_CASE("an archive hidden in the end record's comment is refused and the next snapshot resumes",
          "[snapshot][zip][hostile]") {
  // The genuine archive is what a careful reader checks; LibTorch's reader takes the last end record
  // in the file and reads the hidden, lying one (before the fix: a crash hashing the marker).
  const auto genuine = encoded(populatedSnapshot(3));
  const auto crafted = hiddenInComment(genuine, lyingArchive());
  std::istringstream in(asString(crafted));
  caffe2::serialize::PyTorchStreamReader reader(&in);
  CHECK(reader.getRecordOffset("data.pkl") > genuine.size());  // the craft is what the issue says

  const auto o = resumeBeside(crafted, "hidden");
  CHECK(o.has("/snapshot.pt: snapshot "));
  CHECK(o.has("-byte comment past the end of the file"));
}

TEST_CASE("a comment, bytes after the end record, or a second end record are refused", "[snapshot][zip]") {
  const auto genuine = encoded(populatedSnapshot(3));
  REQUIRE_FALSE(corruptionOf(genuine));

  auto commented = genuine;
  putLe(commented, commented.size() - 2, 2, 5);
  commented.insert(commented.end(), {'h', 'e', 'l', 'l', 'o'});
  CHECK_THAT(refusal(commented), Catch::Contains("has a 5-byte comment"));

  auto appended = genuine;
  appended.insert(appended.end(), 100, 'x');
  CHECK_THAT(refusal(appended), Catch::Contains("100 bytes follow the end-of-central-directory record"));

  auto secondEnd = genuine;  // a copy of the end record after the real one: the last is taken
  secondEnd.insert(secondEnd.end(), genuine.end() - 22, genuine.end());
  CHECK_THAT(refusal(secondEnd), Catch::Contains("bytes lie between the central directory and the end records"));
}

TEST_CASE("record names that appear twice, also ignoring case, are refused", "[snapshot][zip]") {
  // miniz finds a name by a case-insensitive binary search: which of two it returns is its sort's.
  const auto genuine = encoded(populatedSnapshot(3));
  const auto [a, b] = twoStorageNames(layoutOf(genuine));
  auto twice = genuine;
  renameRecord(twice, b, a);
  CHECK_THAT(refusal(twice), Catch::Contains("record name '" + a + "' appears twice"));

  std::string upper = a;
  for (std::size_t i = upper.find('/') + 1; i < upper.size(); ++i)
    upper[i] = static_cast<char>(std::toupper(static_cast<unsigned char>(upper[i])));
  auto cased = genuine;
  renameRecord(cased, b, upper);
  CHECK_THAT(refusal(cased), Catch::Contains("appears twice (ignoring case)"));
}

TEST_CASE("overlapping records and a local header naming another record are refused", "[snapshot][zip]") {
  const auto genuine = encoded(populatedSnapshot(3));
  const auto z = layoutOf(genuine);
  const auto [a, b] = twoStorageNames(z);
  const auto& e = z.entry(a);

  // `a` grown over the next record's local header (its CRC-32 recomputed, no data descriptor):
  // its bytes are also the next record's.
  auto overlap = genuine;
  std::size_t next = overlap.size();
  for (const auto& other : z.entries)
    if (other.local > e.local) next = std::min(next, other.local);
  const std::size_t grown = next + 30 - e.data;
  for (std::size_t at : {e.central + 20, e.central + 24}) putLe(overlap, at, 4, grown);
  putLe(overlap, e.central + 16, 4, crcOf(overlap.data() + e.data, grown));
  for (std::size_t at : {e.central + 8, e.local + 6}) putLe(overlap, at, 2, getLe(overlap, at, 2) & ~0x8u);
  CHECK_THAT(refusal(overlap), Catch::Contains("records overlap, are out of order, or hide bytes"));

  auto misnamed = genuine;
  const std::string other = b;
  std::copy(other.begin(), other.end(), misnamed.begin() + static_cast<std::ptrdiff_t>(e.local + 30));
  CHECK_THAT(refusal(misnamed), Catch::Contains("record '" + a + "''s local header names it '" + b + "'"));
}

TEST_CASE("zip64 end records that disagree with the end record or name other disks are refused",
          "[snapshot][zip]") {
  const auto genuine = encoded(populatedSnapshot(3));
  const auto z = layoutOf(genuine);
  REQUIRE(z.locator != 0);  // LibTorch's writer always writes the zip64 end records
  const auto entries = getLe(genuine, z.end + 10, 2);

  // The end record counts one entry fewer: a reader without zip64 would miss the last record.
  auto fewer = genuine;
  putLe(fewer, z.end + 8, 2, entries - 1);
  putLe(fewer, z.end + 10, 2, entries - 1);
  CHECK_THAT(refusal(fewer), Catch::Contains("and the zip64 end record (" + std::to_string(entries)));

  // Entries on this disk and in all differ: LibTorch's reader refuses what the check accepted.
  auto split = genuine;
  putLe(split, z.end64 + 24, 8, entries - 1);
  CHECK_THAT(refusal(split), Catch::Contains("the zip64 end record counts"));

  auto disks = genuine;
  putLe(disks, z.locator + 16, 4, 2);
  CHECK_THAT(refusal(disks), Catch::Contains("the zip64 locator"));
}

TEST_CASE("a record flagged as a directory or as encrypted is refused", "[snapshot][zip]") {
  // miniz extracts nothing for a directory: LibTorch would hash an uninitialised buffer.
  const auto genuine = encoded(populatedSnapshot(3));
  const auto z = layoutOf(genuine);
  const auto [a, b] = twoStorageNames(z);
  auto directory = genuine;
  putLe(directory, z.entry(a).central + 38, 4, 0x10);
  CHECK_THAT(refusal(directory), Catch::Contains("is flagged as a directory"));

  auto encrypted = genuine;
  for (std::size_t at : {z.entry(a).central + 8, z.entry(a).local + 6})
    putLe(encrypted, at, 2, getLe(encrypted, at, 2) | 0x1);
  CHECK_THAT(refusal(encrypted), Catch::Contains("general-purpose flags"));
}
