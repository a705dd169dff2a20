// The tests' own reader of TensorBoard event files, written apart from the library's writer: a
// bitwise CRC-32C (the library's is table-driven), the TFRecord framing, a generic protobuf field
// walker and the Event fields a scalar writer sets. Plus running read_events.py, the reader with
// protobuf's own parser (needs /usr/bin/python3 with python3-protobuf, and protoc).
#pragma once

#include "multiproc.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tbtest {

namespace fs = std::filesystem;

inline std::uint32_t bitwiseCrc32c(std::string_view data) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (const char ch : data) {
    crc ^= static_cast<unsigned char>(ch);
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

inline std::uint32_t maskedCrc(std::string_view data) {
  const std::uint32_t crc = bitwiseCrc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

inline std::uint64_t littleEndian(std::string_view bytes) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < bytes.size(); ++i) v |= std::uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  return v;
}

// The records' data; throws std::runtime_error at a bad CRC or a cut record.
inline std::vector<std::string> readRecords(std::string_view bytes) {
  std::vector<std::string> out;
  while (!bytes.empty()) {
    if (bytes.size() < 12) throw std::runtime_error("a cut record header");
    const std::uint64_t length = littleEndian(bytes.substr(0, 8));
    if (littleEndian(bytes.substr(8, 4)) != maskedCrc(bytes.substr(0, 8)))
      throw std::runtime_error("the length's CRC does not hold");
    if (bytes.size() - 12 < length + 4) throw std::runtime_error("a cut record");
    const std::string_view data = bytes.substr(12, length);
    if (littleEndian(bytes.substr(12 + length, 4)) != maskedCrc(data))
      throw std::runtime_error("the data's CRC does not hold");
    out.emplace_back(data);
    bytes.remove_prefix(16 + length);
  }
  return out;
}

struct Field {
  std::uint32_t number = 0;
  int wire = 0;
  std::uint64_t value = 0;  // varint, fixed64, fixed32
  std::string bytes;        // length-delimited
};

inline std::uint64_t readVarint(std::string_view& in) {
  std::uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (in.empty()) throw std::runtime_error("a cut varint");
    const auto b = static_cast<unsigned char>(in.front());
    in.remove_prefix(1);
    v |= std::uint64_t{b & 0x7fu} << shift;
    if (!(b & 0x80u)) return v;
  }
  throw std::runtime_error("a varint over 10 bytes");
}

inline std::vector<Field> readFields(std::string_view in) {
  std::vector<Field> out;
  while (!in.empty()) {
    const std::uint64_t key = readVarint(in);
    Field f;
    f.number = static_cast<std::uint32_t>(key >> 3);
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) {
      f.value = readVarint(in);
    } else if (f.wire == 1 || f.wire == 5) {
      const std::size_t n = f.wire == 1 ? 8 : 4;
      if (in.size() < n) throw std::runtime_error("a cut fixed field");
      f.value = littleEndian(in.substr(0, n));
      in.remove_prefix(n);
    } else if (f.wire == 2) {
      const std::uint64_t n = readVarint(in);
      if (in.size() < n) throw std::runtime_error("a cut length-delimited field");
      f.bytes = std::string(in.substr(0, n));
      in.remove_prefix(n);
    } else {
      throw std::runtime_error("wire type " + std::to_string(f.wire));
    }
    out.push_back(f);
  }
  return out;
}

struct Event {
  double wallTime = 0;
  std::int64_t step = 0;
  std::optional<std::string> fileVersion;
  std::optional<std::uint64_t> sessionStatus;
  std::vector<std::pair<std::string, float>> values;  // summary: (tag, simple_value)
};

// Event: wall_time 1, step 2, file_version 3, summary 5, session_log 7 (TensorBoard's event.proto).
inline Event parseEvent(std::string_view data) {
  Event e;
  for (const Field& f : readFields(data)) {
    if (f.number == 1 && f.wire == 1) {
      std::memcpy(&e.wallTime, &f.value, sizeof e.wallTime);
    } else if (f.number == 2 && f.wire == 0) {
      e.step = static_cast<std::int64_t>(f.value);
    } else if (f.number == 3 && f.wire == 2) {
      e.fileVersion = f.bytes;
    } else if (f.number == 5 && f.wire == 2) {
      for (const Field& v : readFields(f.bytes)) {
        if (v.number != 1 || v.wire != 2) throw std::runtime_error("a Summary field other than value");
        std::string tag;
        std::optional<float> simple;
        for (const Field& x : readFields(v.bytes)) {
          if (x.number == 1 && x.wire == 2) {
            tag = x.bytes;
          } else if (x.number == 2 && x.wire == 5) {
            const auto bits = static_cast<std::uint32_t>(x.value);
            float value;
            std::memcpy(&value, &bits, sizeof value);
            simple = value;
          } else {
            throw std::runtime_error("a Summary.Value field other than tag and simple_value");
          }
        }
        if (!simple) throw std::runtime_error("a Summary.Value without simple_value");
        e.values.emplace_back(tag, *simple);
      }
    } else if (f.number == 7 && f.wire == 2) {
      for (const Field& x : readFields(f.bytes))
        if (x.number == 1 && x.wire == 0) e.sessionStatus = x.value;
    } else {
      throw std::runtime_error("an Event field " + std::to_string(f.number) + " of wire type " + std::to_string(f.wire));
    }
  }
  return e;
}

inline std::vector<Event> readEventFile(const fs::path& file) {
  std::vector<Event> out;
  for (const std::string& record : readRecords(ctorch::test::readFile(file))) out.push_back(parseEvent(record));
  return out;
}

inline std::vector<fs::path> eventFiles(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

inline std::uint32_t floatBits(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

// read_events.py PATH args...: its result, or nullopt when it cannot run here (no /usr/bin/python3,
// python3-protobuf or protoc), with the reason in `skipReason`.
inline std::optional<ctorch::test::ProcessResult> readEventsPy(const fs::path& path, std::vector<std::string> args,
                                                                std::string& skipReason) {
  if (!fs::exists("/usr/bin/python3")) {
    skipReason = "/usr/bin/python3 is not installed";
    return std::nullopt;
  }
  ctorch::test::SpawnOptions py;
  py.argv = {"/usr/bin/python3", CTORCH_READ_EVENTS_PY, path.string()};
  py.argv.insert(py.argv.end(), args.begin(), args.end());
  py.timeout = std::chrono::seconds(120);
  auto r = ctorch::test::run(py);
  if (r.exitCode == 77) {
    skipReason = r.output;
    return std::nullopt;
  }
  return r;
}

}  // namespace tbtest
