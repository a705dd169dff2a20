// The protobuf messages of TensorBoard's event files, encoded by hand (no libprotobuf: see
// ctorch/tensorboard.hpp). Only what a scalar writer needs, with the field numbers of TensorBoard's
// tensorboard/compat/proto/event.proto and summary.proto:
//   Event         wall_time = 1 (double), step = 2 (int64), oneof { file_version = 3 (string),
//                 summary = 5 (Summary), session_log = 7 (SessionLog) }
//   Summary       repeated Value value = 1
//   Summary.Value tag = 1 (string), oneof { simple_value = 2 (float) }
//   SessionLog    status = 1 (enum SessionStatus: START = 1)
// Fields are written in field-number order and proto3's defaults (0, "") are left out, as
// protobuf's own serializer does, so a parsed and re-serialized event has the same bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ctorch::tensorboard {

// What PyTorch and TensorFlow write as the first event of every file.
inline constexpr std::string_view kFileVersion = "brain.Event:2";

// Event{wall_time, step, file_version: "brain.Event:2"}.
std::string fileVersionEvent(double wallTime, std::int64_t step);
// Event{wall_time, step, summary: {value: [{tag, simple_value}]}}.
std::string scalarEvent(double wallTime, std::int64_t step, std::string_view tag, float value);
// Event{wall_time, step, session_log: {status: START}}: TensorBoard drops the run's earlier events
// at steps >= step (Python's purge_step).
std::string sessionStartEvent(double wallTime, std::int64_t step);

}  // namespace ctorch::tensorboard
