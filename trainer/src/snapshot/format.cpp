// The snapshot file format, writing: the IValue layout, the header, the digest, the portable archive
// (Python opens it); reading and checking a file is decode.cpp.
#include "ctorch/snapshot.hpp"

#include "snapshot/portable_archive.hpp"
#include "snapshot/generic_dict.hpp"

#include "snapshot/digest.hpp"
#include "snapshot/pickle_scan.hpp"
#include "snapshot/zip_check.hpp"
#include "snapshot/format_fields.hpp"

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

namespace ctorch {
namespace {

using Kind = SnapshotCorrupt::Kind;
using namespace detail::format_fields;

std::string utcText(std::chrono::system_clock::time_point t) {
  const std::time_t secs = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// Tensors the trainer put into its own dicts may live on a GPU or be views of something larger:
// store contiguous CPU copies so that any reader (Python without CUDA too) gets exactly them.
c10::IValue toPortable(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return c10::IValue();
    // Already a CPU tensor owning exactly its storage (what captureSnapshot makes): no copy.
    if (t.device().is_cpu() && t.is_contiguous() && t.storage_offset() == 0 &&
        t.storage().nbytes() == static_cast<std::size_t>(t.numel()) * t.element_size() &&
        !t.requires_grad())
      return t;
    return t.detach().to(at::kCPU).clone(at::MemoryFormat::Contiguous);
  }
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    c10::impl::GenericDict out(d.keyType(), c10::AnyType::get());
    for (const auto& e : d) out.insert(e.key(), toPortable(e.value()));
    return out;
  }
  if (v.isList()) {
    // Always a plain list: typed lists (List[int], List[float], ...) would be pickled through
    // torch.jit._pickle.build_* functions, which torch.load(weights_only=True) refuses.
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& x : v.toListRef()) out.push_back(toPortable(x));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& x : v.toTupleRef().elements()) elements.push_back(toPortable(x));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

c10::impl::GenericDict portableDict(const ItemDict& d) {
  auto out = newStringDict();
  for (const auto& e : d) out.insert(e.key(), toPortable(e.value()));
  return out;
}

c10::impl::GenericDict rngDict(const RngState& r) {
  auto d = newStringDict();
  d.insert("cpu", r.cpu.defined() ? toPortable(r.cpu) : c10::IValue());
  c10::impl::GenericList cuda(c10::AnyType::get());
  for (const auto& t : r.cuda) cuda.push_back(toPortable(t));
  d.insert("cuda", cuda);
  return d;
}


} // namespace

namespace detail {

std::string describeType(const c10::IValue& v) {
  if (v.isGenericDict()) {
    std::string keys;
    int n = 0;
    for (const auto& e : v.toGenericDict()) {
      if (n++ == 8) {
        keys += ", ...";
        break;
      }
      keys += (keys.empty() ? "" : ", ") +
              (e.key().isString() ? e.key().toStringRef() : e.key().tagKind());
    }
    return "a dict with keys [" + keys + "]";
  }
  return "a " + v.tagKind();
}

// The bytes a value's tensors hold, counted at every place a tensor appears: what the digest reads,
// and every walk over the content after it. A file holds each storage once, so a genuine snapshot's
// count is at most its size; a crafted one can name one storage in thousands of places (each a
// reference of a few bytes). kMaxTensorBytesPerFileByte bounds the count by the file's size.
constexpr std::uint64_t kMaxTensorBytesPerFileByte = 4;

// Every tensor's view (sizes, strides, offset) must lie inside its storage before anything reads
// its data: LibTorch's unpickler takes them from the file unchecked. Returns a description of the
// first that does not, naming it by its path in the snapshot, and adds each tensor's bytes to
// `bytes` (saturating). The pickle scan bounded the depth.
std::optional<std::string> badTensorView(const c10::IValue& v, const std::string& where, std::uint64_t& bytes) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined()) return std::nullopt;
    const std::uint64_t held = static_cast<std::uint64_t>(t.numel()) * static_cast<std::uint64_t>(t.element_size());
    const auto sizes = t.sizes();
    const auto strides = t.strides();
    const std::int64_t offset = t.storage_offset();
    std::string shape = "sizes " + c10::str(sizes) + ", strides " + c10::str(strides) +
                        ", offset " + std::to_string(offset);
    if (offset < 0) return "a tensor's view lies outside its storage: " + where + " has a negative storage offset (" + shape + ")";
    bool empty = false;
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0) return "a tensor's view lies outside its storage: " + where + " has a negative size (" + shape + ")";
      if (strides[d] < 0) return "a tensor's view lies outside its storage: " + where + " has a negative stride (" + shape + ")";
      empty = empty || sizes[d] == 0;
    }
    if (empty) return std::nullopt;
    std::uint64_t last = static_cast<std::uint64_t>(offset), needed = 0;
    bool overflow = false;
    for (std::size_t d = 0; d < sizes.size(); ++d) {
      std::uint64_t span = 0;
      overflow = overflow ||
                 __builtin_mul_overflow(static_cast<std::uint64_t>(sizes[d] - 1),
                                        static_cast<std::uint64_t>(strides[d]), &span) ||
                 __builtin_add_overflow(last, span, &last);
    }
    overflow = overflow || __builtin_add_overflow(last, std::uint64_t(1), &last) ||
               __builtin_mul_overflow(last, static_cast<std::uint64_t>(t.element_size()), &needed);
    const std::uint64_t have = t.storage().nbytes();
    if (overflow || needed > have)
      return "a tensor's view lies outside its storage: " + where + " (" + shape + ") reaches " + (overflow ? std::string("beyond 2^64") : std::to_string(needed)) +
             " bytes into a storage of " + std::to_string(have) + " bytes";
    // No element may be read twice (a stride 0, or strides that interleave): such a view is larger
    // than the storage under it — 4 bytes viewed as 2^28 floats — and every reader that makes it
    // contiguous (the digest, the model's copy_) allocates what the view declares, not what the
    // file holds. A non-overlapping view holds at most its storage's elements, so nothing a file
    // declares expands beyond the file. ctorch writes every tensor contiguous; a Python
    // torch.save of an expanded tensor keeps its stride 0 (save tensor.contiguous() instead).
    // Sufficient for "no element twice": the dimensions, by increasing stride, each step over all
    // the elements the smaller ones reach.
    std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of sizes > 1
    for (std::size_t d = 0; d < sizes.size(); ++d)
      if (sizes[d] > 1) dims.emplace_back(strides[d], sizes[d]);
    std::sort(dims.begin(), dims.end());
    std::uint64_t reach = 0;  // the largest offset the smaller dimensions reach; fits: bounded above
    for (const auto& [stride, size] : dims) {
      if (static_cast<std::uint64_t>(stride) <= reach)
        return "a tensor's view reads its storage twice: " + where + " (" + shape + ") reads elements more than once (a stride of " +
               std::to_string(stride) + " over " + std::to_string(size) +
               " elements): a view larger than the data the file holds";
      reach += static_cast<std::uint64_t>(stride) * static_cast<std::uint64_t>(size - 1);
    }
    bytes = held > UINT64_MAX - bytes ? UINT64_MAX : bytes + held;  // the view fits its storage: numel is exact
    return std::nullopt;
  }
  if (v.isList()) {
    const auto list = v.toListRef();
    for (std::size_t i = 0; i < list.size(); ++i)
      if (auto bad = badTensorView(list[i], where + "[" + std::to_string(i) + "]", bytes)) return bad;
  } else if (v.isTuple()) {
    const auto& elements = v.toTupleRef().elements();
    for (std::size_t i = 0; i < elements.size(); ++i)
      if (auto bad = badTensorView(elements[i], where + "[" + std::to_string(i) + "]", bytes)) return bad;
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      const std::string key = e.key().isString() ? "'" + e.key().toStringRef() + "'" : e.key().tagKind();
      if (auto bad = badTensorView(e.key(), where + " key " + key, bytes)) return bad;
      if (auto bad = badTensorView(e.value(), where + "[" + key + "]", bytes)) return bad;
    }
  }
  return std::nullopt;
}

// What the content's tensors hold, counted at every place (badTensorView), against the file's size.
std::optional<std::string> tensorsBeyondFile(std::uint64_t tensorBytes, std::uint64_t fileBytes) {
  if (tensorBytes / kMaxTensorBytesPerFileByte <= fileBytes) return std::nullopt;
  return "its tensors, counted at every place they appear, hold " + std::to_string(tensorBytes) + " bytes, more than " +
         std::to_string(kMaxTensorBytesPerFileByte) + " times the file's " + std::to_string(fileBytes) +
         " (a storage named in many places: every reader would read it at each)";
}

} // namespace detail

// torch::pickle_save's archive (Python's torch.save zip format), but with untagged containers:
// pickle_save tags every dict with torch.jit._pickle.restore_type_tag, a global that Python's
// torch.load(weights_only=True) (the default since PyTorch 2.6) refuses. Plain dicts, lists and
// tuples load everywhere. Every tensor here is a CPU tensor owning its storage (toPortable).
detail::PreparedArchive detail::PreparedArchive::prepare(const c10::IValue& top) {
  PreparedArchive out;
  torch::jit::Pickler pickler(
      [&](const char* p, std::size_t n) { out.pickled_.insert(out.pickled_.end(), p, p + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(top);
  pickler.stop();
  for (const auto& t : pickler.tensorData()) {
    TORCH_CHECK(t.device().is_cpu(), "snapshot tensors must be on the CPU when pickled");
    out.tensors_.push_back(t);
  }
  // What the loader would refuse is refused here, before a byte is written: a value whose pickle
  // the scan refuses (a string that is not UTF-8, a quantized tensor, more shared references than
  // the limit) and tensors placed in more places than the file could hold.
  try {
    (void)scanPickle(out.pickled_.data(), out.pickled_.size());
  } catch (const PickleRefused& e) {
    throw std::invalid_argument(std::string("a snapshot cannot hold this value, its loader would refuse it: ") + e.what());
  }
  std::uint64_t tensorBytes = 0;
  if (auto bad = badTensorView(top, "the snapshot", tensorBytes)) throw std::invalid_argument(*bad);
  std::uint64_t contentBytes = out.pickled_.size();
  for (const auto& t : out.tensors_) contentBytes += t.storage().nbytes();
  if (auto beyond = tensorsBeyondFile(tensorBytes, contentBytes))
    throw std::invalid_argument("a snapshot cannot hold this value: " + *beyond + " (save each tensor once)");
  return out;
}

std::size_t detail::PreparedArchive::sizeBound() const {
  // Each record: a local header with its name and alignment padding (< 64 + name + 64 bytes), a
  // central directory entry; the end records. Generous: a bound, used for buffers and a hint.
  std::size_t total = pickled_.size() + 4096;
  for (const auto& t : tensors_) total += t.storage().nbytes() + 256;
  return total;
}

void detail::PreparedArchive::write(const ByteSink& sink) const {
  // The sink's failure (a full disk: ENOSPC, EIO) must not cross the archive writer: the writer
  // then finishes its archive in its destructor, which calls the sink again and throws from a
  // destructor (std::terminate, SIGABRT; seen with a 6 MB snapshot on a full tmpfs). So the first
  // failure is kept, the sink becomes a no-op, no further record is written, and the failure is
  // rethrown once the writer has closed.
  std::exception_ptr failure;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* p, std::size_t n) -> std::size_t {
      if (failure) return n;
      try {
        sink(static_cast<const char*>(p), n);
      } catch (...) {
        failure = std::current_exception();
      }
      return n;
    });
    for (std::size_t i = 0; i < tensors_.size() && !failure; ++i)
      writer.writeRecord("data/" + std::to_string(i), tensors_[i].storage().data(), tensors_[i].storage().nbytes());
    if (!failure) writer.writeRecord("data.pkl", pickled_.data(), pickled_.size());
    writer.writeEndOfFile();
  }
  if (failure) std::rethrow_exception(failure);
}

std::vector<char> detail::portableArchive(const c10::IValue& top) {
  const auto prepared = PreparedArchive::prepare(top);
  std::vector<char> archive;
  archive.reserve(prepared.sizeBound());
  prepared.write([&](const char* p, std::size_t n) { archive.insert(archive.end(), p, p + n); });
  return archive;
}

// ---- Errors ----------------------------------------------------------------------------------------
SnapshotError::SnapshotError(std::filesystem::path file, const std::string& message)
    : Error(message), file_(std::move(file)) {}

SnapshotNotFound::SnapshotNotFound(std::filesystem::path file)
    : SnapshotError(file, "snapshot " + file.string() + " does not exist") {}

const char* SnapshotCorrupt::kindName(Kind kind) {
  switch (kind) {
    case Kind::Empty: return "empty";
    case Kind::Zeroed: return "zeroed";
    case Kind::Foreign: return "not a ctorch snapshot";
    case Kind::Truncated: return "truncated";
    case Kind::Damaged: return "damaged archive";
    case Kind::Checksum: return "checksum mismatch";
    case Kind::BadHeader: return "bad header";
    case Kind::Digest: return "content digest mismatch";
    case Kind::BadContent: return "bad content";
  }
  return "corrupt";
}

SnapshotCorrupt::SnapshotCorrupt(std::filesystem::path file, Kind kind, const std::string& detail)
    : SnapshotError(file, "snapshot " + file.string() + " is unusable (" + kindName(kind) +
                              "): " + detail),
      kind_(kind) {}

namespace {
std::string joinDifferences(const std::vector<std::string>& differences) {
  std::string out;
  for (const auto& d : differences) out += (out.empty() ? "" : "; ") + d;
  return out;
}
} // namespace

SnapshotIncompatible::SnapshotIncompatible(std::filesystem::path file, std::vector<std::string> differences,
                                           std::string advice)
    : SnapshotError(file, "snapshot " + file.string() + " does not fit this run: " + joinDifferences(differences) +
                              (advice.empty() ? std::string() : "; " + advice)),
      differences_(std::move(differences)),
      advice_(std::move(advice)) {}

// ---- Expectation ------------------------------------------------------------------------------------
std::vector<std::string> compareWithExpectation(const SnapshotHeader& header,
                                                const SnapshotExpectation& expect) {
  std::vector<std::string> diffs;
  if (!expect.modelName.empty() && expect.modelName != header.modelName)
    diffs.push_back("model name is '" + header.modelName + "' in the snapshot, '" +
                    expect.modelName + "' in this run");
  if (expect.worldSize && *expect.worldSize != header.worldSize)
    diffs.push_back("world size is " + std::to_string(header.worldSize) + " in the snapshot, " +
                    std::to_string(*expect.worldSize) + " in this run");
  if (expect.config) {
    const auto& mine = *expect.config;
    const auto& theirs = header.config;
    for (const auto& [key, value] : theirs) {
      auto it = mine.find(key);
      if (it == mine.end())
        diffs.push_back("config '" + key + "' is only in the snapshot ('" + value + "')");
      else if (it->second != value)
        diffs.push_back("config '" + key + "' is '" + value + "' in the snapshot, '" +
                        it->second + "' in this run");
    }
    for (const auto& [key, value] : mine)
      if (!theirs.count(key))
        diffs.push_back("config '" + key + "' is only in this run ('" + value + "')");
  }
  return diffs;
}

// ---- Encoding ---------------------------------------------------------------------------------------
detail::PreparedArchive detail::prepareSnapshot(Snapshot& s) {
  auto header = newStringDict();
  header.insert("magic", s.header.magic);
  header.insert("format_version", s.header.formatVersion);
  header.insert("world_size", s.header.worldSize);
  header.insert("model_name", s.header.modelName);
  auto config = newStringDict();
  for (const auto& [k, v] : s.header.config) config.insert(k, v);
  header.insert("config", config);
  header.insert("config_hash", s.header.configHash);
  header.insert("created_unix",
                static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::seconds>(
                                              s.header.createdAt.time_since_epoch())
                                              .count()));
  header.insert("created_utc", utcText(s.header.createdAt));
  header.insert("ctorch_version", s.header.ctorchVersion);
  header.insert("torch_version", s.header.torchVersion);
  if (!s.header.saveId.empty()) header.insert("save_id", s.header.saveId);  // absent: files stay as before

  auto top = newStringDict();
  top.insert(kHeaderKey, header);
  c10::Dict<std::string, at::Tensor> model;
  for (const auto& e : s.modelState) {
    if (!e.value().defined()) throw std::invalid_argument("MODEL_STATE['" + e.key() + "'] is undefined");
    model.insert(e.key(), toPortable(e.value()).toTensor());
  }
  top.insert(kModelKey, model);
  top.insert(kOptimizerTypeKey, s.optimizerType);
  top.insert(kOptimizerKey, s.optimizerType.empty() ? c10::IValue() : c10::IValue(portableDict(s.optimizerState)));
  top.insert(kSchedulerKey, portableDict(s.schedulerState));
  top.insert(kEpochsRunKey, s.epochsRun);
  top.insert(kStepInEpochKey, s.stepInEpoch);
  top.insert(kGlobalStepKey, s.globalStep);
  if (s.sampler) {
    auto sampler = newStringDict();
    sampler.insert("epoch", s.sampler->epoch);
    sampler.insert("consumed", s.sampler->consumed);
    sampler.insert("world_size", s.sampler->worldSize);
    sampler.insert("dataset_size", s.sampler->datasetSize);
    sampler.insert("seed", s.sampler->seed);
    sampler.insert("shuffle", s.sampler->shuffle);
    sampler.insert("drop_last", s.sampler->dropLast);
    top.insert(kSamplerKey, sampler);
  } else {
    top.insert(kSamplerKey, c10::IValue());
  }
  auto rng = rngDict(s.rng);
  c10::impl::GenericList ranks(c10::AnyType::get());
  for (const auto& r : s.rankRng) ranks.push_back(rngDict(r));
  rng.insert("ranks", ranks);
  top.insert(kRngKey, rng);
  top.insert(kUserKey, portableDict(s.userState));

  // The digest covers everything in the file except itself; IValue dicts are shared, so adding
  // it to `header` afterwards puts it into `top` too.
  s.header.contentDigest = contentDigest(top, "snapshot");
  header.insert(kDigestKey, s.header.contentDigest);
  return detail::PreparedArchive::prepare(top);
}

std::vector<char> encodeSnapshot(Snapshot& s) {
  const auto prepared = detail::prepareSnapshot(s);
  std::vector<char> archive;
  archive.reserve(prepared.sizeBound());
  prepared.write([&](const char* p, std::size_t n) { archive.insert(archive.end(), p, p + n); });
  return archive;
}

} // namespace ctorch
