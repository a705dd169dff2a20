#include "snapshot/pickle_scan.hpp"

#include "snapshot/utf8.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <memory>
#include <string_view>
#include <unordered_map>

namespace ctorch::detail {
namespace {

// A value on the scan's stack. Containers share one Obj between the stack and the memo, as the
// real objects are shared. An object may only be changed (APPEND, SETITEM, BUILD, ...) while no
// second reference to it exists: a memo get, DUP, or a reduce result built from arguments marks it
// shared. So a container never changes after it was put inside another one, the depth and size
// recorded for it stay true, and no cycle can be built (LibTorch would recurse into it forever).
struct Obj;
// The globals a snapshot's pickle may name (docs/snapshot.md, "File format"): what ctorch writes,
// what Python's torch.save of a snapshot writes, and torch::pickle_save's type tags. Anything else
// (a class, builtins, a quantized or sparse tensor's rebuild function) never reaches LibTorch's
// unpickler, which would resolve it.
enum class Global : std::uint8_t { None, RebuildTensor, Storage, OrderedDict, TypeTag, TypedList };
struct Item {
  enum class Tag : std::uint8_t { Other, Str, Int, Global, Container };
  Tag tag = Tag::Other;
  Global global = Global::None;            // Global only
  std::int64_t integer = 0;
  bool intKnown = false;                   // an Int that fits int64_t
  std::string_view text;                   // Str, and a Global's name: points into the pickle
  std::shared_ptr<Obj> obj;                // Container only
};
struct Obj {
  std::size_t depth = 1;
  std::uint64_t values = 1;               // expanded size, saturating
  bool shared = false;
  bool mutableKind = false;               // list, dict, set, object: may be changed in place
  bool tuple = false;
  std::size_t count = 0;                  // a tuple's elements
  std::vector<Item> small;                // a tuple's elements (without their objects) while it has at most 8
  bool smallValid = false;
};

std::uint64_t saturatingAdd(std::uint64_t a, std::uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

std::size_t depthOf(const Item& i) { return i.obj ? i.obj->depth : 0; }
std::uint64_t valuesOf(const Item& i) { return i.obj ? i.obj->values : 1; }

// Element sizes of the storage types torch.save names ("torch", "<Type>Storage"). Not the quantized
// ones (QInt8Storage, ...): a quantized tensor is rebuilt by a function of its own, which Python's
// weights-only torch.load refuses, and a plain tensor over a quantized storage has no quantizer.
std::uint64_t storageElementSize(std::string_view name) {
  static const std::pair<const char*, std::uint64_t> kSizes[] = {
      {"FloatStorage", 4},      {"DoubleStorage", 8},       {"HalfStorage", 2},
      {"BFloat16Storage", 2},   {"LongStorage", 8},         {"IntStorage", 4},
      {"ShortStorage", 2},      {"CharStorage", 1},         {"ByteStorage", 1},
      {"BoolStorage", 1},       {"ComplexHalfStorage", 4},  {"ComplexFloatStorage", 8},
      {"ComplexDoubleStorage", 16}};
  for (const auto& [n, s] : kSizes)
    if (name == n) return s;
  return 0;
}

Global globalKind(std::string_view module, std::string_view name) {
  if (module == "torch._utils" && name == "_rebuild_tensor_v2") return Global::RebuildTensor;
  if (module == "torch" && storageElementSize(name) != 0) return Global::Storage;
  if (module == "collections" && name == "OrderedDict") return Global::OrderedDict;
  if (module == "torch.jit._pickle") {
    if (name == "restore_type_tag") return Global::TypeTag;
    if (name == "build_intlist" || name == "build_doublelist" || name == "build_boollist" ||
        name == "build_tensorlist")
      return Global::TypedList;
  }
  return Global::None;
}

// A name from the file as it may appear in a message: at most 80 bytes, control and non-ASCII
// bytes as '?'.
std::string printable(std::string_view s) {
  std::string out(s.substr(0, 80));
  for (auto& ch : out)
    if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7F) ch = '?';
  return s.size() > 80 ? out + "..." : out;
}

class Scanner {
 public:
  Scanner(const char* data, std::size_t size, const PickleLimits& limits)
      : p_(reinterpret_cast<const unsigned char*>(data)), size_(size), limits_(limits) {
    maxValues_ = limits.maxExpandedValues
                     ? limits.maxExpandedValues
                     : saturatingAdd(std::uint64_t(size) > UINT64_MAX / 64 ? UINT64_MAX : 64 * std::uint64_t(size),
                                     std::uint64_t(1) << 20);
  }

  PickleScan run() {
    while (true) {
      if (pos_ >= size_) malformed("ends without a STOP opcode");
      op_ = pos_;
      const unsigned char code = p_[pos_++];
      if (code == '.') {  // STOP
        if (stack_.size() != 1 || !marks_.empty())
          malformed("STOP with " + std::to_string(stack_.size()) + " values on the stack");
        return std::move(result_);
      }
      step(code);
    }
  }

 private:
  [[noreturn]] void fail(PickleRefused::Kind kind, const std::string& what) const {
    throw PickleRefused(kind, what + " (opcode at byte " + std::to_string(op_) + ")");
  }
  [[noreturn]] void malformed(const std::string& what) const { fail(PickleRefused::Kind::Malformed, what); }

  // ---- Reading arguments ------------------------------------------------------------------------
  std::uint64_t le(int bytes) {
    if (size_ - pos_ < static_cast<std::size_t>(bytes)) malformed("argument runs past the end of the pickle");
    std::uint64_t v = 0;
    for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p_[pos_ + static_cast<std::size_t>(i)];
    pos_ += static_cast<std::size_t>(bytes);
    return v;
  }
  // A length-prefixed payload: the length may not exceed what is left of the pickle, so nothing
  // is ever allocated for bytes that are not there.
  std::string_view payload(std::uint64_t length, const char* what) {
    if (length > size_ - pos_)
      fail(PickleRefused::Kind::Limit,
           std::string(what) + " declares " + std::to_string(length) + " bytes but only " +
               std::to_string(size_ - pos_) + " of the " + std::to_string(size_) +
               "-byte pickle follow");
    std::string_view v(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(length));
    pos_ += static_cast<std::size_t>(length);
    return v;
  }
  std::string_view line() {
    const void* nl = std::memchr(p_ + pos_, '\n', size_ - pos_);
    if (!nl) malformed("text argument without a newline");
    const auto end = static_cast<std::size_t>(static_cast<const unsigned char*>(nl) - p_);
    std::string_view v(reinterpret_cast<const char*>(p_ + pos_), end - pos_);
    pos_ = end + 1;
    return v;
  }

  // ---- The stack --------------------------------------------------------------------------------
  Item pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back()))
      malformed("pops from an empty stack");
    Item i = std::move(stack_.back());
    stack_.pop_back();
    return i;
  }
  Item& top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back()))
      malformed("needs a value on an empty stack");
    return stack_.back();
  }
  std::vector<Item> popToMark() {
    if (marks_.empty()) malformed("needs a MARK and there is none");
    const std::size_t at = marks_.back();
    marks_.pop_back();
    std::vector<Item> items(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(at)),
                            std::make_move_iterator(stack_.end()));
    stack_.resize(at);
    return items;
  }
  void pushLeaf(Item::Tag tag = Item::Tag::Other) {
    Item i;
    i.tag = tag;
    stack_.push_back(std::move(i));
  }
  void checkLimits(const Obj& o) const {
    if (o.depth > limits_.maxDepth)
      fail(PickleRefused::Kind::Limit,
           "nests containers more than " + std::to_string(limits_.maxDepth) + " deep");
    if (o.values > maxValues_)
      fail(PickleRefused::Kind::Limit,
           "expands to more than " + std::to_string(maxValues_) +
               " values through shared references (limit: 64 per pickle byte + 2^20)");
  }
  // A new container holding `items`.
  Item container(std::vector<Item> items, bool mutableKind, bool tuple) {
    auto o = std::make_shared<Obj>();
    o->mutableKind = mutableKind;
    o->tuple = tuple;
    o->count = items.size();
    for (const auto& i : items) add(*o, i);
    if (tuple && items.size() <= 8) {
      // Their tags and texts only: a container inside is not kept alive by its tuple.
      for (auto& i : items) i.obj.reset();
      o->small = std::move(items);
      o->smallValid = true;
    }
    checkLimits(*o);
    Item c;
    c.tag = Item::Tag::Container;
    c.obj = std::move(o);
    return c;
  }
  static void add(Obj& o, const Item& child) {
    o.depth = std::max(o.depth, depthOf(child) + 1);
    o.values = saturatingAdd(o.values, valuesOf(child));
  }
  // The object a mutating opcode changes: the value on top of the stack (above the last mark).
  Obj& mutableTarget(const char* opname) {
    Item& t = top();
    if (!t.obj || !t.obj->mutableKind)
      malformed(std::string(opname) + " on a value that is not a list, dict, set or object");
    if (t.obj->shared)
      fail(PickleRefused::Kind::Unsupported,
           std::string(opname) + " changes a container that is already referenced elsewhere "
                                 "(a self-referencing or cyclic structure, which a snapshot never holds)");
    return *t.obj;
  }
  void addAll(Obj& o, const std::vector<Item>& items) {
    for (const auto& i : items) add(o, i);
    checkLimits(o);
  }
  Item shared(const Item& i) {
    if (i.obj) i.obj->shared = true;
    return i;
  }

  void persistentId() {
    const Item pid = pop();
    const auto* o = pid.obj.get();
    const bool shaped = o && o->smallValid && o->small.size() >= 5 &&
                        o->small[0].tag == Item::Tag::Str && o->small[0].text == "storage" &&
                        o->small[1].tag == Item::Tag::Global && o->small[1].global == Global::Storage &&
                        o->small[2].tag == Item::Tag::Str && o->small[3].tag == Item::Tag::Str &&
                        o->small[4].tag == Item::Tag::Int && o->small[4].intKnown;
    if (!shaped)
      malformed("persistent id is not a ('storage', torch.<Type>Storage, key, location, numel) tuple");
    const std::uint64_t element = storageElementSize(o->small[1].text);
    if (element == 0)
      fail(PickleRefused::Kind::Unsupported,
           "storage type torch." + std::string(o->small[1].text) + " is unknown");
    const std::int64_t numel = o->small[4].integer;
    std::uint64_t bytes = 0;
    if (numel < 0 || __builtin_mul_overflow(static_cast<std::uint64_t>(numel), element, &bytes))
      fail(PickleRefused::Kind::Limit, "storage '" + std::string(o->small[2].text) + "' declares " +
                                           std::to_string(numel) + " elements");
    result_.storages.push_back({std::string(o->small[2].text), std::string(o->small[1].text), bytes, op_});
    pushLeaf();
  }

  void step(unsigned char code) {
    using Tag = Item::Tag;
    switch (code) {
      case 0x80: le(1); return;                                   // PROTO
      case 0x95: le(8); return;                                   // FRAME: its bytes follow inline
      case '(': marks_.push_back(stack_.size()); return;          // MARK
      case '0': pop(); return;                                    // POP
      case '1': popToMark(); return;                              // POP_MARK
      case '2': stack_.push_back(shared(top())); return;          // DUP
      case 'N': case 0x88: case 0x89: pushLeaf(); return;         // NONE NEWTRUE NEWFALSE
      case 'J': pushInt(static_cast<std::int32_t>(le(4))); return;  // BININT
      case 'K': pushInt(static_cast<std::int64_t>(le(1))); return;  // BININT1
      case 'M': pushInt(static_cast<std::int64_t>(le(2))); return;  // BININT2
      case 0x8a: pushLong(payload(le(1), "LONG1")); return;
      case 0x8b: pushLong(payload(le(4), "LONG4")); return;
      case 'I': case 'L': {                                       // INT LONG (text)
        const auto text = line();
        pushLeaf(Tag::Int);
        try {
          std::string s(text.substr(0, text.size() && text.back() == 'L' ? text.size() - 1 : text.size()));
          std::size_t used = 0;
          stack_.back().integer = std::stoll(s, &used);
          stack_.back().intKnown = used == s.size();
        } catch (const std::exception&) {
        }
        return;
      }
      case 'G': le(8); pushLeaf(); return;                        // BINFLOAT
      case 'F': line(); pushLeaf(); return;                       // FLOAT
      case 'X': pushText(payload(le(4), "BINUNICODE")); return;
      case 0x8c: pushText(payload(le(1), "SHORT_BINUNICODE")); return;
      case 0x8d: pushText(payload(le(8), "BINUNICODE8")); return;
      case 'T': pushText(payload(le(4), "BINSTRING")); return;
      case 'U': pushText(payload(le(1), "SHORT_BINSTRING")); return;
      case 'B': pushStr(payload(le(4), "BINBYTES")); return;
      case 'C': pushStr(payload(le(1), "SHORT_BINBYTES")); return;
      case 0x8e: pushStr(payload(le(8), "BINBYTES8")); return;
      case 'S': case 'V': pushStr(line()); return;                // STRING UNICODE (text)
      case ')': stack_.push_back(container({}, false, true)); return;   // EMPTY_TUPLE
      case 't': stack_.push_back(container(popToMark(), false, true)); return;  // TUPLE
      case 0x85: case 0x86: case 0x87: {                          // TUPLE1..3
        std::vector<Item> items(static_cast<std::size_t>(code - 0x84));
        for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
        stack_.push_back(container(std::move(items), false, true));
        return;
      }
      case ']': case '}': case 0x8f:                              // EMPTY_LIST EMPTY_DICT EMPTY_SET
        stack_.push_back(container({}, true, false));
        return;
      case 'l': case 'd': {                                       // LIST DICT
        auto items = popToMark();
        if (code == 'd') evenItems(items, "DICT");
        stack_.push_back(container(std::move(items), true, false));
        return;
      }
      case 0x91: stack_.push_back(container(popToMark(), false, false)); return;  // FROZENSET
      case 'a': {                                                 // APPEND
        Item v = pop();
        addAll(mutableTarget("APPEND"), {v});
        return;
      }
      case 's': {                                                 // SETITEM
        Item v = pop();
        Item k = pop();
        addAll(mutableTarget("SETITEM"), {k, v});
        return;
      }
      case 'e': case 'u': case 0x90: {                            // APPENDS SETITEMS ADDITEMS
        auto items = popToMark();
        if (code == 'u') evenItems(items, "SETITEMS");
        addAll(mutableTarget(code == 'e' ? "APPENDS" : code == 'u' ? "SETITEMS" : "ADDITEMS"), items);
        return;
      }
      case 'b': {                                                 // BUILD
        Item state = pop();
        addAll(mutableTarget("BUILD"), {state});
        return;
      }
      case 'c': {                                                 // GLOBAL "module\nname\n"
        const auto module = line();
        const auto name = line();
        pushGlobal(module, name);
        return;
      }
      case 0x93: {                                                // STACK_GLOBAL
        const Item name = pop();
        const Item module = pop();
        if (module.tag != Tag::Str || name.tag != Tag::Str) malformed("STACK_GLOBAL without a module and a name string");
        pushGlobal(module.text, name.text);
        return;
      }
      case 'R': {                                                 // REDUCE
        Item args = pop();
        Item callable = pop();
        checkCall(callable, args);
        reduceResult({callable, args}, args);
        return;
      }
      case 0x81: case 0x92:                                       // NEWOBJ NEWOBJ_EX: classes only
        fail(PickleRefused::Kind::Unsupported,
             std::string(code == 0x81 ? "NEWOBJ" : "NEWOBJ_EX") + " makes an instance of a class, which a snapshot never holds");
      case 'Q': persistentId(); return;                           // BINPERSID
      case 'q': memoPut(le(1)); return;                           // BINPUT
      case 'r': memoPut(le(4)); return;                           // LONG_BINPUT
      case 0x94: memoPut(memo_.size()); return;                   // MEMOIZE
      case 'p': memoPut(textIndex()); return;                     // PUT
      case 'h': memoGet(le(1)); return;                           // BINGET
      case 'j': memoGet(le(4)); return;                           // LONG_BINGET
      case 'g': memoGet(textIndex()); return;                     // GET
      default: {
        static const char* kHex = "0123456789abcdef";
        fail(PickleRefused::Kind::Unsupported,
             std::string("Unknown opcode for unpickling: 0x") + kHex[code >> 4] + kHex[code & 15]);
      }
    }
  }

  // LibTorch 1.13 pairs keys and values by index: an odd count makes it read past its stack.
  void evenItems(const std::vector<Item>& items, const char* opname) const {
    if (items.size() % 2 != 0)
      malformed(std::string(opname) + " with an odd number (" + std::to_string(items.size()) +
                ") of keys and values");
  }
  void pushInt(std::int64_t v) {
    pushLeaf(Item::Tag::Int);
    stack_.back().integer = v;
    stack_.back().intKnown = true;
  }
  void pushLong(std::string_view bytes) {
    pushLeaf(Item::Tag::Int);
    if (bytes.size() <= 8) {
      std::uint64_t v = 0;
      for (std::size_t i = bytes.size(); i-- > 0;) v = (v << 8) | static_cast<unsigned char>(bytes[i]);
      if (!bytes.empty() && bytes.size() < 8 && (static_cast<unsigned char>(bytes.back()) & 0x80))
        v |= ~std::uint64_t(0) << (8 * bytes.size());  // sign-extend two's complement
      stack_.back().integer = static_cast<std::int64_t>(v);
      stack_.back().intKnown = true;
    }
  }
  void pushStr(std::string_view text) {
    pushLeaf(Item::Tag::Str);
    stack_.back().text = text;
  }
  // A text string: Python's unpickler decodes it as UTF-8 and refuses the file when it is not, so a
  // string LibTorch would take byte for byte is refused here.
  void pushText(std::string_view text) {
    if (!isUtf8(text))
      malformed("a string is not UTF-8 ('" + printable(text) + "'): Python's torch.load cannot read it");
    pushStr(text);
  }
  void pushGlobal(std::string_view module, std::string_view name) {
    const Global g = globalKind(module, name);
    if (g == Global::None)
      fail(PickleRefused::Kind::Unsupported,
           "global " + printable(module) + "." + printable(name) +
               " is not one a snapshot holds (torch._utils._rebuild_tensor_v2, torch.<Type>Storage, "
               "collections.OrderedDict, torch.jit._pickle's type tags)");
    pushLeaf(Item::Tag::Global);
    stack_.back().global = g;
    stack_.back().text = name;
  }
  // What each global may be given (LibTorch trusts it): a tensor's rebuild its 6 or 7 arguments,
  // OrderedDict none, a typed list's tag one list, a type tag a value and a type whose nesting the
  // container limit bounds (LibTorch's type parser recurses once per bracket). A storage type is
  // named in persistent ids only, never called.
  void checkCall(const Item& callable, const Item& args) const {
    if (callable.tag != Item::Tag::Global)
      malformed("REDUCE calls something that is not a global");
    const Obj* a = args.obj.get();
    if (!a || !a->tuple) malformed("REDUCE's arguments are not a tuple");
    const std::string what = "torch." + printable(callable.text);
    switch (callable.global) {
      case Global::RebuildTensor:
        if (a->count != 6 && a->count != 7)
          malformed("_rebuild_tensor_v2 is given " + std::to_string(a->count) + " arguments (6 or 7)");
        return;
      case Global::OrderedDict:
        if (a->count != 0) malformed("OrderedDict is given " + std::to_string(a->count) + " arguments (none)");
        return;
      case Global::TypedList:
        if (a->count != 1) malformed(printable(callable.text) + " is given " + std::to_string(a->count) + " arguments (one list)");
        return;
      case Global::TypeTag: {
        if (a->count != 2 || !a->smallValid || a->small[1].tag != Item::Tag::Str)
          malformed("restore_type_tag is not given a value and a type string");
        checkTypeString(a->small[1].text);
        return;
      }
      case Global::Storage:
        malformed(what + " is called; a storage type is only named in a persistent id");
      case Global::None:
        break;
    }
    malformed("REDUCE calls an unknown global");
  }
  void checkTypeString(std::string_view type) const {
    std::size_t depth = 0;
    for (const char c : type) {
      if (c == '[') {
        if (++depth > limits_.maxDepth)
          fail(PickleRefused::Kind::Limit, "a type tag nests types more than " + std::to_string(limits_.maxDepth) +
                                               " deep ('" + printable(type) + "')");
      } else if (c == ']') {
        if (depth-- == 0) malformed("a type tag's brackets do not match ('" + printable(type) + "')");
      } else if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != ',' && c != ' ') {
        malformed("a type tag is not a type ('" + printable(type) + "')");
      }
    }
    if (depth != 0) malformed("a type tag's brackets do not match ('" + printable(type) + "')");
  }
  std::uint64_t textIndex() {
    const auto text = line();
    std::uint64_t v = 0;
    for (char c : text) {
      if (c < '0' || c > '9' || v > UINT64_MAX / 10 - 1) malformed("bad memo index");
      v = v * 10 + static_cast<std::uint64_t>(c - '0');
    }
    return v;
  }
  // LibTorch sizes its memo table by the largest index: 4-byte indices would let a few bytes ask
  // for 64 GB. Writers number memo entries from 0, so an index never exceeds the pickle's size.
  void memoPut(std::uint64_t index) {
    if (index > size_)
      fail(PickleRefused::Kind::Limit, "memo index " + std::to_string(index) + " is larger than the " +
                                           std::to_string(size_) + "-byte pickle");
    memo_[index] = top();
  }
  void memoGet(std::uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) malformed("memo entry " + std::to_string(index) + " was never stored");
    stack_.push_back(shared(it->second));
  }
  // What a reduce returns may be one of its arguments (restore_type_tag returns its dict): from
  // non-empty arguments it counts as shared; from none (OrderedDict()) it is a fresh object.
  void reduceResult(std::vector<Item> parts, const Item& args) {
    const bool fresh = args.obj && args.obj->values == 1;
    Item r = container(std::move(parts), true, false);
    r.obj->shared = !fresh;
    stack_.push_back(std::move(r));
  }

  const unsigned char* p_;
  std::size_t size_;
  PickleLimits limits_;
  std::uint64_t maxValues_ = 0;
  std::size_t pos_ = 0, op_ = 0;
  std::vector<Item> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, Item> memo_;
  PickleScan result_;
};

} // namespace

PickleScan scanPickle(const char* data, std::size_t size, const PickleLimits& limits) {
  return Scanner(data, size, limits).run();
}

} // namespace ctorch::detail
