// How the c10d rendezvous scales with the number of agents: N threads, each one agent with its own
// connection, run the real rendezvous Executor (what ctorchrun runs) against the real native store
// server (what node rank 0's ctorchrun hosts) over loopback, min = max = N, until every agent has
// its node rank for the round. Prints one line per N: time from the first join to the last agent's
// result, the store requests it took, and whether node ranks 0..N-1 were each given once; then the
// requests per agent by operation and key family (with RDZV_STEADY_S, the steady state's included).
// bench/rendezvous.sh runs it.
// Usage: rdzv_scale_bench N [N ...]   (RDZV_STEADY_S=S: then S seconds of heartbeats as ctorchrun
// sends them, and the store load; RDZV_CAS_ONLY=1: every node joins by compare-and-set on the
// whole state, as torch does and ctorchrun did before the announcements; RDZV_REQUEST_TIMEOUT_MS:
// the store server's per-request deadline, 0 for none; RDZV_MAX_BUFFERED_MB: its cap on what it
// buffers over all connections)
#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"
#include "ctorch/rdzv/c10d/state.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace rc = ctorch::rdzv::c10d;
namespace store = ctorch::store;
using Clock = std::chrono::steady_clock;

namespace {

// What each agent asked of the store, by operation and by key family: the ClientStore sees every
// call the executor makes. A get or multi-get is two requests on the wire (c10d's client sends WAIT
// first), and every connection opens with VALIDATE and PING; the wire total is what the server counts.
enum Op { kCompareSet, kGet, kAdd, kSet, kCheck, kCheckMany, kGetMany, kDelete, kOps };
enum Family { kState, kPhase, kAnnounceCount, kAnnouncement, kHeartbeat, kOther, kFamilies };
constexpr const char* kOpNames[kOps] = {"compare-set", "get", "add", "set", "check", "check (keys)", "multi-get", "delete"};
constexpr const char* kFamilyNames[kFamilies] = {"state", "phase", "ann.count", "announcement", "heartbeat", "other"};
constexpr int kWirePerCall[kOps] = {1, 2, 1, 1, 1, 1, 2, 1};
constexpr int kWirePerConnection = 2;

struct Counts {
  std::uint64_t calls[kOps][kFamilies] = {};
  std::uint64_t wire() const {
    std::uint64_t w = kWirePerConnection;
    for (int o = 0; o < kOps; ++o)
      for (int f = 0; f < kFamilies; ++f) w += calls[o][f] * kWirePerCall[o];
    return w;
  }
  void addTo(Counts& total) const {
    for (int o = 0; o < kOps; ++o)
      for (int f = 0; f < kFamilies; ++f) total.calls[o][f] += calls[o][f];
  }
};

Family familyOf(const std::string& key, const std::string& runId) {
  const std::string state = rc::stateKey(runId);
  if (key == state) return kState;
  if (key == rc::phaseKey(runId)) return kPhase;
  if (key == rc::announceCountKey(runId)) return kAnnounceCount;
  const std::string announcement = rc::announceCountKey(runId) + "/";
  if (key.compare(0, announcement.size(), announcement) == 0) return kAnnouncement;
  const std::string heartbeat = state + "/hb/";
  if (key.compare(0, heartbeat.size(), heartbeat) == 0) return kHeartbeat;
  return kOther;
}

class ClientStore final : public rc::CasStore {
 public:
  ClientStore(store::TcpStoreClient& client, std::string runId) : client_(client), runId_(std::move(runId)) {}
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    count(kCompareSet, key);
    return store::toString(client_.compareSet(key, store::toBytes(expected), store::toBytes(desired)));
  }
  std::string get(const std::string& key) override {
    count(kGet, key);
    return store::toString(client_.get(key));
  }
  bool supportsAnnouncements() const override { return announcing_; }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    count(kAdd, key);
    return client_.add(key, delta);
  }
  void set(const std::string& key, const std::string& value) override {
    count(kSet, key);
    client_.set(key, store::toBytes(value));
  }
  bool check(const std::string& key) override {
    count(kCheck, key);
    return client_.check({key});
  }
  void deleteKey(const std::string& key) override {
    count(kDelete, key);
    client_.deleteKey(key);
  }
  bool checkAll(const std::vector<std::string>& keys) override {
    count(keys.size() == 1 ? kCheck : kCheckMany, keys.empty() ? std::string() : keys.front());
    return client_.check(keys);
  }
  std::vector<std::string> getMany(const std::vector<std::string>& keys) override {
    count(kGetMany, keys.empty() ? std::string() : keys.front());
    std::vector<std::string> out;
    for (const auto& value : client_.multiGet(keys)) out.push_back(store::toString(value));
    return out;
  }
  const Counts& counts() const { return counts_; }
  bool announcing_ = true;

 private:
  void count(Op op, const std::string& key) { ++counts_.calls[op][familyOf(key, runId_)]; }

  store::TcpStoreClient& client_;
  std::string runId_;
  Counts counts_;
};

// The requests per agent: the mean by operation and key family, the wire total's spread over the
// agents (the round's designated writer admits everyone: it is the maximum).
void printCounts(int n, const Counts& total, std::vector<std::uint64_t> wire) {
  const double per = 1.0 / n;
  std::printf("  store calls per agent (mean), by operation and key family:\n  %-13s", "");
  for (int f = 0; f < kFamilies; ++f) std::printf(" %12s", kFamilyNames[f]);
  std::printf(" %8s %8s\n", "calls", "wire");
  double callSum = 0, wireSum = kWirePerConnection;
  for (int o = 0; o < kOps; ++o) {
    std::uint64_t row = 0;
    for (int f = 0; f < kFamilies; ++f) row += total.calls[o][f];
    if (row == 0) continue;
    std::printf("  %-13s", kOpNames[o]);
    for (int f = 0; f < kFamilies; ++f) std::printf(" %12.2f", static_cast<double>(total.calls[o][f]) * per);
    std::printf(" %8.2f %8.2f\n", static_cast<double>(row) * per, static_cast<double>(row * kWirePerCall[o]) * per);
    callSum += static_cast<double>(row) * per;
    wireSum += static_cast<double>(row * kWirePerCall[o]) * per;
  }
  std::printf("  %-13s", "connect");
  for (int f = 0; f < kFamilies; ++f) std::printf(" %12s", "");
  std::printf(" %8s %8.2f\n", "", static_cast<double>(kWirePerConnection));
  std::printf("  %-13s", "total");
  for (int f = 0; f < kFamilies; ++f) {
    std::uint64_t col = 0;
    for (int o = 0; o < kOps; ++o) col += total.calls[o][f] * kWirePerCall[o];
    std::printf(" %12.2f", static_cast<double>(col) * per);
  }
  std::printf(" %8.2f %8.2f  (family columns of this row: wire requests)\n", callSum, wireSum);
  std::sort(wire.begin(), wire.end());
  if (!wire.empty())
    std::printf("  wire requests per agent: min %llu, median %llu, 90th %llu, max %llu\n",
                static_cast<unsigned long long>(wire.front()), static_cast<unsigned long long>(wire[wire.size() / 2]),
                static_cast<unsigned long long>(wire[wire.size() * 9 / 10]),
                static_cast<unsigned long long>(wire.back()));
}

void raiseFileLimit() {
  rlimit l{};
  if (::getrlimit(RLIMIT_NOFILE, &l) == 0 && l.rlim_cur < l.rlim_max) {
    l.rlim_cur = l.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &l);
  }
}

int runOnce(int n) {
  store::TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  // Only what goes wrong is logged (a dropped client, refused connections): a failed run says why.
  so.debugLog = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  // RDZV_REQUEST_TIMEOUT_MS=0: no per-request deadline (ctorchrun keeps it). Before issue 46 the
  // server, busy with 1,000 agents, judged the admitting node's large compare-and-set late before
  // reading what had arrived, and dropped the round's writer; its own busy time no longer counts.
  if (const char* t = std::getenv("RDZV_REQUEST_TIMEOUT_MS")) so.requestTimeout = std::chrono::milliseconds(std::atoll(t));
  // RDZV_MAX_BUFFERED_MB: the server's cap on unsent replies over all connections. When a large
  // round closes, every node reads the whole state (~420 KB at 1,000 nodes) at about the same
  // moment: over the default 128 MiB if the readers are slower than the server, which then stops
  // reading requests until the replies are taken (it dropped readers before issue 46).
  if (const char* m = std::getenv("RDZV_MAX_BUFFERED_MB")) so.maxBufferedBytes = static_cast<std::size_t>(std::atoll(m)) << 20;
  store::TcpStoreServer server(so);
  rc::Settings settings;
  settings.runId = "bench";
  settings.minNodes = n;
  settings.maxNodes = n;
  settings.joinTimeout = std::chrono::seconds(120);
  settings.readTimeout = std::chrono::seconds(60);
  std::atomic<int> failures{0}, rankErrors{0};
  std::vector<int> ranks(static_cast<std::size_t>(n), -1);
  std::vector<std::thread> agents;
  agents.reserve(static_cast<std::size_t>(n));
  const char* steadyEnv = std::getenv("RDZV_STEADY_S");
  const int steadySeconds = steadyEnv ? std::atoi(steadyEnv) : 0;
  std::atomic<int> arrived{0}, unhealthy{0};
  store::TcpStoreServerStats atSteady{};
  const auto start = Clock::now();
  std::atomic<long long> lastDoneNs{0};
  std::mutex countsMutex;
  Counts totalCounts;
  std::vector<std::uint64_t> wirePerAgent;
  for (int i = 0; i < n; ++i)
    agents.emplace_back([&, i] {
      try {
        store::TcpStoreClientOptions co;
        co.timeout = std::chrono::seconds(60);
        store::TcpStoreClient client("127.0.0.1", server.port(), co);
        ClientStore cas(client, settings.runId);
        // Counted when the agent is done, whichever way it ends.
        struct Tally {
          const ClientStore& cas;
          std::mutex& mutex;
          Counts& total;
          std::vector<std::uint64_t>& wire;
          ~Tally() {
            std::lock_guard<std::mutex> lock(mutex);
            cas.counts().addTo(total);
            wire.push_back(cas.counts().wire());
          }
        } tally{cas, countsMutex, totalCounts, wirePerAgent};
        cas.announcing_ = std::getenv("RDZV_CAS_ONLY") == nullptr;
        rc::NodeInfo self;
        self.id = rc::makeNodeId("host" + std::to_string(i), 100000 + i, 0);
        self.host = "host" + std::to_string(i);
        self.addr = "10.0." + std::to_string(i / 250) + "." + std::to_string(i % 250);
        self.nproc = 8;
        self.storePort = 29500;
        rc::ExecutorOptions eo;
        if (std::getenv("RDZV_LOG"))
          eo.log = [](const std::string& line) { std::fprintf(stderr, "%.120s\n", line.c_str()); };
        rc::Executor executor(cas, settings, self, rc::systemClock(), eo);
        const auto result = executor.nextRound();
        ranks[static_cast<std::size_t>(i)] = result.nodeRank;
        const long long ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
        long long seen = lastDoneNs.load();
        while (ns > seen && !lastDoneNs.compare_exchange_weak(seen, ns)) {
        }
        if (result.nodeCount != n || result.worldSize != 8 * n) ++failures;
        // RDZV_STEADY_S=S: then S seconds of what the agents do while their workers train (a
        // heartbeat check every keep_alive_interval / 4, as ctorchrun does), to see the load on the store.
        if (steadySeconds > 0) {
          arrived.fetch_add(1);
          while (arrived.load() < n) std::this_thread::sleep_for(std::chrono::milliseconds(10));
          const auto until = Clock::now() + std::chrono::seconds(steadySeconds);
          while (Clock::now() < until) {
            std::this_thread::sleep_for(settings.keepAliveInterval / 4);
            if (executor.keepAlive().status != rc::RoundStatus::Healthy) ++unhealthy;
          }
        }
      } catch (const std::exception& e) {
        if (failures++ == 0) std::fprintf(stderr, "agent %d: %s\n", i, e.what());
      }
    });
  if (steadySeconds > 0) {
    while (arrived.load() < n && failures.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    atSteady = server.stats();
  }
  for (auto& t : agents) t.join();
  if (steadySeconds > 0) {
    const auto end = server.stats();
    std::printf("steady state, %d s: store requests/s=%.0f bytes received/s=%.0f unhealthy_assessments=%d\n",
                steadySeconds, static_cast<double>(end.requests - atSteady.requests) / steadySeconds,
                static_cast<double>(end.bytesReceived - atSteady.bytesReceived) / steadySeconds, unhealthy.load());
  }
  std::sort(ranks.begin(), ranks.end());
  for (int i = 0; i < n; ++i)
    if (ranks[static_cast<std::size_t>(i)] != i) ++rankErrors;
  const auto stats = server.stats();
  std::printf("agents=%d seconds=%.3f store_requests=%llu requests_per_agent=%.1f bytes_received=%llu "
              "failures=%d rank_errors=%d\n",
              n, static_cast<double>(lastDoneNs.load()) / 1e9, static_cast<unsigned long long>(stats.requests),
              static_cast<double>(stats.requests) / n, static_cast<unsigned long long>(stats.bytesReceived),
              failures.load(), rankErrors.load());
  std::printf("store server: dropped=%llu (request deadline %llu, slow readers %llu) read_suspensions=%llu "
              "peak_buffered_mib=%.1f\n",
              static_cast<unsigned long long>(stats.droppedConnections),
              static_cast<unsigned long long>(stats.timedOutConnections),
              static_cast<unsigned long long>(stats.slowReaders),
              static_cast<unsigned long long>(stats.readSuspensions),
              static_cast<double>(stats.peakBufferedBytes) / (1 << 20));
  printCounts(n, totalCounts, wirePerAgent);
  std::fflush(stdout);
  return failures.load() + rankErrors.load() == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  raiseFileLimit();
  int status = 0;
  for (int a = 1; a < argc; ++a) status |= runOnce(std::atoi(argv[a]));
  return status;
}
