// A bounded pre-pass over a pickle (data.pkl of a torch.save archive), run before LibTorch's
// unpickler sees it: the unpickler trusts lengths, nesting, globals, type tags and persistent ids, so
// a crafted file can make it allocate gigabytes, build a structure too deep to destroy or hash (or a
// type too deep to parse) without overflowing the stack, resolve a global no snapshot holds, or give
// a storage more bytes than its record holds; and it takes strings byte for byte where Python's
// unpickler needs UTF-8. This scan walks the opcodes with a stack of its own (no recursion) and
// refuses all of that. Private to the library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ctorch::detail {

struct PickleLimits {
  // Containers (list, dict, tuple, set, reduce arguments) nested deeper than this are refused. A
  // snapshot nests about 6 deep; 100 keeps every recursive walk far from the stack's end.
  std::size_t maxDepth = 100;
  // Values reachable when shared references (memo gets) are expanded, as every recursive walk
  // over the result does; 0: 64 per byte of pickle plus 2^20.
  std::uint64_t maxExpandedValues = 0;
};

// A storage the pickle refers to through a persistent id ('storage', type, key, location, numel).
struct PickleStorage {
  std::string key;            // the record is <archive>/data/<key>
  std::string type;           // torch.<type>: FloatStorage, LongStorage, ...
  std::uint64_t bytes = 0;    // numel * element size, as declared
  std::size_t offset = 0;     // of the BINPERSID opcode, for messages
};

struct PickleScan {
  std::vector<PickleStorage> storages;
};

class PickleRefused : public std::runtime_error {
 public:
  enum class Kind { Unsupported, Malformed, Limit };
  PickleRefused(Kind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Throws PickleRefused naming the byte offset of the first problem.
PickleScan scanPickle(const char* data, std::size_t size, const PickleLimits& limits = {});

} // namespace ctorch::detail
