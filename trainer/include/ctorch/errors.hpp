// The exception types of the ctorch library: one small tree under ctorch::Error so a trainer's
// main() can tell bad configuration (exit 2, fix your environment) from a failing job.
// Messages are one line and quote the offending value. No LibTorch here.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch {

// Root of every exception the library throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad or missing configuration: an environment variable, an option value, a call made in the wrong
// order. Retrying does not help; the message says what to change.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// No correct way to resume exists (every snapshot in the slot is damaged; a mid-epoch snapshot of
// another world size with no epoch boundary to fall back to). The message names the files and says
// how to proceed; a program adds its own way to start over (a flag).
class ResumeRefused : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Communication failed: the store could not be reached, a peer vanished, a collective failed, the
// Reducer reported an error.
class DistributedError : public Error {
 public:
  using Error::Error;
};

// A wait ran out of time (store connection, peers joining, a collective).
class DistributedTimeout : public DistributedError {
 public:
  using DistributedError::DistributedError;
};

// A file the run depends on could not be written: a snapshot (of any size, or its rotation), a
// checkpoint copy, the final weights -- the disk is full (ENOSPC), over quota (EDQUOT) or failing
// (EIO). The files written before are intact and no temporary file is left. ResilientTraining
// throws it on every rank at the same step (rank 0's message names the file and the errno; the
// others say that rank 0 could not write); its exit code is contract::kExitWriteFailed (74).
class WriteFailed : public Error {
 public:
  using Error::Error;
};

// A stop was asked for (SIGTERM, SIGUSR1, SIGINT: installStopHandlers) at a point where the process
// holds nothing to save -- a spare worker still waiting for a rank. runRecorded() turns it into
// contract::kExitPreempted (75) without an error record.
class Stopped : public Error {
 public:
  using Error::Error;
};

// ---- Snapshots -----------------------------------------------------------------------------------
// Every message names the file and says what is wrong with it.
class SnapshotError : public Error {
 public:
  SnapshotError(std::filesystem::path file, const std::string& message);
  const std::filesystem::path& file() const { return file_; }

 private:
  std::filesystem::path file_;
};

class SnapshotNotFound : public SnapshotError {
 public:
  explicit SnapshotNotFound(std::filesystem::path file);
};

// The file cannot be trusted: damaged, incomplete or not a ctorch snapshot at all.
class SnapshotCorrupt : public SnapshotError {
 public:
  enum class Kind {
    Empty,        // 0 bytes
    Zeroed,       // only zero bytes (e.g. a crash before the data reached the disk)
    Foreign,      // a sound file that is not a ctorch snapshot (random bytes, another torch.save)
    Truncated,    // the archive ends early
    Damaged,      // archive structure inconsistent
    Checksum,     // an archive record fails its CRC-32 (bit flip, partial overwrite)
    BadHeader,    // ctorch header missing fields or with wrong types
    Digest,       // content digest differs from the one recorded at save time
    BadContent,   // an entry has the wrong type or shape of data
  };
  SnapshotCorrupt(std::filesystem::path file, Kind kind, const std::string& detail);
  Kind kind() const { return kind_; }
  static const char* kindName(Kind kind);

 private:
  Kind kind_;
};

// A sound snapshot that does not belong to this run: other model, configuration, world size,
// newer format, or parameters/optimizer/sampler that do not fit. Lists every difference.
class SnapshotIncompatible : public SnapshotError {
 public:
  // `advice`: what the caller can do about it, appended after the differences ("; advice").
  SnapshotIncompatible(std::filesystem::path file, std::vector<std::string> differences, std::string advice = "");
  const std::vector<std::string>& differences() const { return differences_; }
  const std::string& advice() const { return advice_; }

 private:
  std::vector<std::string> differences_;
  std::string advice_;
};

// The message of any exception, without the C++ backtrace LibTorch's c10::Error carries in what().
std::string errorMessage(const std::exception& e);

// Whether `e` is a failed collective: ctorch's DistributedError, or Gloo's, NCCL's or DDP's own
// error as it reaches a loop through autograd (a c10::Error saying a connection closed or reset, a
// peer gone, a wait timed out). What ResilientTraining::recover() repairs in place and what a
// trainer reports with its hang guard's bound; anything else (a shape error, ctorch's
// configuration and snapshot errors, a full disk) is not.
bool isLostPeer(const std::exception& e);

} // namespace ctorch
