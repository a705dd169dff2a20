// In-place recovery's control plane on a real workers' store (port 0, 127.0.0.1): genuine clients
// (contract/control_client.hpp) next to outsiders on raw sockets — wrong keys, malformed
// handshakes, a transcript recorded by a proxy and replayed, a handshake left unfinished, and the
// plain store writes that used to steer in-place recovery. c10d clients share the port throughout.
#include "ctorch_catch.hpp"
#include "launcher_test_util.hpp"
#include "manual_clock.hpp"

#include "ctorch/contract/control_client.hpp"
#include "ctorch/control/control_plane.hpp"
#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

// Named, not anonymous: the store test sources are compiled as one unit.
namespace control_plane_test {

namespace cc = ctorch::contract::control;
using ctorch::control::ControlPlane;
using ctorch::store::TcpStoreServer;
using ctorch::store::TcpStoreServerOptions;
using cc::Message;
using cc::Type;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const std::string kKey = "the job's control key, 32 bytes!";
const std::string kWrongKey = "another job's key, also 32 bytes";

// The plane as the store sees it, and which connections it was handed and not yet told closed:
// what the plane holds per connection lives exactly that long.
class Watched : public ctorch::store::SideProtocol {
 public:
  explicit Watched(std::shared_ptr<ControlPlane> plane) : plane_(std::move(plane)) {}
  std::string_view magic() const override { return plane_->magic(); }
  bool received(std::uint64_t conn, std::string_view bytes, std::vector<Output>& out) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_.insert(conn);
    }
    return plane_->received(conn, bytes, out);
  }
  void closed(std::uint64_t conn, std::vector<Output>& out) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_.erase(conn);
    }
    plane_->closed(conn, out);
  }
  std::size_t open() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return open_.size();
  }

 private:
  std::shared_ptr<ControlPlane> plane_;
  mutable std::mutex mutex_;
  std::set<std::uint64_t> open_;
};

// A workers' store with the job's control plane on it, as node rank 0's ctorchrun serves it. Its
// deadlines run on `clock`, which only the test moves: no handshake is late for the machine being slow.
struct Server {
  ctorch::launcher_test::LogLines log;
  ctorch::launcher_test::ManualClock clock;
  std::shared_ptr<ControlPlane> plane;
  std::shared_ptr<Watched> side;
  std::unique_ptr<TcpStoreServer> store;

  explicit Server(std::chrono::milliseconds requestTimeout = 5s, std::size_t maxConnections = 0) {
    plane = std::make_shared<ControlPlane>(kKey, log.sink());
    side = std::make_shared<Watched>(plane);
    TcpStoreServerOptions o;
    o.host = "127.0.0.1";
    o.side = side;
    o.requestTimeout = requestTimeout;
    o.maxConnections = maxConnections;
    o.clock = clock.source();
    store = std::make_unique<TcpStoreServer>(o);
  }
  int port() const { return store->port(); }
  ctorch::control::ControlPlaneStats stats() const { return plane->stats(); }

  // Node 0's agent, holding every rank of `world`.
  std::unique_ptr<cc::BlockingClient> agent(int world) const {
    return std::make_unique<cc::BlockingClient>("127.0.0.1", port(), kKey, cc::agentHello(0, 0, world, world), 60s);
  }
  std::unique_ptr<cc::BlockingClient> worker(int rank, std::uint64_t incarnation, int port = 0) const {
    return std::make_unique<cc::BlockingClient>("127.0.0.1", port ? port : this->port(), kKey,
                                                cc::workerHello(rank, incarnation, 1000 + rank), 60s);
  }
  ctorch::store::TcpStoreClient c10d() const {
    ctorch::store::TcpStoreClientOptions o;
    o.timeout = 60s;
    o.operationTimeout = 60s;
    return ctorch::store::TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(port()), o);
  }
};

Message registerRank(int rank, std::uint64_t incarnation) {
  Message m = cc::message(Type::kRegister);
  m.rank = rank;
  m.incarnation = incarnation;
  return m;
}
Message reform(std::int64_t generation) {
  Message m = cc::message(Type::kReform);
  m.generation = generation;
  m.value = 1;
  return m;
}
Message groupBuilt(std::int64_t generation) {
  Message m = cc::message(Type::kGroupBuilt);
  m.generation = generation;
  return m;
}
Message evictSilent(std::int64_t generation) {
  Message m = cc::message(Type::kEvictSilent);
  m.generation = generation;
  m.value = 0;  // waited 0 ms: every registered process that is not waiting is silent
  return m;
}

// The next message of `type` within `within`; those before it are appended to `skipped`.
std::optional<Message> awaitType(cc::BlockingClient& c, Type type, std::chrono::milliseconds within,
                                 std::vector<Message>* skipped = nullptr) {
  const auto deadline = Clock::now() + within;
  while (auto m = c.receive(deadline)) {
    if (m->type == type) return m;
    if (skipped) skipped->push_back(*m);
  }
  return std::nullopt;
}

// ---- Raw sockets ----------------------------------------------------------------------------------
struct Socket {
  explicit Socket(int port) : fd(ctorch::launcher_test::connectLoopback(port)) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd;
};

bool sendAll(int fd, const std::string& b) {
  std::size_t sent = 0;
  while (sent < b.size()) {
    const ssize_t n = ::send(fd, b.data() + sent, b.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

// Exactly `n` bytes within `within`, or fewer when the peer closed or the time ran out.
std::string readExactly(int fd, std::size_t n, std::chrono::milliseconds within) {
  const auto end = Clock::now() + within;
  std::string out;
  char buf[256];
  while (out.size() < n) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) != 1) break;
    const ssize_t r = ::recv(fd, buf, std::min(sizeof buf, n - out.size()), 0);
    if (r <= 0) break;
    out.append(buf, static_cast<std::size_t>(r));
  }
  return out;
}

// True if the peer closes `fd` within `within` (what it sent before is read and discarded).
bool closedWithin(int fd, std::chrono::milliseconds within) {
  const auto end = Clock::now() + within;
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) != 1) return false;
    if (::recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
}

std::string magic() { return std::string(cc::kMagic.begin(), cc::kMagic.end()); }

// A client's half of the handshake done by hand under `key`, without checking the server's proof
// (an outsider would not care): the channel it then speaks, or nullopt when the server said nothing.
std::optional<cc::Channel> rawHandshake(int fd, const std::string& key) {
  const cc::Nonce mine = cc::randomNonce();
  if (!sendAll(fd, cc::clientHello(mine))) return std::nullopt;
  const std::string answer = readExactly(fd, cc::kServerHelloSize, 60s);
  if (answer.size() != cc::kServerHelloSize) return std::nullopt;
  cc::Nonce server{};
  std::copy(answer.begin(), answer.begin() + cc::kNonceSize, server.begin());
  return cc::Channel(key, mine, server, true);
}

// Forwards one connection to 127.0.0.1:target both ways, on a thread, and keeps what the client
// sent: a man in the middle recording a genuine session.
class RecordingProxy {
 public:
  explicit RecordingProxy(int target) : target_(target) {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(listen_ >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = 0;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(listen_, 4) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
  }
  ~RecordingProxy() {
    stop_ = true;
    thread_.join();
    ::close(listen_);
  }
  RecordingProxy(const RecordingProxy&) = delete;
  RecordingProxy& operator=(const RecordingProxy&) = delete;

  int port() const { return port_; }
  std::string clientBytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return recorded_;
  }

 private:
  // Polls in 50 ms steps so that the destructor's stop_ is seen: every wait here is bounded.
  void run() {
    int client = -1;
    while (!stop_ && client < 0) {
      pollfd p{listen_, POLLIN, 0};
      if (::poll(&p, 1, 50) == 1) client = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    }
    if (client < 0) return;
    const int server = ctorch::launcher_test::connectLoopback(target_);
    if (server >= 0) forward(client, server);
    ::close(client);
    if (server >= 0) ::close(server);
  }
  void forward(int client, int server) {
    char buf[4096];
    while (!stop_) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 50) <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t n = ::recv(p[i].fd, buf, sizeof buf, 0);
        if (n <= 0) return;
        const std::string bytes(buf, static_cast<std::size_t>(n));
        if (i == 0) {
          std::lock_guard<std::mutex> lock(mutex_);
          recorded_ += bytes;
        }
        if (!sendAll(i == 0 ? server : client, bytes)) return;
      }
    }
  }

  int target_;
  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  mutable std::mutex mutex_;
  std::string recorded_;
};

// A c10d client doing SET / GET / ADD on its own thread until stopped; what fails is kept.
class StoreTraffic {
 public:
  explicit StoreTraffic(const Server& server) : thread_([this, &server] { run(server); }) {}
  ~StoreTraffic() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::int64_t operations() const { return ops_; }
  std::vector<std::string> errors() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_;
  }

 private:
  void run(const Server& server) {
    try {
      auto client = server.c10d();
      while (!stop_) {
        const std::int64_t n = client.add("traffic/count", 1);
        client.set("traffic/last", ctorch::store::toBytes(std::to_string(n)));
        if (ctorch::store::toString(client.get("traffic/last")) != std::to_string(n))
          throw std::runtime_error("GET did not return what SET wrote");
        ops_ = n;
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      errors_.push_back(e.what());
    }
  }

  std::atomic<bool> stop_{false};
  std::atomic<std::int64_t> ops_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> errors_;
  std::thread thread_;
};

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds within = 60s) {
  return ctorch::launcher_test::eventually(pred, within);
}

} // namespace control_plane_test

namespace control_plane_test {

TEST_CASE("control plane: the job's key gets an agent welcomed at once and a worker once its agent registered it") {
  Server server;
  auto agent = server.agent(2);
  CHECK(agent->welcome().type == Type::kWelcome);
  CHECK(agent->welcome().generation == 0);

  agent->send(registerRank(0, 0xa0));
  auto worker0 = server.worker(0, 0xa0);
  CHECK(worker0->welcome().type == Type::kWelcome);
  CHECK(worker0->launch() == agent->launch());

  // Rank 1's process connects before its agent registered it: it waits for its welcome.
  auto pending = std::async(std::launch::async, [&] { return server.worker(1, 0xa1); });
  CHECK(eventually([&] { return server.stats().authenticated == 3; }));
  // A round trip through the server's thread after that: the hello has been handled, welcome or not.
  (void)server.c10d().numKeys();
  CHECK(server.stats().welcomed == 2);  // the agent and rank 0's process; rank 1's waits
  CHECK(pending.wait_for(0s) == std::future_status::timeout);
  agent->send(registerRank(1, 0xa1));
  REQUIRE(pending.wait_for(60s) == std::future_status::ready);
  auto worker1 = pending.get();
  CHECK(worker1->welcome().generation == 0);

  const auto s = server.stats();
  CHECK(s.connections == 3);
  CHECK(s.authenticated == 3);
  CHECK(s.welcomed == 3);
  CHECK(s.refused == 0);
  CHECK(server.store->stats().sideConnections == 3);
}

TEST_CASE("control plane: a wrong key fails both ways") {
  Server server(60s);  // no request deadline within the test: only a client's close ends a session
  // A client with another key cannot verify the server's proof, and gives its connection up.
  CHECK_THROWS_AS(std::make_unique<cc::BlockingClient>("127.0.0.1", server.port(), kWrongKey,
                                                       cc::agentHello(0, 0, 1, 1), 60s),
                  cc::ControlError);
  CHECK(server.stats().connections == 1);
  CHECK(eventually([&] { return server.side->open() == 0; }, 60s));
  // An outsider with another key who ignores the proof: its first frame closes the connection.
  Socket s(server.port());
  REQUIRE(s.fd >= 0);
  auto channel = rawHandshake(s.fd, kWrongKey);
  REQUIRE(channel);
  REQUIRE(sendAll(s.fd, channel->seal(cc::agentHello(0, 0, 1, 1))));
  CHECK(closedWithin(s.fd, 60s));
  CHECK(server.stats().refused == 1);
  CHECK(server.stats().authenticated == 0);
  CHECK(server.log.count("failed authentication") == 1);
  // The job's own agent still gets in.
  CHECK(server.agent(1)->welcome().type == Type::kWelcome);
}

TEST_CASE("control plane: 200 malformed connections are closed, counted, logged once per kind and held nowhere") {
  Server server;
  StoreTraffic traffic(server);  // c10d on the same port all along
  const std::string nonce(cc::kNonceSize, 'n');
  const std::string helloV1 = magic() + std::string(1, static_cast<char>(cc::kVersion)) + nonce;
  for (int i = 0; i < 200; ++i) {
    Socket s(server.port());
    REQUIRE(s.fd >= 0);
    switch (i % 4) {
      case 0:  // another protocol version
        REQUIRE(sendAll(s.fd, magic() + std::string(1, '\x07') + nonce));
        break;
      case 1:  // a frame of 65535 bytes announced
        REQUIRE(sendAll(s.fd, helloV1 + "\xff\xff" + std::string(100, 'x')));
        break;
      case 2:  // garbage where a frame goes
        REQUIRE(sendAll(s.fd, helloV1 + std::string("\x00\x28", 2) + std::string(40 + cc::kMacSize, 'g')));
        break;
      case 3: {  // a well-formed frame under another key
        auto channel = rawHandshake(s.fd, kWrongKey);
        REQUIRE(channel);
        REQUIRE(sendAll(s.fd, channel->seal(cc::workerHello(0, 1, 1))));
        break;
      }
    }
    REQUIRE(closedWithin(s.fd, 60s));
  }
  const auto stats = server.stats();
  CHECK(stats.connections == 200);
  CHECK(stats.refused == 200);
  CHECK(stats.authenticated == 0);
  // Three kinds (version, size, authentication), a line each.
  const auto lines = server.log.all();
  CHECK(lines.size() == 3);
  CHECK(server.log.count("version 7") == 1);
  CHECK(server.log.count("65535") == 1);
  CHECK(server.log.count("failed authentication") == 1);
  // Nothing is kept for them: the plane was told each one closed.
  CHECK(server.side->open() == 0);
  CHECK(server.store->stats().sideConnections == 200);

  // The job's own clients are served as before, c10d included.
  auto agent = server.agent(1);
  agent->send(registerRank(0, 0x77));
  CHECK(server.worker(0, 0x77)->welcome().type == Type::kWelcome);
  CHECK(eventually([&] { return traffic.operations() >= 20; }));
  traffic.stop();
  CHECK(traffic.errors().empty());
  CHECK(server.c10d().add("traffic/count", 0) == traffic.operations());
  // (A reply is counted until the server's send returns: the client may read it a moment before.)
  CHECK(eventually([&] { return server.store->stats().bufferedBytes == 0; }));
}

TEST_CASE("control plane: a recorded session replayed is refused at its first frame, in this launch and the next") {
  Server server;
  auto agent = server.agent(2);
  // Rank 1 first: rank 0's welcome then says both are registered (one connection, in order).
  agent->send(registerRank(1, 0xb0));
  agent->send(registerRank(0, 0xa0));

  // Rank 0's genuine process, through a recording proxy: it waits in the re-form and has the
  // silent rank 1 killed.
  RecordingProxy proxy(server.port());
  auto worker = server.worker(0, 0xa0, proxy.port());
  worker->send(reform(0));
  worker->send(evictSilent(0));
  const auto answer = awaitType(*worker, Type::kEvicting, 60s);
  REQUIRE(answer);
  CHECK(answer->value == 1);
  const auto kill = awaitType(*agent, Type::kKill, 60s);
  REQUIRE(kill);
  CHECK(kill->rank == 1);
  CHECK(kill->incarnation == 0xb0u);
  REQUIRE(server.stats().killsOrdered == 1);

  // Rank 1's next process runs (its welcome says it is registered): a replay that got through
  // would have it killed at once.
  agent->send(registerRank(1, 0xb1));
  auto worker1 = server.worker(1, 0xb1);
  const std::string transcript = proxy.clientBytes();
  REQUIRE(transcript.size() > cc::kClientHelloSize);
  {
    Socket replay(server.port());
    REQUIRE(replay.fd >= 0);
    REQUIRE(sendAll(replay.fd, transcript));
    CHECK(closedWithin(replay.fd, 60s));
  }
  auto s = server.stats();
  CHECK(s.killsOrdered == 1);
  CHECK(s.refused == 1);
  CHECK(s.authenticated == 3);  // the agent and the genuine workers, not the replay
  CHECK(server.log.count("failed authentication") == 1);
  // What the replay asked for was possible: the genuine session, asking again, has rank 1's new
  // process killed.
  worker->send(evictSilent(0));
  const auto again = awaitType(*worker, Type::kEvicting, 60s);
  REQUIRE(again);
  CHECK(again->value == 1);
  CHECK(server.stats().killsOrdered == 2);

  // The next launch: a fresh store and coordinator under the same key, the same job running.
  Server next;
  auto nextAgent = next.agent(2);
  nextAgent->send(registerRank(0, 0xa0));
  nextAgent->send(registerRank(1, 0xb1));
  {
    Socket replay(next.port());
    REQUIRE(replay.fd >= 0);
    REQUIRE(sendAll(replay.fd, transcript));
    CHECK(closedWithin(replay.fd, 60s));
  }
  CHECK(next.stats().refused == 1);
  CHECK(next.stats().authenticated == 1);
  CHECK(next.stats().killsOrdered == 0);
  CHECK(next.side->open() == 1);  // the agent's only
}

TEST_CASE("control plane: an unfinished handshake is dropped at the request deadline and not before, an idle session is not") {
  Server server(300ms);
  auto agent = server.agent(1);
  agent->send(registerRank(0, 0xa0));
  auto worker = server.worker(0, 0xa0);
  {
    auto c10d = server.c10d();
    c10d.set("before", ctorch::store::toBytes("1"));
    REQUIRE(c10d.check({"before"}));  // a round trip: the SET was served
  }
  const auto receivedBefore = server.store->stats().bytesReceived;

  Socket halfMagic(server.port());
  Socket magicOnly(server.port());
  Socket halfHello(server.port());
  Socket noFrame(server.port());
  REQUIRE(halfMagic.fd >= 0);
  REQUIRE(magicOnly.fd >= 0);
  REQUIRE(halfHello.fd >= 0);
  REQUIRE(noFrame.fd >= 0);
  const std::string halfHelloBytes = magic() + std::string(1, static_cast<char>(cc::kVersion)) + "12345678";
  REQUIRE(sendAll(halfMagic.fd, magic().substr(0, 2)));
  REQUIRE(sendAll(magicOnly.fd, magic()));
  REQUIRE(sendAll(halfHello.fd, halfHelloBytes));
  REQUIRE(rawHandshake(noFrame.fd, kKey));  // the key proved, but no hello sent
  // Every byte of theirs read: their deadlines run from here, on the server's clock (the test's).
  const std::size_t partial = 2 + magic().size() + halfHelloBytes.size() + cc::kClientHelloSize;
  REQUIRE(eventually([&] { return server.store->stats().bytesReceived >= receivedBefore + partial; }));
  // 300 ms of it: still connected, every one (the deadline is passed only when exceeded).
  REQUIRE(ctorch::launcher_test::advanceAndSweep(server.clock, *server.store, 300ms));
  CHECK(server.store->stats().timedOutConnections == 0);
  // 100 ms more: the next sweep drops them.
  REQUIRE(ctorch::launcher_test::advanceAndSweep(server.clock, *server.store, 100ms));
  CHECK(server.store->stats().timedOutConnections == 4);
  CHECK(closedWithin(halfMagic.fd, 60s));
  CHECK(closedWithin(magicOnly.fd, 60s));
  CHECK(closedWithin(halfHello.fd, 60s));
  CHECK(closedWithin(noFrame.fd, 60s));
  CHECK(server.side->open() == 2);  // the agent and the worker

  // Both sessions idled past the deadline and are still served: the group re-forms.
  worker->send(reform(0));
  const auto formed = awaitType(*worker, Type::kFormed, 60s);
  REQUIRE(formed);
  CHECK(formed->generation == 1);
  worker->send(groupBuilt(1));
  CHECK(awaitType(*agent, Type::kReformed, 60s));
  auto c10d = server.c10d();
  CHECK(ctorch::store::toString(c10d.get("before")) == "1");
}

TEST_CASE("control plane: unfinished handshakes cannot take every connection from the job's clients") {
  constexpr std::size_t kCap = 16;
  Server server(60s, kCap);  // no deadline within the test: only eviction makes room
  std::vector<std::unique_ptr<Socket>> squatters;
  auto squat = [&](std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      squatters.push_back(std::make_unique<Socket>(server.port()));
      REQUIRE(squatters.back()->fd >= 0);
      REQUIRE(sendAll(squatters.back()->fd, magic()));
    }
  };
  squat(kCap);
  REQUIRE(eventually([&] { return server.store->stats().sideConnections == kCap; }));

  // The job's agent and worker get in, each in place of the oldest unfinished handshake.
  auto agent = server.agent(1);
  agent->send(registerRank(0, 0xa0));
  auto worker = server.worker(0, 0xa0);
  CHECK(server.store->stats().evictedConnections == 2);
  CHECK(closedWithin(squatters[0]->fd, 60s));
  CHECK(closedWithin(squatters[1]->fd, 60s));
  // More of them evict each other, never an established session.
  squat(2 * kCap);
  REQUIRE(eventually([&] { return server.store->stats().evictedConnections == 2 * kCap + 2; }));
  CHECK(server.store->stats().rejectedConnections == 0);
  worker->send(reform(0));
  const auto formed = awaitType(*worker, Type::kFormed, 60s);
  REQUIRE(formed);
  CHECK(formed->generation == 1);
  worker->send(groupBuilt(1));
  CHECK(awaitType(*agent, Type::kReformed, 60s));
  CHECK(ctorch::store::toString([&] {
          auto c10d = server.c10d();
          c10d.set("in", ctorch::store::toBytes("yes"));
          return c10d.get("in");
        }()) == "yes");
}

TEST_CASE("control plane: an outsider's store writes of the old in-place keys change nothing") {
  Server server;
  auto agent = server.agent(2);
  agent->send(registerRank(0, 0xa0));
  agent->send(registerRank(1, 0xa1));
  auto worker0 = server.worker(0, 0xa0);
  auto worker1 = server.worker(1, 0xa1);

  auto outsider = server.c10d();
  constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
  CHECK(outsider.add("ctorch/inplace/generation", kMax) == kMax);
  outsider.set("ctorch/inplace/evict/rank1", ctorch::store::toBytes("1"));
  outsider.set("ctorch/inplace/evict/rank0", ctorch::store::toBytes("1"));
  outsider.set("ctorch/inplace/g0/alive0", ctorch::store::toBytes("0"));
  outsider.add("ctorch/inplace/g0/arrived", 2);
  outsider.set("ctorch/inplace/g0/survivors", ctorch::store::toBytes("0"));
  outsider.set("ctorch/inplace/g1/rank1", ctorch::store::toBytes("1"));
  outsider.set("ctorch/inplace/spare/s0", ctorch::store::toBytes("1 0 1"));
  CHECK(outsider.numKeys() >= 8);  // the store stored them, as a store does

  auto s = server.stats();
  CHECK(s.generation == 0);
  CHECK(s.killsOrdered == 0);
  CHECK(s.refused == 0);
  // The group re-forms at generation 1, not past 2^63-1, and nobody was killed on the way.
  worker0->send(reform(0));
  worker1->send(reform(0));
  const auto formed0 = awaitType(*worker0, Type::kFormed, 60s);
  const auto formed1 = awaitType(*worker1, Type::kFormed, 60s);
  REQUIRE(formed0);
  REQUIRE(formed1);
  CHECK(formed0->generation == 1);
  CHECK(formed0->text == formed1->text);
  worker0->send(groupBuilt(1));
  worker1->send(groupBuilt(1));
  std::vector<Message> toAgent;
  REQUIRE(awaitType(*agent, Type::kReformed, 60s, &toAgent));
  for (const auto& m : toAgent) CHECK(m.type == Type::kRankState);
  CHECK(server.stats().killsOrdered == 0);
  CHECK(server.stats().generation == 1);
}

} // namespace control_plane_test
