#include "tensorboard/event_encoding.hpp"

#include <cstring>

namespace ctorch::tensorboard {

namespace {

enum WireType : std::uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// Field numbers (see the header).
constexpr std::uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5,
                        kEventSessionLog = 7;
constexpr std::uint32_t kSummaryValue = 1;
constexpr std::uint32_t kValueTag = 1, kValueSimpleValue = 2;
constexpr std::uint32_t kSessionLogStatus = 1;
constexpr std::uint64_t kSessionStart = 1;

void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void key(std::string& out, std::uint32_t field, WireType type) { varint(out, (std::uint64_t{field} << 3) | type); }

void fixed(std::string& out, std::uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xffu));
}

void bytesField(std::string& out, std::uint32_t field, std::string_view bytes) {
  key(out, field, kLengthDelimited);
  varint(out, bytes.size());
  out.append(bytes);
}

// wall_time and step: proto3 scalars without presence, left out when 0.
std::string eventHead(double wallTime, std::int64_t step) {
  std::string out;
  if (wallTime != 0.0) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &wallTime, sizeof bits);
    key(out, kEventWallTime, kFixed64);
    fixed(out, bits, 8);
  }
  if (step != 0) {
    key(out, kEventStep, kVarint);
    varint(out, static_cast<std::uint64_t>(step));  // a negative int64 takes 10 bytes, as in protobuf
  }
  return out;
}

}  // namespace

std::string fileVersionEvent(double wallTime, std::int64_t step) {
  std::string out = eventHead(wallTime, step);
  bytesField(out, kEventFileVersion, kFileVersion);  // a oneof member: written even if empty
  return out;
}

std::string scalarEvent(double wallTime, std::int64_t step, std::string_view tag, float value) {
  std::string v;
  if (!tag.empty()) bytesField(v, kValueTag, tag);
  std::uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  key(v, kValueSimpleValue, kFixed32);  // a oneof member: written even when 0
  fixed(v, bits, 4);
  std::string summary;
  bytesField(summary, kSummaryValue, v);
  std::string out = eventHead(wallTime, step);
  bytesField(out, kEventSummary, summary);
  return out;
}

std::string sessionStartEvent(double wallTime, std::int64_t step) {
  std::string log;
  key(log, kSessionLogStatus, kVarint);
  varint(log, kSessionStart);
  std::string out = eventHead(wallTime, step);
  bytesField(out, kEventSessionLog, log);
  return out;
}

}  // namespace ctorch::tensorboard
