// The shared-memory allreduce: a segment of (world + 1) slots, two barriers per chunk.
//   1. every rank copies its chunk into its own slot (divided by the world size for a mean);
//   2. barrier;  3. rank r sums its slice of every slot, in rank order, into the result slot;
//   4. barrier;  5. every rank copies the result slot back.
// Step 1 of the next chunk writes only this rank's slot, which nobody reads after barrier 4, and
// step 3 of the next chunk writes the result slot only after barrier 2, which every rank reaches
// after its step 5: two barriers are enough. Barrier waits spin briefly, then sleep on a futex in
// 10 ms slices, looking each time for the abort word, dead peers and the deadline.
#include "ddp/shared_memory_allreduce.hpp"

#include "core/exception_text.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <deque>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

namespace ctorch {

namespace {

constexpr std::uint64_t kMagic = 0x6374726368736d31ULL;  // "ctrchsm1"
constexpr std::size_t kAlign = 64;
constexpr std::size_t kNameBytes = 64;
constexpr int kSpins = 4000;  // ~10-20 us of polling before sleeping on the futex
constexpr auto kSlice = std::chrono::milliseconds(10);

struct PeerInfo {
  std::atomic<std::int32_t> pid;
  std::atomic<std::uint32_t> arrived;  // the barrier generation this rank last arrived at, + 1
  std::uint64_t pidNamespace;
  char pad[kAlign - 16];
};
static_assert(sizeof(PeerInfo) == kAlign);

struct Header {
  std::uint64_t magic;
  std::uint32_t world;
  std::uint32_t pad0;
  std::uint64_t chunkBytes;
  alignas(kAlign) std::atomic<std::uint32_t> arrive;
  alignas(kAlign) std::atomic<std::uint32_t> generation;  // the futex word
  std::atomic<std::uint32_t> sleepers;
  std::atomic<std::uint32_t> abortRank;  // 0: none; r + 1: rank r failed and every wait must end
  // PeerInfo[world] follows, then the slots.
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(std::atomic<std::int32_t>::is_always_lock_free);

std::size_t roundUp(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
std::size_t peersOffset() { return roundUp(sizeof(Header)); }
std::size_t slotsOffset(int world) { return roundUp(peersOffset() + sizeof(PeerInfo) * static_cast<std::size_t>(world)); }
std::size_t segmentBytes(int world, std::size_t chunk) {
  return slotsOffset(world) + chunk * static_cast<std::size_t>(world + 1);
}

std::uint64_t pidNamespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

long futexWait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::milliseconds slice) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000) * 1000000L;
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<std::uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A process that has exited (or is a zombie nobody reaped yet) will never arrive.
bool processGone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

// Adds the time until it goes out of scope to `into`, in nanoseconds (the statistics).
class TimeInto {
 public:
  explicit TimeInto(std::atomic<std::int64_t>& into) : into_(into), start_(std::chrono::steady_clock::now()) {}
  ~TimeInto() {
    into_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }
  TimeInto(const TimeInto&) = delete;
  TimeInto& operator=(const TimeInto&) = delete;

 private:
  std::atomic<std::int64_t>& into_;
  std::chrono::steady_clock::time_point start_;
};

std::string millis(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << static_cast<double>(d.count()) / 1000.0 << " s";
  return os.str();
}

[[noreturn]] void rethrowCollective(const std::exception& e, const char* during) {
  const std::string message = detail::messageOf(e);
  detail::throwDistributed(std::string("shared-memory allreduce set-up (") + during + "): " + message, message);
}

} // namespace

void SharedMemoryAllreduceOptions::validate() const {
  if (timeout_.count() <= 0)
    throw ConfigError("SharedMemoryAllreduceOptions::timeout must be positive, got " + std::to_string(timeout_.count()) +
                      " ms");
  if (chunkBytes_ < 4096 || chunkBytes_ > (std::int64_t{1} << 30) || chunkBytes_ % 64 != 0)
    throw ConfigError("SharedMemoryAllreduceOptions::chunkBytes must be a multiple of 64 from 4096 to 1 GiB, got " +
                      std::to_string(chunkBytes_));
}

struct SharedMemoryAllreduce::Impl {
  int rank = 0;
  int world = 1;
  std::chrono::milliseconds timeout{0};
  std::size_t chunkBytes = 0;
  std::size_t bytes = 0;
  void* base = nullptr;
  bool checkPids = true;  // every rank in this process's PID namespace
  std::string failure;  // set once a call failed (by the thread that reduced): later calls fail at once

  // Calls run in order on one worker thread, so a caller (the Reducer's autograd hook) goes on
  // computing while this rank waits for a late peer.
  struct Job {
    at::Tensor tensor;
    Op op = Op::kSum;
    c10::intrusive_ptr<c10::ivalue::Future> done;
  };
  std::mutex mutex;
  std::condition_variable ready;  // for the worker: a job, or stopping
  std::condition_variable idle;   // for allreduce(): the worker has nothing queued or running
  std::deque<Job> jobs;
  bool workerBusy = false;  // under mutex
  bool callerBusy = false;  // under mutex: allreduce() reduces on its own thread
  std::atomic<bool> stopping{false};
  std::thread worker;

  std::atomic<std::int64_t> calls{0};
  std::atomic<std::int64_t> totalNs{0};
  std::atomic<std::int64_t> waitingNs{0};
  std::atomic<std::int64_t> waits{0};
  std::atomic<std::int64_t> lastArrivals{0};

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    ready.notify_all();
    if (worker.joinable()) worker.join();  // a wait in progress sees `stopping` within one slice
    if (base) ::munmap(base, bytes);
  }

  void reduce(at::Tensor& tensor, Op op);
  void work();

  Header& header() const { return *static_cast<Header*>(base); }
  PeerInfo& peer(int r) const {
    return reinterpret_cast<PeerInfo*>(static_cast<char*>(base) + peersOffset())[r];
  }
  char* slot(int r) const {  // r == world: the result slot
    return static_cast<char*>(base) + slotsOffset(world) + chunkBytes * static_cast<std::size_t>(r);
  }

  [[noreturn]] void fail(const std::string& message, bool timedOut) {
    std::uint32_t none = 0;
    header().abortRank.compare_exchange_strong(none, static_cast<std::uint32_t>(rank + 1));
    futexWakeAll(&header().generation);
    failure = "shared-memory allreduce: " + message;
    if (timedOut) throw DistributedTimeout(failure);
    throw DistributedError(failure);
  }

  std::string missing(std::uint32_t generation) const {
    std::string names;
    for (int r = 0; r < world; ++r)
      if (r != rank && peer(r).arrived.load(std::memory_order_acquire) != generation + 1)
        names += (names.empty() ? "" : ", ") + std::to_string(r);
    return names.empty() ? "?" : names;
  }

  void checkPeers(std::uint32_t generation) {
    if (stopping.load()) fail("shut down while rank " + std::to_string(rank) + " waited for the others", false);
    if (const auto aborted = header().abortRank.load(std::memory_order_acquire); aborted != 0)
      fail("rank " + std::to_string(aborted - 1) + " failed, so rank " + std::to_string(rank) + " cannot go on", false);
    if (!checkPids) return;
    for (int r = 0; r < world; ++r) {
      if (r == rank || peer(r).arrived.load(std::memory_order_acquire) == generation + 1) continue;
      const pid_t pid = peer(r).pid.load(std::memory_order_relaxed);
      if (pid > 0 && processGone(pid))
        fail("rank " + std::to_string(r) + " (pid " + std::to_string(pid) + ") exited while rank " +
                 std::to_string(rank) + " waited for it",
             false);
    }
  }

  void barrier() {
    Header& h = header();
    const std::uint32_t generation = h.generation.load(std::memory_order_acquire);
    peer(rank).arrived.store(generation + 1, std::memory_order_release);
    if (h.arrive.fetch_add(1, std::memory_order_acq_rel) == static_cast<std::uint32_t>(world - 1)) {
      ++lastArrivals;
      h.arrive.store(0, std::memory_order_relaxed);
      h.generation.fetch_add(1, std::memory_order_seq_cst);
      if (h.sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(&h.generation);
      return;
    }
    ++waits;  // before the wait: another thread of this rank reading stats() knows it is waiting here
    const TimeInto waited(waitingNs);
    for (int i = 0; i < kSpins; ++i) {
      if (h.generation.load(std::memory_order_acquire) != generation) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (h.generation.load(std::memory_order_acquire) == generation) {
      checkPeers(generation);
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline)
        fail("timed out after " + millis(timeout) + ": rank " + std::to_string(rank) + " waited for rank(s) " +
                 missing(generation),
             true);
      h.sleepers.fetch_add(1, std::memory_order_seq_cst);
      futexWait(&h.generation, generation,
                std::min<std::chrono::milliseconds>(kSlice, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) +
                                                                 std::chrono::milliseconds(1)));
      h.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }
};

SharedMemoryAllreduce::SharedMemoryAllreduce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SharedMemoryAllreduce::~SharedMemoryAllreduce() = default;
int SharedMemoryAllreduce::rank() const { return impl_->rank; }
int SharedMemoryAllreduce::worldSize() const { return impl_->world; }

std::shared_ptr<SharedMemoryAllreduce> SharedMemoryAllreduce::create(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, const SharedMemoryAllreduceOptions& options) {
  options.validate();
  if (!group) throw ConfigError("SharedMemoryAllreduce::create needs a process group");
  // NCCL's collectives take GPU tensors and its gradients live on the GPU: nothing to share here.
  if (group->getBackendName() == "nccl") return nullptr;
  auto impl = std::make_unique<Impl>();
  impl->rank = group->getRank();
  impl->world = group->getSize();
  impl->timeout = options.timeout();
  impl->chunkBytes = static_cast<std::size_t>(options.chunkBytes());
  impl->bytes = segmentBytes(impl->world, impl->chunkBytes);
  if (impl->world == 1) return std::shared_ptr<SharedMemoryAllreduce>(new SharedMemoryAllreduce(std::move(impl)));

  // Rank 0 creates the segment and says its name; an empty name: it could not.
  std::string name;
  int fd = -1;
  if (impl->rank == 0) {
    std::random_device random;
    std::ostringstream os;
    os << "/ctorch-allreduce-" << ::getpid() << "-" << std::hex << random() << random();
    name = os.str();
    fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    // posix_fallocate reserves the pages: a full /dev/shm is an error here, not a SIGBUS later.
    if (fd < 0 || ::posix_fallocate(fd, 0, static_cast<off_t>(impl->bytes)) != 0) {
      if (fd >= 0) {
        ::close(fd);
        ::shm_unlink(name.c_str());
        fd = -1;
      }
      name.clear();
    }
  }
  try {
    auto nameTensor = at::zeros({static_cast<std::int64_t>(kNameBytes)}, at::kByte);
    std::memcpy(nameTensor.data_ptr(), name.data(), std::min(name.size(), kNameBytes - 1));
    std::vector<at::Tensor> t{nameTensor};
    group->broadcast(t)->wait();
    name.assign(reinterpret_cast<const char*>(nameTensor.data_ptr()));
  } catch (const std::exception& e) {
    if (fd >= 0) {
      ::close(fd);
      ::shm_unlink(name.c_str());
    }
    rethrowCollective(e, "the segment's name");
  }

  bool ok = !name.empty();
  if (ok && impl->rank != 0) {
    fd = ::shm_open(name.c_str(), O_RDWR, 0);
    struct stat st {};
    ok = fd >= 0 && ::fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) == impl->bytes;
  }
  if (ok) {
    void* base = ::mmap(nullptr, impl->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) ok = false;
    else impl->base = base;
  }
  if (fd >= 0) ::close(fd);
  const std::uint64_t ns = pidNamespace();
  if (ok && impl->rank == 0) {
    auto* h = new (impl->base) Header{};
    h->magic = kMagic;
    h->world = static_cast<std::uint32_t>(impl->world);
    h->chunkBytes = impl->chunkBytes;
  }
  // Every rank says whether it has the segment (and, for rank 0, that the header is written);
  // a MIN over the flags decides for all. The PID namespaces are compared the same way.
  std::int64_t everyone = 0, nsMin = 0, nsMax = 0;
  try {
    auto flags = at::tensor({static_cast<std::int64_t>(ok), static_cast<std::int64_t>(ns),
                             -static_cast<std::int64_t>(ns)},
                            at::kLong);
    std::vector<at::Tensor> t{flags};
    c10d::AllreduceOptions min;
    min.reduceOp = c10d::ReduceOp::MIN;
    group->allreduce(t, min)->wait();
    everyone = flags[0].item<std::int64_t>();
    nsMin = flags[1].item<std::int64_t>();
    nsMax = -flags[2].item<std::int64_t>();
  } catch (const std::exception& e) {
    if (impl->rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
    rethrowCollective(e, "who has the segment");
  }
  // Every rank has it open (or gave up): the name is no longer needed.
  if (impl->rank == 0 && !name.empty()) ::shm_unlink(name.c_str());
  if (everyone == 0) return nullptr;
  if (impl->header().magic != kMagic || impl->header().world != static_cast<std::uint32_t>(impl->world) ||
      impl->header().chunkBytes != impl->chunkBytes)
    throw DistributedError("shared-memory allreduce: the segment " + name + " is not the one rank 0 made");
  impl->checkPids = ns != 0 && nsMin == nsMax;
  impl->peer(impl->rank).pidNamespace = ns;
  impl->peer(impl->rank).pid.store(::getpid(), std::memory_order_release);
  // The first barrier also publishes every rank's pid before anyone waits on it.
  impl->barrier();
  return std::shared_ptr<SharedMemoryAllreduce>(new SharedMemoryAllreduce(std::move(impl)));
}

namespace {

void checkTensor(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.device().type() != c10::DeviceType::CPU || tensor.is_sparse() ||
      !tensor.is_contiguous() || tensor.is_complex() || tensor.scalar_type() == at::kBool)
    throw ConfigError("SharedMemoryAllreduce::allreduce takes a dense, contiguous CPU tensor of a real type, got " +
                      (tensor.defined() ? tensor.toString() + " of " + std::to_string(tensor.dim()) + " dimension(s)" +
                                              (tensor.is_contiguous() ? "" : ", not contiguous")
                                        : std::string("an undefined tensor")));
}

void checkCall(const at::Tensor& tensor, SharedMemoryAllreduce::Op op) {
  checkTensor(tensor);
  if (op == SharedMemoryAllreduce::Op::kAverage && !at::isFloatingType(tensor.scalar_type()))
    throw ConfigError("SharedMemoryAllreduce: Op::kAverage needs a floating-point tensor, got " + tensor.toString());
}

} // namespace

void SharedMemoryAllreduce::Impl::reduce(at::Tensor& tensor, Op op) {
  if (!failure.empty()) throw DistributedError(failure + " (an earlier call failed)");
  ++calls;
  const TimeInto timed(totalNs);
  const auto elementBytes = static_cast<std::size_t>(tensor.element_size());
  const auto chunkElements = static_cast<std::int64_t>(chunkBytes / elementBytes);
  auto flat = tensor.view({-1});
  const std::int64_t total = flat.numel();
  const auto options = at::TensorOptions().dtype(tensor.scalar_type()).device(at::kCPU);
  auto view = [&](int r, std::int64_t begin, std::int64_t count) {
    return at::from_blob(slot(r) + static_cast<std::size_t>(begin) * elementBytes, {count}, options);
  };
  const bool average = op == Op::kAverage;
  for (std::int64_t start = 0; start < total; start += chunkElements) {
    const std::int64_t n = std::min(chunkElements, total - start);
    auto chunk = flat.narrow(0, start, n);
    view(rank, 0, n).copy_(chunk);
    barrier();
    const std::int64_t begin = n * rank / world, end = n * (rank + 1) / world;
    if (end > begin) {
      const std::int64_t count = end - begin;
      auto out = view(world, begin, count);
      at::add_out(out, view(0, begin, count), view(1, begin, count));
      for (int r = 2; r < world; ++r) out.add_(view(r, begin, count));
    }
    barrier();
    // The sum, in rank order, then one division.
    if (!average) chunk.copy_(view(world, 0, n));
    else at::div_out(chunk, view(world, 0, n), at::scalar_tensor(world, options));
  }
}

void SharedMemoryAllreduce::Impl::work() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex);
      ready.wait(lock, [this] { return stopping.load() || (!jobs.empty() && !callerBusy); });
      if (jobs.empty()) return;  // stopping, nothing left
      job = std::move(jobs.front());
      jobs.pop_front();
      workerBusy = true;
    }
    std::exception_ptr error;
    try {
      if (stopping.load()) throw DistributedError("shared-memory allreduce: shut down before this call ran");
      reduce(job.tensor, job.op);
    } catch (...) {
      error = std::current_exception();
    }
    // Completed outside the lock (the future's callbacks may queue more calls), and before a
    // waiting allreduce() goes on: it runs after this call in every sense.
    if (error) job.done->setError(error);
    else job.done->markCompleted(c10::IValue(job.tensor));
    {
      std::lock_guard<std::mutex> lock(mutex);
      workerBusy = false;
    }
    idle.notify_all();
  }
}

c10::intrusive_ptr<c10::ivalue::Future> SharedMemoryAllreduce::allreduceAsync(const at::Tensor& tensor, Op op) {
  checkCall(tensor, op);
  Impl& s = *impl_;
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  if (s.world == 1) {  // the sum and the mean of one tensor is itself
    done->markCompleted(c10::IValue(tensor));
    return done;
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.worker.joinable()) s.worker = std::thread([&s] { s.work(); });
    s.jobs.push_back(Impl::Job{tensor, op, done});
  }
  s.ready.notify_one();
  return done;
}

void SharedMemoryAllreduce::allreduce(at::Tensor& tensor, Op op) {
  checkCall(tensor, op);
  Impl& s = *impl_;
  if (s.world == 1) return;
  {
    // The calls queued before this one go first (the ranks' call orders must match).
    std::unique_lock<std::mutex> lock(s.mutex);
    s.idle.wait(lock, [&s] { return s.jobs.empty() && !s.workerBusy; });
    s.callerBusy = true;
  }
  struct Release {
    Impl& s;
    ~Release() {
      {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.callerBusy = false;
      }
      s.ready.notify_all();
    }
  } release{s};
  s.reduce(tensor, op);
}

SharedMemoryAllreduce::Stats SharedMemoryAllreduce::stats() const {
  Stats out;
  out.calls = impl_->calls.load();
  out.total = std::chrono::nanoseconds(impl_->totalNs.load());
  out.waiting = std::chrono::nanoseconds(impl_->waitingNs.load());
  out.waits = impl_->waits.load();
  out.lastArrivals = impl_->lastArrivals.load();
  return out;
}

} // namespace ctorch
