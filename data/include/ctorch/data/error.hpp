// Errors raised by ctorch::data: one small tree so a trainer can tell bad input (a file, an option)
// from its own bugs. Every message is one line that names the file or the option and the bad value.
#pragma once

#include <stdexcept>
#include <string>

namespace ctorch::data {

// Base of every error this library throws on purpose.
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A file or directory is missing, cannot be opened, or its gzip stream cannot be decoded.
class DataFileError : public DataError {
 public:
  using DataError::DataError;
};

// A file opens but its content is not what the format says: wrong magic number, truncated data,
// trailing bytes, image/label count mismatch, a label out of range.
class DataFormatError : public DataError {
 public:
  using DataError::DataError;
};

// An option or argument is invalid (unknown dataset name, negative size, index out of range, ...).
class DataOptionsError : public DataError {
 public:
  using DataError::DataError;
};

} // namespace ctorch::data
