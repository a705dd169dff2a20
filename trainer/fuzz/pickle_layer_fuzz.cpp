// libFuzzer target: the pickle layer (issue 58) - the bounded scan (pickle_scan.cpp), LibTorch's
// unpickler, and every check after it - on pickles made of what a snapshot's pickle is made of. The
// input is a program, not the pickle: each byte picks a fragment (a type tag with a type nested up to
// 56,000 deep of List / Dict / Tuple / Optional, a tensor reference with its own persistent id, one
// storage referenced up to a thousand times, memo puts and gets, lists, tuples, dicts, typed-list
// tags, OrderedDict, strings some of which are not UTF-8, globals a snapshot holds and some it does
// not) and the next bytes its arguments, so that nearly every input is a pickle LibTorch can read and
// the fuzzer spends its time inside the layer, not at its first opcode. The value is put into a
// genuine snapshot's USER_STATE['fuzz'] (its digest then fails, after every check before it ran) and
// into an archive of its own. Any outcome but a SnapshotError (or a clean return) is a finding: a
// crash, a stack overflow, a sanitizer report, an allocation beyond -malloc_limit_mb, a hang, another
// exception type escaping. Built by scripts/fuzz.sh, outside the normal build. With
// CTORCH_FUZZ_SEED_DIR set, writes its seed programs there.
#include "ctorch/snapshot.hpp"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

constexpr const char* kMarker = "FUZZ-VALUE-MARKER";

std::string le32(std::uint32_t v) {
  std::string out;
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
  return out;
}
std::string unicode(const std::string& text) { return "X" + le32(static_cast<std::uint32_t>(text.size())) + text; }

// A genuine snapshot's records (its data.pkl with the marker where USER_STATE['fuzz'] goes).
struct Genuine {
  std::vector<std::pair<std::string, std::string>> records;
  std::string pickle;
  std::size_t marker = 0;
};

const Genuine& genuine() {
  static const Genuine g = [] {
    ctorch::Snapshot s;
    s.header.modelName = "fuzz";
    s.modelState.insert("weight", at::arange(6, at::kFloat).reshape({2, 3}));
    s.userState.insert("fuzz", std::string(kMarker));
    const auto bytes = ctorch::encodeSnapshot(s);
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    caffe2::serialize::PyTorchStreamReader reader(&in);
    Genuine out;
    for (const auto& name : reader.getAllRecords()) {
      if (name == "version" || name == ".data/version" || name == "byteorder" || name.rfind(".data/", 0) == 0)
        continue;  // the writer adds its own
      auto [data, size] = reader.getRecord(name);
      std::string record(static_cast<const char*>(data.get()), size);
      if (name == "data.pkl") out.pickle = std::move(record);
      else out.records.emplace_back(name, std::move(record));
    }
    out.marker = out.pickle.find(unicode(kMarker));
    if (out.marker == std::string::npos) std::abort();  // the writer changed: the target must follow
    return out;
  }();
  return g;
}

// The input read as a program; reads past its end give zeros (programs end by running out).
class Program {
 public:
  Program(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t next() { return at_ < size_ ? data_[at_++] : 0; }
  bool done() const { return at_ >= size_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

class Builder {
 public:
  explicit Builder(Program& in) : in_(in) {}

  // One value's opcodes; `depth` bounds the generator's own recursion (a type tag's type is not
  // bounded by it).
  void value(int depth) {
    const std::uint8_t op = in_.next();
    switch (depth >= 6 || in_.done() ? op % 6 : op % 14) {
      case 0: out_ += 'K'; out_ += static_cast<char>(in_.next()); break;
      case 1: text(); break;
      case 2: out_ += 'N'; break;
      case 3: out_ += 'G'; out_.append(8, static_cast<char>(in_.next())); break;
      case 4: out_ += tensorReference(); break;
      case 5:
        if (memo_ > 0) out_ += "h" + std::string(1, static_cast<char>(in_.next() % memo_));
        else out_ += 'N';
        break;
      case 6: sequence(depth, "](", "e"); break;
      case 7: sequence(depth, "(", "t"); break;
      case 8: dict(depth); break;
      case 9: typeTag(depth); break;
      case 10: out_ += "ctorch.jit._pickle\nbuild_intlist\n(](K\x01K\x02" "etR"; break;
      case 11: out_ += "ccollections\nOrderedDict\n)R"; break;
      case 12: manyReferences(); break;
      case 13: global(); break;
    }
    if ((in_.next() & 3) == 0 && memo_ < 255) {  // memoized, for later gets
      out_ += 'q';
      out_ += static_cast<char>(memo_++);
    }
  }
  std::string take() { return std::move(out_); }

 private:
  void text() {
    const std::size_t n = in_.next() % 8;
    std::string s;
    for (std::size_t i = 0; i < n; ++i) s += static_cast<char>('a' + in_.next() % 26);
    if ((in_.next() & 7) == 0) s += '\xe9';  // Latin-1: not UTF-8
    out_ += unicode(s);
  }
  void sequence(int depth, const char* open, const char* close) {
    out_ += open;
    for (int n = in_.next() % 4; n > 0; --n) value(depth + 1);
    out_ += close;
  }
  void dict(int depth) {
    out_ += "}(";
    for (int n = in_.next() % 4; n > 0; --n) {
      text();
      value(depth + 1);
    }
    out_ += 'u';
  }
  // A storage of the archive's f0..f3 records (64 bytes each) as float, double or int64, its own
  // persistent id, with an offset, a size and a stride (0 sometimes: a view reading one element
  // many times).
  std::string tensorReference() {
    static const std::pair<const char*, int> kTypes[] = {{"FloatStorage", 4}, {"DoubleStorage", 8}, {"LongStorage", 8}};
    const auto& [type, element] = kTypes[in_.next() % 3];
    const std::string key = "f" + std::to_string(in_.next() % 4);
    const std::uint32_t numel = in_.next() % (64 / element + 4);  // a little beyond the record sometimes
    const std::uint32_t size = in_.next() % (numel + 2);
    const std::uint32_t stride = in_.next() % 3;
    return "ctorch._utils\n_rebuild_tensor_v2\n((" + unicode("storage") + "ctorch\n" + type + "\n" + unicode(key) +
           unicode("cpu") + "J" + le32(numel) + "tQ" + "K" + std::string(1, static_cast<char>(in_.next() % 4)) + "J" +
           le32(size) + "\x85" + "J" + le32(stride) + "\x85\x89" + "ccollections\nOrderedDict\n)RtR";
  }
  // One record named by up to a thousand references, each its own persistent id.
  void manyReferences() {
    const std::string one = tensorReference();
    out_ += "](";
    for (int n = 1 + in_.next() * 4; n > 0; --n) out_ += one;
    out_ += 'e';
  }
  // restore_type_tag(value, type): a type nested up to 199 deep, or thousands deep (up to 56,000: where
  // LibTorch's type parser overflowed the stack), of every kind; the scan allows 100.
  void typeTag(int depth) {
    out_ += "ctorch.jit._pickle\nrestore_type_tag\n";
    const std::uint8_t what = in_.next() % 3;
    if (what == 0) out_ += ']';
    else if (what == 1) out_ += '}';
    else value(depth + 1);
    static const char* kOpen[] = {"List[", "Dict[str, ", "Tuple[", "Optional[", "Dict[int, "};
    static const char* kLeaf[] = {"int", "str", "Tensor", "float", "Any", "bool", "List[int]", "(x)"};
    const int b = in_.next();
    const int nesting = b < 200 ? b : (b - 199) * 1000;
    std::string type;
    std::string close;
    for (int i = 0; i < nesting; ++i) {
      type += kOpen[in_.next() % 5];
      close += ']';
    }
    type += kLeaf[in_.next() % 8];
    if ((in_.next() & 15) == 0 && !close.empty()) close.pop_back();  // unbalanced
    out_ += unicode(type + close) + "\x86R";
  }
  void global() {
    static const char* kGlobals[] = {"torch._utils\n_rebuild_qtensor\n", "builtins\neval\n", "torch\ndevice\n",
                                     "collections\nOrderedDict\n",      "torch\nFloatStorage\n",
                                     "torch.jit._pickle\nbuild_intlist\n", "torch._utils\n_rebuild_tensor_v2\n"};
    out_ += std::string("c") + kGlobals[in_.next() % 7];
    out_ += (in_.next() & 1) ? ")R" : "(K\x01tR";
  }

  Program& in_;
  std::string out_;
  int memo_ = 0;
};

std::vector<char> archive(const std::vector<std::pair<std::string, std::string>>& records, const std::string& pickle) {
  std::vector<char> out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, std::size_t n) {
    const auto* c = static_cast<const char*>(p);
    out.insert(out.end(), c, c + n);
    return n;
  });
  static const std::string kStorage(64, '\x01');
  for (const auto& [name, data] : records) writer.writeRecord(name, data.data(), data.size());
  for (int i = 0; i < 4; ++i) writer.writeRecord("data/f" + std::to_string(i), kStorage.data(), kStorage.size());
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
  return out;
}

void decode(const std::vector<char>& bytes) {
  try {
    (void)ctorch::decodeSnapshot(bytes, "fuzz/snapshot.pt");
  } catch (const ctorch::SnapshotError&) {
    // The expected outcome for most inputs: named and refused.
  }
}

void writeSeed(const std::string& dir, const std::string& name, const std::string& program) {
  std::ofstream(dir + "/" + name, std::ios::binary).write(program.data(), static_cast<std::streamsize>(program.size()));
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)genuine();
  const char* dir = std::getenv("CTORCH_FUZZ_SEED_DIR");
  if (dir == nullptr) return 0;
  // Programs (see Builder::value): a type tag 30 deep, 199 deep and 30,000 deep (both refused), one
  // storage referenced 41 times, a memoized list referenced again, a dict of a tensor and a string.
  writeSeed(dir, "type-tag", std::string("\x09\x00\x1e", 3) + std::string(30, '\x00') + "\x00\x01");
  writeSeed(dir, "type-tag-deep", std::string("\x09\x00\xc7", 3) + std::string(199, '\x03') + "\x00\x01");
  writeSeed(dir, "type-tag-30000", std::string("\x09\x00\xe5", 3));  // List[ 30,000 times (the input runs out: zeros)
  writeSeed(dir, "references", std::string("\x0c\x00\x00\x10\x10\x01\x00\x0a\x01", 9));
  writeSeed(dir, "memo", std::string("\x06\x02\x00\x05\x00\x00\x01\x00\x04\x00\x00\x10\x10\x01\x00\x01", 16));
  writeSeed(dir, "dict", std::string("\x08\x02\x03\x61\x62\x63\x01\x04\x00\x01\x10\x10\x01\x00\x01\x02\x78\x79\x01\x01\x01", 21));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Program program(data, size);
  Builder builder(program);
  builder.value(0);
  const std::string value = builder.take();
  const Genuine& g = genuine();
  // In a genuine snapshot's USER_STATE (every check up to the digest runs) ...
  std::string pickle = g.pickle;
  pickle.replace(g.marker, std::string(unicode(kMarker)).size(), value);
  decode(archive(g.records, pickle));
  // ... and alone (the pickle of one value).
  decode(archive({}, std::string("\x80\x02", 2) + value + "."));
  return 0;
}
