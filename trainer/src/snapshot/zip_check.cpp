#include "snapshot/zip_check.hpp"

#include "snapshot/utf8.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>
#include <unordered_set>

// The archive is checked against the one layout PyTorchStreamWriter produces, not against the zip
// specification: every local record (header, data, data descriptor) back to back from offset 0, the
// central directory right after them, then the zip64 end record, its locator and the end record
// with no comment, closing the file. LibTorch's reader (miniz) is more forgiving and reads some
// archives differently than a careful reader would: it takes the last end-record signature in the
// file's last 64 KiB, finds names by a case-insensitive binary search, treats a record flagged as a
// directory as empty, and stops names at a NUL. Each rule below closes one such gap, so that the
// records checked here are the records LibTorch later reads (trainer/fuzz/zip_agreement_fuzz.cpp
// compares the two readings).

namespace ctorch::detail {
namespace {

constexpr std::uint32_t kLocalHeaderSig = 0x04034b50;    // PK\3\4
constexpr std::uint32_t kCentralHeaderSig = 0x02014b50;  // PK\1\2
constexpr std::uint32_t kDescriptorSig = 0x08074b50;     // PK\7\8
constexpr std::uint32_t kEndSig = 0x06054b50;            // PK\5\6
constexpr std::uint32_t kEnd64Sig = 0x06064b50;          // PK\6\6
constexpr std::uint32_t kEnd64LocatorSig = 0x07064b50;   // PK\6\7
constexpr std::size_t kEndSize = 22, kEnd64LocatorSize = 20, kEnd64Size = 56;
constexpr std::size_t kCentralHeaderSize = 46, kLocalHeaderSize = 30;
constexpr std::uint16_t kZip64ExtraId = 0x0001;
constexpr std::uint32_t kMax32 = 0xFFFFFFFFu;
constexpr std::uint16_t kMax16 = 0xFFFFu;
// General-purpose flags the writer sets: sizes in a data descriptor (bit 3), UTF-8 names (bit 11).
// Any other (encryption, patch data, masked headers) makes miniz refuse or misread the record.
constexpr std::uint16_t kAllowedFlags = 0x0808;
constexpr std::uint16_t kDescriptorFlag = 0x0008;
constexpr std::uint16_t kUtf8NameFlag = 0x0800;
constexpr std::uint32_t kDosDirectoryAttribute = 0x10;
// miniz copies a name into a 512-byte buffer when LibTorch lists the records.
constexpr std::size_t kMaxNameLength = 511;
// The zip agreement fuzzer builds its own copy without the CRC-32 comparison (LibTorch's reader
// does not check them either), so that mutated structures get past it and reach the comparison.
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
constexpr bool kVerifyCrc = false;
#else
constexpr bool kVerifyCrc = true;
#endif

struct Refused {
  ZipProblem problem;
};
[[noreturn]] void refuse(ZipProblem::Kind kind, std::string detail) {
  throw Refused{{kind, std::move(detail)}};
}
[[noreturn]] void damaged(std::string detail) { refuse(ZipProblem::Kind::Damaged, std::move(detail)); }

struct Reader {
  const unsigned char* data;
  std::size_t size;
  bool has(std::uint64_t offset, std::uint64_t length) const {
    return offset <= size && length <= size - offset;
  }
  std::uint64_t le(std::uint64_t offset, int bytes) const {
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | data[offset + static_cast<std::size_t>(i)];
    return v;
  }
  std::uint16_t u16(std::uint64_t o) const { return static_cast<std::uint16_t>(le(o, 2)); }
  std::uint32_t u32(std::uint64_t o) const { return static_cast<std::uint32_t>(le(o, 4)); }
  std::uint64_t u64(std::uint64_t o) const { return le(o, 8); }
  std::string text(std::uint64_t o, std::size_t n) const {
    return std::string(reinterpret_cast<const char*>(data + o), n);
  }
};

std::uint32_t crcOf(const unsigned char* p, std::uint64_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  while (n > 0) {
    const uInt chunk = static_cast<uInt>(std::min<std::uint64_t>(n, 1u << 30));
    crc = crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

std::string hex8(std::uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

// Bytes as they may appear in a message: control and non-ASCII bytes as '?'.
std::string printable(std::string s) {
  for (auto& ch : s)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7F) ch = '?';
  return s;
}

std::string at(std::uint64_t offset) { return " at offset " + std::to_string(offset); }

// Where the central directory is, from the end records.
struct Directory {
  std::uint64_t entries = 0;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  std::uint64_t endRecordsAt = 0;  // the zip64 end record, or the end record without zip64
};

// The end record must be the file's last 22 bytes, with no comment. miniz takes the last
// end-record signature that has 22 bytes after it, so an archive hidden in a comment (or appended
// after the end) would be what LibTorch reads; this is the one place both readers agree on.
std::uint64_t locateEndRecord(const Reader& r) {
  if (r.size >= kEndSize && r.u32(r.size - kEndSize) == kEndSig && r.u16(r.size - 2) == 0)
    return r.size - kEndSize;
  const std::size_t lowest = r.size >= kEndSize + kMax16 ? r.size - kEndSize - kMax16 : 0;
  for (std::size_t pos = r.size >= kEndSize ? r.size - kEndSize + 1 : 0; pos-- > lowest;) {
    if (r.u32(pos) != kEndSig) continue;
    const std::uint16_t comment = r.u16(pos + 20);
    if (pos + kEndSize == r.size)
      damaged("its end-of-central-directory record" + at(pos) + " declares a " +
              std::to_string(comment) + "-byte comment past the end of the file (an archive hidden "
              "in another's comment?); torch.save writes no comment");
    if (pos + kEndSize + comment == r.size)
      damaged("its end-of-central-directory record" + at(pos) + " has a " + std::to_string(comment) +
              "-byte comment; torch.save writes none, and LibTorch's reader would take any end "
              "record inside it for the archive's");
    // A signature inside tensor data of a file cut short is not an end record: one is only if its
    // central directory fits before it.
    if (std::uint64_t(r.u32(pos + 16)) + r.u32(pos + 12) <= pos)
      damaged(std::to_string(r.size - pos - kEndSize) + " bytes follow the end-of-central-directory "
              "record" + at(pos) + " (a second archive or garbage appended to the file)");
  }
  refuse(ZipProblem::Kind::Truncated, "no end-of-central-directory record at the end of its " +
                                          std::to_string(r.size) + " bytes (the file was cut short)");
}

// The zip64 end record and its locator, exactly as the writer puts them: right before the end
// record, one disk, entry counts and sizes the 32-bit end record repeats (or saturates).
Directory readEndRecords(const Reader& r) {
  const std::uint64_t end = locateEndRecord(r);
  if (r.u16(end + 4) != 0 || r.u16(end + 6) != 0)
    damaged("the end-of-central-directory record names disk " + std::to_string(r.u16(end + 4)) +
            " and " + std::to_string(r.u16(end + 6)) + "; a snapshot is one file");
  if (r.u16(end + 8) != r.u16(end + 10))
    damaged("the end-of-central-directory record counts " + std::to_string(r.u16(end + 8)) +
            " entries on this disk but " + std::to_string(r.u16(end + 10)) + " in all");
  Directory d{r.u16(end + 10), r.u32(end + 16), r.u32(end + 12), end};
  if (end < kEnd64LocatorSize + kEnd64Size || r.u32(end - kEnd64LocatorSize) != kEnd64LocatorSig) {
    // miniz only looks for a locator 76 bytes or more into the file: none may sit anywhere closer.
    if (end >= kEnd64LocatorSize && r.u32(end - kEnd64LocatorSize) == kEnd64LocatorSig)
      damaged("a zip64 locator" + at(end - kEnd64LocatorSize) + " with no room for its end record");
    return d;
  }
  const std::uint64_t locator = end - kEnd64LocatorSize, end64 = locator - kEnd64Size;
  if (r.u32(locator + 4) != 0 || r.u32(locator + 16) != 1 || r.u64(locator + 8) != end64)
    damaged("the zip64 locator" + at(locator) + " points at offset " +
            std::to_string(r.u64(locator + 8)) + " (disk " + std::to_string(r.u32(locator + 4)) +
            " of " + std::to_string(r.u32(locator + 16)) +
            "); the zip64 end record sits right before it, at " + std::to_string(end64));
  if (r.u32(end64) != kEnd64Sig || r.u64(end64 + 4) != kEnd64Size - 12)
    damaged("zip64 end record missing at offset " + std::to_string(end64));
  if (r.u32(end64 + 16) != 0 || r.u32(end64 + 20) != 0)
    damaged("the zip64 end record names another disk; a snapshot is one file");
  const std::uint64_t onDisk = r.u64(end64 + 24), entries = r.u64(end64 + 32),
                      size = r.u64(end64 + 40), offset = r.u64(end64 + 48);
  if (onDisk != entries)
    damaged("the zip64 end record counts " + std::to_string(onDisk) + " entries on this disk but " +
            std::to_string(entries) + " in all");
  if (d.entries != std::min<std::uint64_t>(entries, kMax16) ||
      d.size != std::min<std::uint64_t>(size, kMax32) ||
      d.offset != std::min<std::uint64_t>(offset, kMax32))
    damaged("the end record (" + std::to_string(d.entries) + " entries, directory of " +
            std::to_string(d.size) + " bytes" + at(d.offset) + ") and the zip64 end record (" +
            std::to_string(entries) + ", " + std::to_string(size) + at(offset) + ") disagree");
  if (entries > kMax32 || size > kMax32)
    damaged("a central directory of " + std::to_string(entries) + " entries and " +
            std::to_string(size) + " bytes is beyond what LibTorch's reader opens");
  return {entries, offset, size, end64};
}

// A record as its central directory entry describes it.
struct CentralEntry {
  ZipRecord record;
  std::uint16_t flags = 0;
  std::uint64_t localOffset = 0;
};

// The extra fields of a header: well formed, and a zip64 field only as the writer makes it (the
// 64-bit values of exactly the fields that hold 0xFFFFFFFF, in the specification's order).
// Returns whether a zip64 field is present.
bool readExtraFields(const Reader& r, std::uint64_t from, std::uint16_t length, const std::string& what,
                     bool central, std::initializer_list<std::uint64_t*> fields) {
  bool zip64 = false;
  std::size_t wide = 0, filled = 0;  // fields holding 0xFFFFFFFF, and those a zip64 value replaced
  for (const std::uint64_t* field : fields) wide += *field == kMax32;
  std::uint64_t e = from;
  const std::uint64_t end = from + length;
  while (e < end) {
    if (end - e < 4 || end - e - 4 < r.u16(e + 2))
      damaged(what + " has a malformed extra field" + at(e));
    const std::uint16_t id = r.u16(e), len = r.u16(e + 2);
    if (id == kZip64ExtraId) {
      if (zip64) damaged(what + " has two zip64 extra fields");
      zip64 = true;
      std::uint64_t p = e + 4;
      for (std::uint64_t* field : fields) {
        if (*field != kMax32) continue;
        if (p + 8 > e + 4 + len) damaged(what + " has a zip64 extra field too short for its sizes");
        *field = r.u64(p);
        p += 8;
        ++filled;
      }
      if (central && p != e + 4 + len)
        damaged(what + " has a zip64 extra field of " + std::to_string(len) + " bytes where " +
                std::to_string(p - e - 4) + " are used");
    } else if (central) {
      damaged(what + " carries an extra field of type " + hex8(id) + " (torch.save writes none)");
    }
    e += 4 + len;
  }
  if (central && filled != wide) damaged(what + " holds 0xFFFFFFFF without a zip64 value for it");
  return zip64;
}

// A name LibTorch lists and finds exactly as written: printable, not a folder, short enough to list.
void checkName(const std::string& name, std::uint64_t index) {
  const bool control = std::any_of(name.begin(), name.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x20 || c == 0x7F;
  });
  if (name.empty() || name.size() > kMaxNameLength || control || name.back() == '/')
    damaged("central directory entry " + std::to_string(index) + " has a name LibTorch would read "
            "differently (" + std::to_string(name.size()) + " bytes" + (control ? ", with control characters" : "") +
            (!name.empty() && name.back() == '/' ? ", a folder" : "") + ")");
}

CentralEntry readCentralEntry(const Reader& r, std::uint64_t& cursor, std::uint64_t index,
                              std::uint64_t directoryEnd) {
  const std::uint64_t e = cursor;
  const std::string which = "central directory entry " + std::to_string(index);
  if (e + kCentralHeaderSize > directoryEnd || r.u32(e) != kCentralHeaderSig) damaged(which + " is damaged");
  CentralEntry c;
  ZipRecord& rec = c.record;
  c.flags = r.u16(e + 8);
  rec.method = r.u16(e + 10);
  rec.crc32 = r.u32(e + 16);
  rec.compressedSize = r.u32(e + 20);
  rec.size = r.u32(e + 24);
  const std::uint16_t nameLen = r.u16(e + 28), extraLen = r.u16(e + 30), commentLen = r.u16(e + 32);
  c.localOffset = r.u32(e + 42);
  const std::uint64_t total = kCentralHeaderSize + std::uint64_t(nameLen) + extraLen + commentLen;
  if (total > directoryEnd - e) damaged(which + " runs past the central directory");
  rec.name = r.text(e + kCentralHeaderSize, nameLen);
  checkName(rec.name, index);
  const std::string what = "record '" + rec.name + "'";
  if (commentLen != 0) damaged(what + " has a " + std::to_string(commentLen) + "-byte comment");
  if (r.u16(e + 34) != 0) damaged(what + " starts on disk " + std::to_string(r.u16(e + 34)));
  if ((r.u32(e + 38) & kDosDirectoryAttribute) != 0)
    damaged(what + " is flagged as a directory (LibTorch would read it as empty)");
  if ((c.flags & ~kAllowedFlags) != 0)
    damaged(what + " has general-purpose flags " + hex8(c.flags) + " (encrypted or patch data)");
  // Python's zipfile decodes a name flagged UTF-8 as UTF-8 (and refuses the whole archive when it is
  // not), any other as code page 437: a name LibTorch finds byte for byte must read the same there.
  if ((c.flags & kUtf8NameFlag) != 0 ? !isUtf8(rec.name) : !isAscii(rec.name))
    damaged("record '" + printable(rec.name) + "' has a name that is not " +
            ((c.flags & kUtf8NameFlag) != 0 ? "UTF-8 though flagged so" : "ASCII and not flagged UTF-8") +
            " (Python's zipfile cannot read the archive)");
  readExtraFields(r, e + kCentralHeaderSize + nameLen, extraLen, what, true,
                  {&rec.size, &rec.compressedSize, &c.localOffset});
  cursor = e + total;
  return c;
}

// The record's local header, data and data descriptor, which must start at `cursor` (right after
// the previous record): no bytes between records, none shared by two. Returns where it ends.
std::uint64_t checkLocalRecord(const Reader& r, CentralEntry& c, std::uint64_t cursor,
                               std::uint64_t directoryOffset) {
  ZipRecord& rec = c.record;
  const std::string what = "record '" + rec.name + "'";
  if (!r.has(c.localOffset, kLocalHeaderSize) || r.u32(c.localOffset) != kLocalHeaderSig)
    damaged(what + " has no local header at offset " + std::to_string(c.localOffset));
  if (c.localOffset != cursor)
    damaged(what + "'s local header" + at(c.localOffset) + " is not where the previous record ends (" +
            std::to_string(cursor) + "): records overlap, are out of order, or hide bytes between them");
  const std::uint64_t h = c.localOffset;
  const std::uint16_t nameLen = r.u16(h + 26), extraLen = r.u16(h + 28);
  if (!r.has(h + kLocalHeaderSize, std::uint64_t(nameLen) + extraLen))
    damaged(what + "'s local header runs past the file");
  if (r.text(h + kLocalHeaderSize, nameLen) != rec.name)
    damaged(what + "'s local header names it '" + printable(r.text(h + kLocalHeaderSize, std::min<std::size_t>(nameLen, 80))) + "'");
  if (r.u16(h + 6) != c.flags || r.u16(h + 8) != rec.method)
    damaged(what + "'s local header has other flags or method than its directory entry");
  std::uint64_t unusedSize = r.u32(h + 22), unusedCompressed = r.u32(h + 18), unusedOffset = 0;
  const bool zip64 = readExtraFields(r, h + kLocalHeaderSize + nameLen, extraLen, what + "'s local header",
                                     false, {&unusedSize, &unusedCompressed, &unusedOffset});
  rec.dataOffset = h + kLocalHeaderSize + nameLen + extraLen;
  if (!r.has(rec.dataOffset, rec.compressedSize) || rec.dataOffset + rec.compressedSize > directoryOffset)
    damaged(what + " (" + std::to_string(rec.compressedSize) + " bytes" + at(rec.dataOffset) +
            ") overlaps the central directory or the end of the file");
  if (rec.method != 0)
    refuse(ZipProblem::Kind::NotZip, what + " is compressed (method " + std::to_string(rec.method) +
                                         "); torch.save archives store records");
  // A stored record's two sizes are the same; LibTorch allocates by the uncompressed one.
  if (rec.size != rec.compressedSize)
    damaged("stored " + what + " claims " + std::to_string(rec.size) + " bytes but holds " +
            std::to_string(rec.compressedSize));
  const std::uint32_t actual = crcOf(r.data + rec.dataOffset, rec.compressedSize);
  if (actual != rec.crc32 && kVerifyCrc)
    refuse(ZipProblem::Kind::Checksum,
           what + " (" + std::to_string(rec.size) + " bytes" + at(rec.dataOffset) +
               ") fails its CRC-32 check: recorded " + hex8(rec.crc32) + ", computed " + hex8(actual));
  std::uint64_t end = rec.dataOffset + rec.compressedSize;
  if ((c.flags & kDescriptorFlag) == 0) return end;
  // The data descriptor: 64-bit sizes when the local header has a zip64 field, as the writer does.
  const std::uint64_t length = zip64 ? 24 : 16;
  const bool same = r.has(end, length) && end + length <= directoryOffset && r.u32(end) == kDescriptorSig &&
                    r.u32(end + 4) == rec.crc32 &&
                    (zip64 ? r.u64(end + 8) == rec.compressedSize && r.u64(end + 16) == rec.size
                           : r.u32(end + 8) == rec.compressedSize && r.u32(end + 12) == rec.size);
  if (!same) damaged(what + "'s data descriptor" + at(end) + " is missing or disagrees with its directory entry");
  return end + length;
}

std::string lowered(std::string s) {
  for (auto& ch : s)
    if (ch >= 'A' && ch <= 'Z') ch = static_cast<char>(ch - 'A' + 'a');
  return s;
}

// Names LibTorch finds one way only: in the archive's folder (the first record's), and unique
// ignoring ASCII case, since miniz finds a name by a case-insensitive binary search.
void checkNames(const std::vector<ZipRecord>& records) {
  if (records.empty()) damaged("the archive has no records");
  const std::string& first = records.front().name;
  const auto slash = first.find('/');
  if (slash == std::string::npos) damaged("record '" + first + "' is not in a folder (torch.save puts every record in one)");
  const std::string folder = first.substr(0, slash + 1);
  std::unordered_set<std::string> seen;
  for (const auto& rec : records) {
    if (rec.name.compare(0, folder.size(), folder) != 0)
      damaged("record '" + rec.name + "' is outside the archive's folder '" + folder + "'");
    if (!seen.insert(lowered(rec.name)).second)
      damaged("record name '" + rec.name + "' appears twice (ignoring case); which one LibTorch reads "
              "is up to its search order");
  }
}

ZipCheckResult check(const Reader& r) {
  if (!r.has(0, 4) || r.u32(0) != kLocalHeaderSig)
    refuse(ZipProblem::Kind::NotZip, "does not start with a zip local file header");
  const Directory d = readEndRecords(r);
  if (!r.has(d.offset, d.size) || d.offset + d.size > d.endRecordsAt)
    damaged("central directory (offset " + std::to_string(d.offset) + ", " + std::to_string(d.size) +
            " bytes) lies outside the file");
  if (d.offset + d.size != d.endRecordsAt)
    damaged(std::to_string(d.endRecordsAt - d.offset - d.size) + " bytes lie between the central "
            "directory and the end records");
  ZipCheckResult result;
  std::uint64_t central = d.offset, local = 0;
  const std::uint64_t directoryEnd = d.offset + d.size;
  for (std::uint64_t i = 0; i < d.entries; ++i) {
    CentralEntry c = readCentralEntry(r, central, i, directoryEnd);
    local = checkLocalRecord(r, c, local, d.offset);
    result.records.push_back(std::move(c.record));
  }
  if (central != directoryEnd)
    damaged("central directory size does not match its entries");
  if (local != d.offset)
    damaged(std::to_string(d.offset - local) + " bytes lie between the last record and the central "
            "directory");
  checkNames(result.records);
  return result;
}

} // namespace

ZipCheckResult checkZipArchive(const char* bytes, std::size_t size) {
  try {
    return check(Reader{reinterpret_cast<const unsigned char*>(bytes), size});
  } catch (const Refused& refused) {
    ZipCheckResult result;
    result.problems.push_back(refused.problem);
    return result;
  }
}

} // namespace ctorch::detail
