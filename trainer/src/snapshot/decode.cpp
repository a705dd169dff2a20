// Reading a snapshot file and checking it (the format's other half is format.cpp): the archive, its
// pickle, the header, every field and value, before anything of it is used.
#include "ctorch/snapshot.hpp"
#include "snapshot/portable_archive.hpp"
#include "snapshot/generic_dict.hpp"
#include "snapshot/digest.hpp"
#include "snapshot/pickle_scan.hpp"
#include "snapshot/zip_check.hpp"
#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/storage_context.h>
#include <algorithm>
#include <exception>
#include <cstring>
#include <cmath>
#include <ctime>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include "snapshot/format_fields.hpp"

namespace ctorch {
namespace {

using Kind = SnapshotCorrupt::Kind;
using namespace detail::format_fields;
using detail::badTensorView;
using detail::describeType;
using detail::tensorsBeyondFile;

// ---- Reading typed fields, each failure naming the entry ------------------------------------------
class FieldReader {
 public:
  FieldReader(const std::filesystem::path& file, Kind kind) : file_(file), kind_(kind) {}

  [[noreturn]] void fail(const std::string& detail) const {
    throw SnapshotCorrupt(file_, kind_, detail);
  }
  const c10::IValue& get(const c10::impl::GenericDict& d, const std::string& key,
                         const std::string& where) const {
    auto it = d.find(key);
    if (it == d.end()) fail(where + " has no '" + key + "' entry");
    return it->value();
  }
  std::int64_t integer(const c10::impl::GenericDict& d, const std::string& key,
                       const std::string& where) const {
    const auto& v = get(d, key, where);
    if (!v.isInt()) fail(where + "['" + key + "'] is " + describeType(v) + ", expected an int");
    return v.toInt();
  }
  bool boolean(const c10::impl::GenericDict& d, const std::string& key,
               const std::string& where) const {
    const auto& v = get(d, key, where);
    if (!v.isBool()) fail(where + "['" + key + "'] is " + describeType(v) + ", expected a bool");
    return v.toBool();
  }
  std::string text(const c10::impl::GenericDict& d, const std::string& key,
                   const std::string& where) const {
    const auto& v = get(d, key, where);
    if (!v.isString()) fail(where + "['" + key + "'] is " + describeType(v) + ", expected a str");
    return v.toStringRef();
  }
  c10::impl::GenericDict dict(const c10::IValue& v, const std::string& where) const {
    if (!v.isGenericDict()) fail(where + " is " + describeType(v) + ", expected a dict");
    return v.toGenericDict();
  }
  ItemDict stringKeyed(const c10::IValue& v,
                                                  const std::string& where) const {
    auto out = newItemDict();
    for (const auto& e : dict(v, where)) {
      if (!e.key().isString()) fail(where + " has a key of type " + e.key().tagKind());
      out.insert(e.key().toStringRef(), e.value());
    }
    return out;
  }

 private:
  const std::filesystem::path& file_;
  Kind kind_;
};

std::string leadingBytes(const std::vector<char>& bytes) {
  std::size_t zeros = 0;
  while (zeros < bytes.size() && bytes[zeros] == 0) ++zeros;
  if (zeros >= 16) return "starts with " + std::to_string(zeros) + " zero bytes";
  std::ostringstream os;
  os << "starts with bytes";
  for (std::size_t i = 0; i < std::min<std::size_t>(bytes.size(), 8); ++i) {
    static const char* kHex = "0123456789abcdef";
    const auto b = static_cast<unsigned char>(bytes[i]);
    os << ' ' << kHex[b >> 4] << kHex[b & 15];
  }
  return os.str();
}

std::string errorText(const std::exception& e) { return errorMessage(e); }

// LibTorch's pickle_load, but building each storage once however many references name its record,
// as Python's torch.load does: otherwise every reference (a few bytes of pickle each) reads the
// record again, and a 400 kB file holds gigabytes once read.
c10::IValue readPickleSharingStorages(const std::vector<char>& bytes) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
  return torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"", /*type_resolver=*/{},
                                           /*obj_loader=*/{}, /*device=*/{}, reader,
                                           torch::jit::Unpickler::defaultTypeParser,
                                           std::make_shared<torch::jit::DeserializationStorageContext>());
}

// Checks data.pkl with the bounded scan (see pickle_scan.hpp) and every storage it declares
// against the record that has to hold it, before LibTorch's unpickler runs.
void checkPickle(const std::vector<char>& bytes, const detail::ZipCheckResult& zip,
                 const std::filesystem::path& file) {
  // LibTorch's reader takes the archive's name from the first record's directory.
  const std::string& first = zip.records.front().name;
  const std::string archive = first.substr(0, first.find('/'));
  auto record = [&](const std::string& name) -> const detail::ZipRecord* {
    for (const auto& r : zip.records)
      if (r.name == name) return &r;
    return nullptr;
  };
  const auto* pkl = record(archive + "/data.pkl");
  if (!pkl)
    throw SnapshotCorrupt(file, Kind::Foreign, "a zip archive without the record " + archive +
                                                   "/data.pkl, not a torch.save file");
  detail::PickleScan scan;
  try {
    scan = detail::scanPickle(bytes.data() + pkl->dataOffset, pkl->compressedSize);
  } catch (const detail::PickleRefused& e) {
    std::string why = e.what();
    if (e.kind() == detail::PickleRefused::Kind::Unsupported) {
      if (why.find("Unknown opcode") != std::string::npos)
        throw SnapshotCorrupt(file, Kind::Foreign, "a torch.save archive LibTorch cannot unpickle: " + why +
                                                       " (not an opcode LibTorch's unpickler reads)");
      throw SnapshotCorrupt(file, Kind::Foreign, "a torch.save archive of what no snapshot holds: " + why);
    }
    throw SnapshotCorrupt(file, Kind::BadContent, archive + "/data.pkl is refused: " + why);
  }
  // One storage referenced twice must be referenced alike: Python's torch.load builds the storage
  // once, from its first reference, and gives every later reference that one (its dtype, its size);
  // LibTorch's pickle_load builds one per reference, each with its own dtype and size. So a storage
  // read as two dtypes (or two sizes) is two different contents to the two readers, and a digest
  // can only hold for one of them. torch.save never writes it (it refuses to save views of one
  // storage as different types).
  std::map<std::string, const detail::PickleStorage*> firstReference;
  for (const auto& s : scan.storages) {
    const auto [it, fresh] = firstReference.emplace(s.key, &s);
    if (fresh) continue;
    const auto& first = *it->second;
    if (first.type != s.type || first.bytes != s.bytes)
      throw SnapshotCorrupt(file, Kind::BadContent,
                            "storage '" + s.key + "' is referenced as torch." + first.type + " of " +
                                std::to_string(first.bytes) + " bytes (pickle byte " + std::to_string(first.offset) +
                                ") and as torch." + s.type + " of " + std::to_string(s.bytes) + " bytes (pickle byte " +
                                std::to_string(s.offset) +
                                "): Python's torch.load reads every reference as the first, LibTorch each as "
                                "its own, so the two would read different content (torch.save never writes this)");
  }
  for (const auto& s : scan.storages) {
    const auto* r = record(archive + "/data/" + s.key);
    const std::uint64_t have = r ? r->compressedSize : 0;
    if (s.bytes > 0 && (!r || have < s.bytes))
      throw SnapshotCorrupt(file, Kind::BadContent,
                            "storage '" + s.key + "' declares " + std::to_string(s.bytes) +
                                " bytes but its record " + archive + "/data/" + s.key +
                                (r ? " holds " + std::to_string(have) : std::string(" is missing")));
  }
}

} // namespace

// ---- Decoding ---------------------------------------------------------------------------------------
namespace {

// 1. The archive: not empty or zeroed, then its structure and the CRC-32 of every record, before
//    anything is parsed.
detail::ZipCheckResult checkArchive(const std::vector<char>& bytes, const std::filesystem::path& file) {
  if (bytes.empty()) throw SnapshotCorrupt(file, Kind::Empty, "the file has 0 bytes");
  if (std::all_of(bytes.begin(), bytes.end(), [](char c) { return c == 0; }))
    throw SnapshotCorrupt(file, Kind::Zeroed, "all " + std::to_string(bytes.size()) +
                                    " bytes are zero (typically a crash before the data reached "
                                    "the disk)");

  const auto zip = detail::checkZipArchive(bytes.data(), bytes.size());
  if (!zip.problems.empty()) {
    const auto& p = zip.problems.front();
    switch (p.kind) {
      case detail::ZipProblem::Kind::NotZip: {
        std::string what = "not a torch.save archive: " + p.detail + " (" + leadingBytes(bytes) + ")";
        if (bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x80)
          what = "a legacy (pre-zip) torch.save / pickle file, not a ctorch snapshot";
        throw SnapshotCorrupt(file, Kind::Foreign, what);
      }
      case detail::ZipProblem::Kind::Truncated: throw SnapshotCorrupt(file, Kind::Truncated, p.detail);
      case detail::ZipProblem::Kind::Damaged: throw SnapshotCorrupt(file, Kind::Damaged, p.detail);
      case detail::ZipProblem::Kind::Checksum: throw SnapshotCorrupt(file, Kind::Checksum, p.detail);
    }
  }
  const bool hasPickle = std::any_of(zip.records.begin(), zip.records.end(), [](const auto& r) {
    return r.name.size() >= 9 && r.name.compare(r.name.size() - 9, 9, "/data.pkl") == 0;
  });
  if (!hasPickle) throw SnapshotCorrupt(file, Kind::Foreign, "a zip archive without a data.pkl record, not a torch.save file");
  return zip;
}

// 2. The pickle. The records are intact, so a failure here means a file written by something
//    else (e.g. torch.save of Python objects LibTorch cannot rebuild) or crafted: a bounded scan
//    first, then LibTorch's unpickler, then every tensor's view against its storage.
c10::IValue unpickle(const std::vector<char>& bytes, const detail::ZipCheckResult& zip, const std::filesystem::path& file) {
  checkPickle(bytes, zip, file);
  c10::IValue top;
  try {
    top = readPickleSharingStorages(bytes);
  } catch (const std::exception& e) {
    std::string why = errorText(e);
    if (why.find("Unknown opcode") != std::string::npos)
      why += " (Python's pickle uses opcodes older LibTorch releases cannot read, e.g. APPEND for "
             "a one-element list when Python re-saved the file; LibTorch 1.13 has this gap)";
    throw SnapshotCorrupt(file, Kind::Foreign, "a torch.save archive LibTorch cannot unpickle: " + why);
  }
  std::uint64_t tensorBytes = 0;
  if (auto bad = badTensorView(top, "the pickle", tensorBytes))
    throw SnapshotCorrupt(file, Kind::BadContent, *bad);
  if (auto beyond = tensorsBeyondFile(tensorBytes, bytes.size()))
    throw SnapshotCorrupt(file, Kind::BadContent, *beyond);
  if (!top.isGenericDict()) throw SnapshotCorrupt(file, Kind::Foreign, "a torch.save file holding " + describeType(top));
  return top;
}

// 3. The header (its magic and format version first), and 4. the content digest over everything
//    but itself, before any field is trusted.
SnapshotHeader readHeader(const c10::IValue& top, const std::filesystem::path& file) {
  auto topDict = top.toGenericDict();
  auto headerIt = topDict.find(kHeaderKey);
  if (headerIt == topDict.end())
    throw SnapshotCorrupt(file, Kind::Foreign, "a torch.save file holding " + describeType(top) + ", without a '" +
                                     kHeaderKey + "' header");
  const FieldReader hr(file, Kind::BadHeader);
  auto header = hr.dict(headerIt->value(), kHeaderKey);
  const auto magicIt = header.find("magic");
  if (magicIt == header.end() || !magicIt->value().isString() ||
      magicIt->value().toStringRef() != kSnapshotMagic)
    throw SnapshotCorrupt(file, Kind::Foreign, std::string("the '") + kHeaderKey + "' header lacks the magic '" +
                                     kSnapshotMagic + "'");
  SnapshotHeader h;
  h.magic = kSnapshotMagic;
  h.formatVersion = hr.integer(header, "format_version", kHeaderKey);
  if (h.formatVersion > kSnapshotFormatVersion)
    throw SnapshotIncompatible(file, {"format version " + std::to_string(h.formatVersion) +
                                      " is newer than this ctorch reads (up to " +
                                      std::to_string(kSnapshotFormatVersion) +
                                      "); it was written by " +
                                      (header.contains("ctorch_version") && header.at("ctorch_version").isString()
                                           ? header.at("ctorch_version").toStringRef()
                                           : std::string("a newer ctorch"))});
  if (h.formatVersion < 1)
    throw SnapshotCorrupt(file, Kind::BadHeader, "format version " + std::to_string(h.formatVersion));
  h.contentDigest = hr.text(header, kDigestKey, kHeaderKey);

  // 4. The digest, over everything but itself (as written: see encodeSnapshot).
  (void)header.erase(kDigestKey);
  std::string actual;
  try {
    actual = contentDigest(top, "snapshot");
  } catch (const std::invalid_argument& e) {
    throw SnapshotCorrupt(file, Kind::BadContent, e.what());
  } catch (const std::exception& e) {  // c10::Error, std::bad_alloc: what the content declares cannot be read
    throw SnapshotCorrupt(file, Kind::BadContent, "the content cannot be read for its digest: " + errorText(e));
  }
  if (actual != h.contentDigest)
    throw SnapshotCorrupt(file, Kind::Digest, "recorded " + h.contentDigest + ", computed " + actual +
                                    " (the content changed after it was written)");

  h.worldSize = hr.integer(header, "world_size", kHeaderKey);
  if (h.worldSize < 1 || h.worldSize > kMaxWorldSize)
    hr.fail(std::string(kHeaderKey) + "['world_size'] is " + std::to_string(h.worldSize) + " (a world size: 1 to 2^24)");
  h.modelName = hr.text(header, "model_name", kHeaderKey);
  for (const auto& e : hr.dict(hr.get(header, "config", kHeaderKey), "config")) {
    if (!e.key().isString() || !e.value().isString())
      hr.fail("config entries must be str -> str");
    h.config[e.key().toStringRef()] = e.value().toStringRef();
  }
  h.configHash = hr.text(header, "config_hash", kHeaderKey);
  h.createdAt = std::chrono::system_clock::time_point(
      std::chrono::seconds(hr.integer(header, "created_unix", kHeaderKey)));
  h.ctorchVersion = hr.text(header, "ctorch_version", kHeaderKey);
  h.torchVersion = hr.text(header, "torch_version", kHeaderKey);
  if (header.contains("save_id")) {
    h.saveId = hr.text(header, "save_id", kHeaderKey);
    if (h.saveId.size() > 64) hr.fail(std::string(kHeaderKey) + "['save_id'] is longer than 64 characters");
  }

  return h;
}

// The size of the CPU generator's state (torch.get_rng_state()): 5056 bytes in LibTorch 1.13 and 2.x.
std::int64_t cpuGeneratorStateBytes() {
  static const std::int64_t bytes = [] {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state().numel();
  }();
  return bytes;
}

constexpr std::size_t kMaxCudaStates = 1024;               // devices per process
constexpr std::int64_t kMaxCudaStateBytes = 64 * 1024;     // torch.cuda.get_rng_state(): 816 bytes

// A generator state is what torch.get_rng_state() returns: a 1-D uint8 tensor of the generator's
// size. Anything else (10 bytes, floats) would be refused by set_state only when the trainer
// restores it, after the file was chosen; here it is refused while the next file can still be tried.
at::Tensor rngTensor(const FieldReader& cr, const at::Tensor& t, const std::string& where,
                     std::optional<std::int64_t> exactBytes) {
  if (t.scalar_type() != at::kByte || t.dim() != 1)
    cr.fail(where + " is a " + std::string(c10::toString(t.scalar_type())) + " tensor of sizes " + c10::str(t.sizes()) +
            ", expected a 1-D uint8 tensor (torch.get_rng_state()'s layout)");
  if (exactBytes ? t.numel() != *exactBytes : (t.numel() < 1 || t.numel() > kMaxCudaStateBytes))
    cr.fail(where + " holds " + std::to_string(t.numel()) + " bytes; a generator state has " +
            (exactBytes ? std::to_string(*exactBytes) : "1 to " + std::to_string(kMaxCudaStateBytes)));
  return t;
}

// 5. The content, each field checked for its type.
void readContent(const c10::impl::GenericDict& topDict, const std::filesystem::path& file, Snapshot& s) {
  const FieldReader cr(file, Kind::BadContent);
  for (const auto& e : cr.dict(cr.get(topDict, kModelKey, "snapshot"), kModelKey)) {
    if (!e.key().isString() || !e.value().isTensor())
      cr.fail(std::string(kModelKey) + " must map str -> Tensor, found " + e.key().tagKind() +
              " -> " + e.value().tagKind());
    s.modelState.insert(e.key().toStringRef(), e.value().toTensor());
  }
  s.optimizerType = cr.text(topDict, kOptimizerTypeKey, "snapshot");
  const auto& opt = cr.get(topDict, kOptimizerKey, "snapshot");
  if (!s.optimizerType.empty()) s.optimizerState = cr.stringKeyed(opt, kOptimizerKey);
  s.schedulerState = cr.stringKeyed(cr.get(topDict, kSchedulerKey, "snapshot"), kSchedulerKey);
  s.epochsRun = cr.integer(topDict, kEpochsRunKey, "snapshot");
  s.stepInEpoch = cr.integer(topDict, kStepInEpochKey, "snapshot");
  s.globalStep = cr.integer(topDict, kGlobalStepKey, "snapshot");
  const auto& samplerValue = cr.get(topDict, kSamplerKey, "snapshot");
  if (!samplerValue.isNone()) {
    const auto d = cr.dict(samplerValue, kSamplerKey);
    SamplerState st;
    st.epoch = cr.integer(d, "epoch", kSamplerKey);
    st.consumed = cr.integer(d, "consumed", kSamplerKey);
    st.worldSize = cr.integer(d, "world_size", kSamplerKey);
    st.datasetSize = cr.integer(d, "dataset_size", kSamplerKey);
    st.seed = cr.integer(d, "seed", kSamplerKey);
    st.shuffle = cr.boolean(d, "shuffle", kSamplerKey);
    st.dropLast = cr.boolean(d, "drop_last", kSamplerKey);
    s.sampler = st;
  }
  auto readRng = [&](const c10::IValue& v, const std::string& where) {
    const auto d = cr.dict(v, where);
    RngState r;
    const auto& cpu = cr.get(d, "cpu", where);
    if (cpu.isTensor()) r.cpu = rngTensor(cr, cpu.toTensor(), where + "['cpu']", cpuGeneratorStateBytes());
    else if (!cpu.isNone()) cr.fail(where + "['cpu'] is " + describeType(cpu));
    const auto& cuda = cr.get(d, "cuda", where);
    if (!cuda.isList()) cr.fail(where + "['cuda'] is " + describeType(cuda));
    if (cuda.toListRef().size() > kMaxCudaStates)
      cr.fail(where + "['cuda'] holds " + std::to_string(cuda.toListRef().size()) + " states (one per device: at most " +
              std::to_string(kMaxCudaStates) + ")");
    for (std::size_t i = 0; i < cuda.toListRef().size(); ++i) {
      const auto& t = cuda.toListRef()[i];
      if (!t.isTensor()) cr.fail(where + "['cuda'] holds " + describeType(t));
      r.cuda.push_back(rngTensor(cr, t.toTensor(), where + "['cuda'][" + std::to_string(i) + "]", std::nullopt));
    }
    return r;
  };
  const auto& rngValue = cr.get(topDict, kRngKey, "snapshot");
  s.rng = readRng(rngValue, kRngKey);
  const auto& ranks = cr.get(cr.dict(rngValue, kRngKey), "ranks", kRngKey);
  if (!ranks.isList()) cr.fail(std::string(kRngKey) + "['ranks'] is " + describeType(ranks));
  for (std::size_t i = 0; i < ranks.toListRef().size(); ++i)
    s.rankRng.push_back(readRng(ranks.toListRef()[i], std::string(kRngKey) + "['ranks'][" + std::to_string(i) + "]"));
  s.userState = cr.stringKeyed(cr.get(topDict, kUserKey, "snapshot"), kUserKey);
}

// The first double in `v` (dicts, lists, tuples) that is NaN or infinite, by its path.
std::optional<std::string> nonFinite(const c10::IValue& v, const std::string& where) {
  if (v.isDouble()) {
    if (std::isfinite(v.toDouble())) return std::nullopt;
    return where + " is " + c10::str(v.toDouble());
  }
  if (v.isList()) {
    const auto list = v.toListRef();
    for (std::size_t i = 0; i < list.size(); ++i)
      if (auto bad = nonFinite(list[i], where + "[" + std::to_string(i) + "]")) return bad;
  } else if (v.isTuple()) {
    const auto& elements = v.toTupleRef().elements();
    for (std::size_t i = 0; i < elements.size(); ++i)
      if (auto bad = nonFinite(elements[i], where + "[" + std::to_string(i) + "]")) return bad;
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      const std::string key = e.key().isString() ? "'" + e.key().toStringRef() + "'" : c10::str(e.key());
      if (auto bad = nonFinite(e.value(), where + "[" + key + "]")) return bad;
    }
  }
  return std::nullopt;
}

// 6. Every value against what the format allows (docs/snapshot.md, "What the loader refuses"): a
//    file with a valid digest can still hold what no run writes — a digest proves the file is as
//    written, not that its writer was ctorch. What this run makes possible is loadSnapshot's.
void checkValues(const Snapshot& s, const std::filesystem::path& file) {
  const FieldReader cr(file, Kind::BadContent);
  auto count = [&](const std::string& name, std::int64_t v) {
    if (v < 0 || v >= kMaxCount)
      cr.fail(name + " is " + std::to_string(v) + " (a count of epochs or steps: 0 to 2^48)");
  };
  count(kEpochsRunKey, s.epochsRun);
  count(kStepInEpochKey, s.stepInEpoch);
  count(kGlobalStepKey, s.globalStep);
  // How the three relate is the writer's own counting (a loop may count GLOBAL_STEP in micro-steps,
  // or only epochs, as PyTorch's torchrun tutorial does): not judged here. What an epoch can hold is
  // the run's to say (SnapshotExpectation::stepsPerEpoch, in loadSnapshot).
  if (s.sampler) {
    const auto& st = *s.sampler;
    const std::string w = kSamplerKey;
    if (st.epoch < 0 || st.epoch >= kMaxCount) cr.fail(w + "['epoch'] is " + std::to_string(st.epoch));
    if (st.worldSize < 1 || st.worldSize > kMaxWorldSize)
      cr.fail(w + "['world_size'] is " + std::to_string(st.worldSize) + " (1 to 2^24)");
    if (st.datasetSize < 0 || st.datasetSize >= kMaxCount)
      cr.fail(w + "['dataset_size'] is " + std::to_string(st.datasetSize) + " (0 to 2^48)");
    const std::int64_t perRank = st.dropLast && st.datasetSize % st.worldSize != 0
                                     ? st.datasetSize / st.worldSize
                                     : (st.datasetSize + st.worldSize - 1) / st.worldSize;
    if (st.consumed < 0 || st.consumed > perRank)
      cr.fail(w + "['consumed'] is " + std::to_string(st.consumed) + "; an epoch of " + std::to_string(st.datasetSize) +
              " samples over " + std::to_string(st.worldSize) + " ranks gives each rank " + std::to_string(perRank));
  }
  if (!s.rankRng.empty() && static_cast<std::int64_t>(s.rankRng.size()) != s.header.worldSize)
    cr.fail(std::string(kRngKey) + "['ranks'] holds " + std::to_string(s.rankRng.size()) +
            " ranks' states in a snapshot of world size " + std::to_string(s.header.worldSize));
  // Hyper-parameters: finite (a NaN learning rate trains nothing and says nothing), and a learning
  // rate below 0 is one no optimizer accepts (Python's raise "Invalid learning rate").
  if (s.optimizerState.contains("param_groups")) {
    const c10::IValue groups = s.optimizerState.at("param_groups");
    if (auto bad = nonFinite(groups, std::string(kOptimizerKey) + "['param_groups']"))
      cr.fail(*bad + ", expected a finite number");
    if (groups.isList())
      for (std::size_t i = 0; i < groups.toListRef().size(); ++i) {
        const auto& g = groups.toListRef()[i];
        if (!g.isGenericDict()) continue;
        const auto d = g.toGenericDict();
        const auto lr = d.find("lr");
        if (lr != d.end() && lr->value().isDouble() && lr->value().toDouble() < 0)
          cr.fail(std::string(kOptimizerKey) + "['param_groups'][" + std::to_string(i) + "]['lr'] is " +
                  c10::str(lr->value().toDouble()) + ", below 0");
      }
  }
  for (const auto& e : s.schedulerState)
    if (auto bad = nonFinite(e.value(), std::string(kSchedulerKey) + "['" + e.key() + "']"))
      cr.fail(*bad + ", expected a finite number");
}

}  // namespace

Snapshot decodeSnapshot(const std::vector<char>& bytes, const std::filesystem::path& file) {
  Snapshot s;
  s.source = file;
  try {
    const auto zip = checkArchive(bytes, file);
    const c10::IValue top = unpickle(bytes, zip, file);
    s.header = readHeader(top, file);
    readContent(top.toGenericDict(), file, s);
    checkValues(s, file);
  } catch (const SnapshotError&) {
    throw;
  } catch (const std::exception& e) {
    // Whatever else reading a crafted file throws (c10::Error, std::bad_alloc) refuses the file like
    // any damage, so the search goes on to the next one.
    throw SnapshotCorrupt(file, Kind::BadContent, "cannot be read: " + errorText(e));
  }
  return s;
}

} // namespace ctorch
