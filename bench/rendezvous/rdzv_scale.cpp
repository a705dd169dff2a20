// How the c10d rendezvous scales with the number of agents: N threads, each one agent with its own
// connection, run the real rendezvous Executor (what ctorchrun runs) against the real native store
// server (what node rank 0's ctorchrun hosts) over loopback, min = max = N, until every agent has
// its node rank for the round. Prints one line per N: time from the first join to the last agent's
// result, the store requests it took, and whether node ranks 0..N-1 were each given once. bench/rendezvous.sh runs it.
// Usage: rdzv_scale_bench N [N ...]   (RDZV_STEADY_S=S: then S seconds of heartbeats as ctorchrun
// sends them, and the store load; RDZV_CAS_ONLY=1: every node joins by compare-and-set on the
// whole state, as torch does and ctorchrun did before the announcements)
#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/executor.hpp"
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
#include <string>
#include <thread>
#include <vector>

namespace rc = ctorch::rdzv::c10d;
namespace store = ctorch::store;
using Clock = std::chrono::steady_clock;

namespace {

class ClientStore final : public rc::CasStore {
 public:
  explicit ClientStore(store::TcpStoreClient& client) : client_(client) {}
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired) override {
    return store::toString(client_.compareSet(key, store::toBytes(expected), store::toBytes(desired)));
  }
  std::string get(const std::string& key) override { return store::toString(client_.get(key)); }
  bool supportsAnnouncements() const override { return announcing_; }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return client_.add(key, delta); }
  void set(const std::string& key, const std::string& value) override { client_.set(key, store::toBytes(value)); }
  bool check(const std::string& key) override { return client_.check({key}); }
  void deleteKey(const std::string& key) override { client_.deleteKey(key); }
  bool checkAll(const std::vector<std::string>& keys) override { return client_.check(keys); }
  std::vector<std::string> getMany(const std::vector<std::string>& keys) override {
    std::vector<std::string> out;
    for (const auto& value : client_.multiGet(keys)) out.push_back(store::toString(value));
    return out;
  }
  bool announcing_ = true;

 private:
  store::TcpStoreClient& client_;
};

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
  for (int i = 0; i < n; ++i)
    agents.emplace_back([&, i] {
      try {
        store::TcpStoreClientOptions co;
        co.timeout = std::chrono::seconds(60);
        store::TcpStoreClient client("127.0.0.1", server.port(), co);
        ClientStore cas(client);
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
