// The native TCPStore server over real sockets: our client in both protocol generations, raw
// hand-built 2.x byte sequences (as PyTorch >= 2.2 sends them), concurrency, and bind errors.
#include "ctorch_catch.hpp"
#include "launcher_test_util.hpp"

#include "ctorch/store/tcp_store_client.hpp"
#include "ctorch/store/tcp_store_server.hpp"
#include "multiproc.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <regex>
#include <thread>

using namespace ctorch::store;
using namespace std::chrono_literals;

namespace {

// The timeout bounds connecting, waits and replies: generous, it only keeps a broken test from hanging.
TcpStoreClientOptions clientOptions(protocol::Generation g, std::chrono::milliseconds timeout = 60s) {
  TcpStoreClientOptions o;
  o.generation = g;
  o.timeout = timeout;
  return o;
}

// A raw TCP connection for sending hand-built bytes.
class RawConn {
 public:
  explicit RawConn(int port) {
    fd_ = ctorch::launcher_test::connectLoopback(port);
    REQUIRE(fd_ >= 0);
  }
  ~RawConn() { ::close(fd_); }
  void send(const Bytes& b) { REQUIRE(::send(fd_, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size())); }
  // Reads exactly n bytes (60 s at most: a hang guard).
  Bytes recv(std::size_t n) {
    Bytes out(n);
    std::size_t got = 0;
    while (got < n) {
      pollfd p{fd_, POLLIN, 0};
      REQUIRE(::poll(&p, 1, 60000) == 1);
      ssize_t r = ::recv(fd_, out.data() + got, n - got, 0);
      REQUIRE(r > 0);
      got += static_cast<std::size_t>(r);
    }
    return out;
  }
  // True when the server closed the connection (within 60 s: a hang guard).
  bool closedByPeer() {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 60000) != 1) return false;
    char c;
    return ::recv(fd_, &c, 1, MSG_DONTWAIT) == 0;
  }

 private:
  int fd_;
};

Bytes bytesOf(std::initializer_list<std::uint8_t> l) { return Bytes(l); }

protocol::Writer w() { return protocol::Writer(); }

using ctorch::launcher_test::eventually;

// The connection attempts a StoreConnectionError's message counts ("(3 connection attempts)"); -1 if none.
int connectionAttempts(const std::string& what) {
  std::smatch m;
  if (!std::regex_search(what, m, std::regex(R"(\((\d+) connection attempts?\))"))) return -1;
  return std::stoi(m[1]);
}

} // namespace

TEST_CASE("store server: our client / validated protocol: every operation") {
  TcpStoreServer server({});
  TcpStoreClient c("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  c.set("a", toBytes("1"));
  CHECK(toString(c.get("a")) == "1");
  CHECK(c.add("n", 3) == 3);
  CHECK(c.add("n", 4) == 7);
  CHECK(toString(c.compareSet("a", toBytes("1"), toBytes("2"))) == "2");
  CHECK(toString(c.compareSet("a", toBytes("1"), toBytes("3"))) == "2");
  CHECK(c.check({"a", "n"}));
  CHECK_FALSE(c.check({"a", "missing"}));
  CHECK(c.numKeys() == 2);
  c.append("a", toBytes("x"));
  CHECK(toString(c.get("a")) == "2x");
  c.multiSet({"m1", "m2"}, {toBytes("v1"), toBytes("v2")});
  auto mg = c.multiGet({"m1", "m2"});
  CHECK(toString(mg.at(0)) == "v1");
  CHECK(toString(mg.at(1)) == "v2");
  CHECK(c.deleteKey("m1"));
  CHECK_FALSE(c.deleteKey("m1"));
  c.ping();
  c.queuePush("q", toBytes("first"));
  c.queuePush("q", toBytes("second"));
  CHECK(c.queueLen("q") == 2);
  CHECK(toString(*c.queuePop("q", false)) == "first");
  CHECK(toString(*c.queuePop("q", true)) == "second");
  CHECK_FALSE(c.queuePop("q", false));
  auto stats = server.stats();
  CHECK(stats.validatedConnections == 1);
  CHECK(stats.legacyConnections == 0);
}

TEST_CASE("store server: our client / legacy (1.13) protocol") {
  TcpStoreServer server({});
  TcpStoreClient c("127.0.0.1", server.port(), clientOptions(protocol::Generation::Legacy));
  c.set("k", toBytes("v"));
  CHECK(toString(c.get("k")) == "v");
  CHECK(c.add("n", 2) == 2);
  CHECK(toString(c.compareSet("k", toBytes("v"), toBytes("w"))) == "w");
  CHECK(c.numKeys() == 2);
  CHECK(c.deleteKey("k"));
  CHECK_THROWS_AS(c.ping(), StoreError);  // no PING in 1.13
  CHECK(server.stats().legacyConnections == 1);
}

TEST_CASE("store server: both generations at once see the same keys") {
  TcpStoreServer server({});
  TcpStoreClient v2("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  TcpStoreClient v1("127.0.0.1", server.port(), clientOptions(protocol::Generation::Legacy));
  v2.set("shared", toBytes("from 2.x"));
  CHECK(toString(v1.get("shared")) == "from 2.x");
  v1.add("count", 5);
  CHECK(v2.add("count", 1) == 6);
  auto s = server.stats();
  CHECK(s.legacyConnections == 1);
  CHECK(s.validatedConnections == 1);
}

TEST_CASE("store server: a blocked wait is released by another client's set") {
  TcpStoreServer server({});
  TcpStoreClient waiter("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  TcpStoreClient setter("127.0.0.1", server.port(), clientOptions(protocol::Generation::Legacy));
  std::atomic<bool> done{false};
  const auto servedBefore = server.stats().requests;
  std::thread t([&] {
    waiter.wait({"late"}, 60s);
    done = true;
  });
  // Control: the server has taken the WAIT in, and it blocks.
  REQUIRE(eventually([&] { return server.stats().requests > servedBefore; }, 60s));
  CHECK_FALSE(done.load());
  setter.set("late", toBytes("x"));
  t.join();
  CHECK(done.load());
}

TEST_CASE("store server: a 2.x wait that times out is cancelled and the connection stays usable") {
  TcpStoreServer server({});
  TcpStoreClient c("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  CHECK_THROWS_AS(c.wait({"never"}, 100ms), StoreTimeout);
  c.set("after", toBytes("ok"));
  CHECK(toString(c.get("after")) == "ok");
}

TEST_CASE("store server: raw 2.x byte sequences (VALIDATE / PING / SET / GET / WAIT / CANCEL_WAIT / QUEUE)") {
  TcpStoreServer server({});
  RawConn r(server.port());
  r.send(bytesOf({0x00, 0xCE, 0xF7, 0x85, 0x3C}));                      // VALIDATE + magic
  r.send(bytesOf({13, 0x2A, 0x00, 0x00, 0x00}));                        // PING nonce 42
  CHECK(r.recv(4) == bytesOf({0x2A, 0, 0, 0}));
  r.send(w().u8(1).str("/key").str("value").take());                    // SET
  r.send(w().u8(3).str("/key").take());                                 // GET
  CHECK(r.recv(8 + 5) == w().u64(5).raw("value", 5).take());
  r.send(w().u8(6).u64(1).str("/absent").take());                       // WAIT (blocks)
  r.send(bytesOf({13, 0x2B, 0x00, 0x00, 0x00}));                        // PING nonce 43, behind the WAIT
  CHECK(r.recv(4) == bytesOf({0x2B, 0, 0, 0}));                         // its echo first: the WAIT said nothing
  r.send(bytesOf({12}));                                                // CANCEL_WAIT
  CHECK(r.recv(1) == bytesOf({1}));                                     // WAIT_CANCELED
  r.send(w().u8(14).str("/q").str("item").take());                      // QUEUE_PUSH
  r.send(w().u8(16).str("/q").take());                                  // QUEUE_LEN
  CHECK(r.recv(8) == w().i64(1).take());
  r.send(w().u8(15).str("/q").take());                                  // QUEUE_POP
  CHECK(r.recv(8 + 8 + 4) == w().i64(1).u64(4).raw("item", 4).take());
  r.send(w().u8(7).take());                                             // GETNUMKEYS
  CHECK(r.recv(8) == w().i64(1).take());
}

TEST_CASE("store server: requests split into single bytes are still understood") {
  TcpStoreServer server({});
  RawConn r(server.port());
  Bytes all = bytesOf({0x00, 0xCE, 0xF7, 0x85, 0x3C});
  auto add = w().u8(4).str("/n").i64(9).take();
  all.insert(all.end(), add.begin(), add.end());
  for (auto b : all) {
    r.send(Bytes{b});
    std::this_thread::sleep_for(1ms);
  }
  CHECK(r.recv(8) == w().i64(9).take());
}

TEST_CASE("store server: garbage closes that connection only") {
  TcpStoreServer server({});
  TcpStoreClient good("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  RawConn bad(server.port());
  bad.send(bytesOf({0x00, 0xCE, 0xF7, 0x85, 0x3C, 200}));  // validated, then an unknown query
  CHECK(bad.closedByPeer());
  good.set("still", toBytes("fine"));
  CHECK(toString(good.get("still")) == "fine");
  CHECK(server.stats().protocolErrors == 1);
}

TEST_CASE("store server: many concurrent clients counting") {
  TcpStoreServer server({});
  constexpr int kClients = 16, kAdds = 200;
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      TcpStoreClient c("127.0.0.1", server.port(),
                       clientOptions(i % 2 ? protocol::Generation::Legacy : protocol::Generation::Validated));
      for (int k = 0; k < kAdds; ++k) c.add("total", 1);
    });
  }
  for (auto& t : threads) t.join();
  TcpStoreClient c("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  CHECK(c.add("total", 0) == kClients * kAdds);
}

TEST_CASE("store server: a port in use is a StoreBindError naming the port") {
  TcpStoreServer first({});
  TcpStoreServerOptions o;
  o.port = first.port();
  try {
    TcpStoreServer second(o);
    FAIL("binding the same port twice succeeded");
  } catch (const StoreBindError& e) {
    CHECK(e.error() == EADDRINUSE);
    CHECK(std::string(e.what()).find(std::to_string(first.port())) != std::string::npos);
  }
}

TEST_CASE("store client: connecting to nothing gives up at its timeout, pausing longer after each refusal") {
  ctorch::test::ReservedPort nothing;
  try {
    TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(nothing.port()),
                   clientOptions(protocol::Generation::Validated, 300ms));
    FAIL("connected to a port nothing listens on");
  } catch (const StoreConnectionError& e) {
    INFO(e.what());
    CHECK_THAT(std::string(e.what()), Catch::Contains("within 300 ms"));
    // Pauses of 5, 10, 20, 40, 80 ms, and the next (160) would end past 300 ms: six attempts at
    // most however fast the machine (a slow one makes fewer); a client retrying without pausing
    // makes thousands. One that never gives up is stopped by CTest's timeout.
    const int attempts = connectionAttempts(e.what());
    CHECK(attempts >= 1);
    CHECK(attempts <= 6);
  }
}

TEST_CASE("store client: waits for a server that starts late") {
  // The server starts on the client's port once the client was refused and retries (its debug
  // line says so): the retry connects it, whatever the timing. The port is a fixed one (the client
  // must know it before the server exists); a fresh one is drawn when it turns out to be taken.
  const bool taken = ctorch::test::withFreshPort([](int port) {
    ctorch::launcher_test::LogLines clientLog;
    TcpStoreClientOptions o = clientOptions(protocol::Generation::Validated, 60s);
    o.debugLog = clientLog.sink();
    auto connecting = std::async(std::launch::async, [port, o] {
      return std::make_unique<TcpStoreClient>("127.0.0.1", static_cast<std::uint16_t>(port), o);
    });
    auto settled = [&] { return connecting.wait_for(0s) == std::future_status::ready; };
    REQUIRE(eventually([&] { return clientLog.count("retrying") > 0 || settled(); }, 60s));
    if (clientLog.count("retrying") == 0) {  // someone listens there: not our server
      try {
        connecting.get();
      } catch (const StoreError&) {
      }
      return true;
    }
    TcpStoreServerOptions so;
    so.port = static_cast<std::uint16_t>(port);
    std::unique_ptr<TcpStoreServer> server;
    try {
      server = std::make_unique<TcpStoreServer>(so);
    } catch (const StoreBindError& e) {
      if (e.error() != EADDRINUSE) throw;
      try {
        connecting.get();  // to whoever took the port, or not at all
      } catch (const StoreError&) {
      }
      return true;
    }
    auto c = connecting.get();
    c->set("x", toBytes("y"));
    CHECK(toString(c->get("x")) == "y");
    CHECK(server->stats().connections == 1);
    return false;
  });
  CHECK_FALSE(taken);
}

// ---- ephemeral keys (the rendezvous' alive keys), bounded replies, local address ------------------------
TEST_CASE("store server: an ephemeral key disappears with its connection and is reported") {
  std::mutex m;
  std::vector<std::string> lost;
  TcpStoreServerOptions so;
  so.ephemeralKeyPrefix = "/alive/";
  so.onEphemeralKeyLost = [&](const std::string& key) {
    std::lock_guard<std::mutex> l(m);
    lost.push_back(key);
  };
  TcpStoreServer server(so);
  TcpStoreClient watcher("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
  {
    TcpStoreClient agent("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
    agent.set("alive/job/n1", toBytes("1"));
    agent.set("other", toBytes("x"));  // not under the prefix: stays
    // SET has no reply: a round trip on the same connection orders it before the watcher's check.
    CHECK(agent.check({"alive/job/n1", "other"}));
    CHECK(watcher.check({"alive/job/n1"}));
    CHECK(server.ephemeralKeyCount() == 1);
  }  // the agent's connection closes (as when its process is killed)
  auto gone = [&] {
    std::lock_guard<std::mutex> l(m);
    return !lost.empty();
  };
  REQUIRE(eventually(gone, 60s));
  CHECK(lost == std::vector<std::string>{"/alive/job/n1"});
  CHECK_FALSE(watcher.check({"alive/job/n1"}));
  CHECK(watcher.check({"other"}));
  CHECK(server.ephemeralKeyCount() == 0);
}

TEST_CASE("store server: an ephemeral key belongs to its last writer and a delete forgets it") {
  std::atomic<int> lost{0};
  TcpStoreServerOptions so;
  so.ephemeralKeyPrefix = "/alive/";
  so.onEphemeralKeyLost = [&](const std::string&) { ++lost; };
  TcpStoreServer server(so);
  auto b = std::make_unique<TcpStoreClient>("127.0.0.1", server.port(), clientOptions(protocol::Generation::Legacy));
  {
    TcpStoreClient a("127.0.0.1", server.port(), clientOptions(protocol::Generation::Validated));
    a.set("alive/x", toBytes("1"));
    // SET has no reply and the two connections are served independently: without this round trip on
    // a's connection the server may apply b's SET first and a's last (a then still owns the key).
    CHECK(a.check({"alive/x"}));
    b->set("alive/x", toBytes("2"));  // a reconnected agent takes its key over
    CHECK(b->check({"alive/x"}));
  }
  // The server has closed a's connection (and reported what that lost) before it counts it.
  REQUIRE(eventually([&] { return server.stats().closedConnections == 1; }, 60s));
  CHECK(lost == 0);  // the old connection no longer owned it
  CHECK(b->check({"alive/x"}));
  CHECK(b->deleteKey("alive/x"));  // a graceful goodbye
  b.reset();
  REQUIRE(eventually([&] { return server.stats().closedConnections == 2; }, 60s));
  CHECK(lost == 0);
}

TEST_CASE("store client: a reply that never comes times out at the operation timeout") {
  // A listener that accepts and never answers (the store host is cut off).
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 4) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  TcpStoreClientOptions o = clientOptions(protocol::Generation::Legacy, 60s);
  o.operationTimeout = 200ms;
  TcpStoreClient c("127.0.0.1", ntohs(a.sin_port), o);
  CHECK(c.localAddress() == "127.0.0.1");
  try {
    c.add("k", 1);
    FAIL("a listener that never answers replied");
  } catch (const StoreTimeout& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("within 200 ms (operationTimeout)"));  // not the 60 s bound
  }
  CHECK_FALSE(c.usable());
  CHECK_THROWS_AS(c.add("k", 1), StoreConnectionError);
  ::close(fd);
}

TEST_CASE("store client: retryConnect false makes one connection attempt") {
  ctorch::test::ReservedPort nothing;
  TcpStoreClientOptions o = clientOptions(protocol::Generation::Validated, 20s);
  o.retryConnect = false;
  try {
    TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(nothing.port()), o);
    FAIL("connected to a port nothing listens on");
  } catch (const StoreConnectionError& e) {
    INFO(e.what());
    CHECK(connectionAttempts(e.what()) == 1);  // refused at once, not retried for 20 s
  }
}

TEST_CASE("store client: a port nothing listens on is StoreRefused (a gone server), not a timeout") {
  // Nothing listens (as on a port whose server is gone): the machine answers with a refusal (store
  // failover counts them).
  ctorch::test::ReservedPort nothing;
  const int port = nothing.port();
  TcpStoreClientOptions o;
  o.timeout = 60s;  // a refusal is not waited out: it comes at once
  o.retryConnect = false;
  CHECK_THROWS_AS(TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(port), o), StoreRefused);
  // Control: with a server there the same client connects.
  TcpStoreServer server(TcpStoreServerOptions{});
  CHECK_NOTHROW(TcpStoreClient("127.0.0.1", server.port(), o));
  // A name that does not resolve is a connection error, not a refusal.
  try {
    TcpStoreClient("no-such-host.invalid", 1, o);
    FAIL("connected to no-such-host.invalid");
  } catch (const StoreRefused&) {
    FAIL("an unresolvable name reported as a refusal");
  } catch (const StoreConnectionError&) {
  }
}
