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
#include <memory>
#include <mutex>
#include <cstring>
#include <thread>

using namespace ctorch::store;
using namespace std::chrono_literals;

namespace {

TcpStoreClientOptions clientOptions(protocol::Generation g, std::chrono::milliseconds timeout = 10s) {
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
  // Reads exactly n bytes within 5 s.
  Bytes recv(std::size_t n) {
    Bytes out(n);
    std::size_t got = 0;
    while (got < n) {
      pollfd p{fd_, POLLIN, 0};
      REQUIRE(::poll(&p, 1, 5000) == 1);
      ssize_t r = ::recv(fd_, out.data() + got, n - got, 0);
      REQUIRE(r > 0);
      got += static_cast<std::size_t>(r);
    }
    return out;
  }
  bool readable(int ms) {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, ms) == 1;
  }
  // True when the server closed the connection.
  bool closedByPeer() {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 5000) != 1) return false;
    char c;
    return ::recv(fd_, &c, 1, MSG_DONTWAIT) == 0;
  }

 private:
  int fd_;
};

Bytes bytesOf(std::initializer_list<std::uint8_t> l) { return Bytes(l); }

protocol::Writer w() { return protocol::Writer(); }

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
  std::thread t([&] {
    waiter.wait({"late"}, 20s);
    done = true;
  });
  std::this_thread::sleep_for(50ms);
  CHECK_FALSE(done.load());  // control: the wait really blocks
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
  CHECK_FALSE(r.readable(50));
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

TEST_CASE("store client: connecting to nothing fails within its timeout") {
  int port = ctorch::test::freePort();
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(port),
                                 clientOptions(protocol::Generation::Validated, 300ms)),
                  StoreConnectionError);
  CHECK(std::chrono::steady_clock::now() - start < 10s);
}

TEST_CASE("store client: waits for a server that starts late") {
  int port = ctorch::test::freePort();
  std::unique_ptr<TcpStoreServer> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(200ms);
    TcpStoreServerOptions o;
    o.port = static_cast<std::uint16_t>(port);
    server = std::make_unique<TcpStoreServer>(o);
  });
  TcpStoreClient c("127.0.0.1", static_cast<std::uint16_t>(port), clientOptions(protocol::Generation::Validated));
  starter.join();
  c.set("x", toBytes("y"));
  CHECK(toString(c.get("x")) == "y");
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
  for (int i = 0; i < 500 && !gone(); ++i) std::this_thread::sleep_for(2ms);
  REQUIRE(gone());
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
  std::this_thread::sleep_for(100ms);
  CHECK(lost == 0);  // the old connection no longer owned it
  CHECK(b->check({"alive/x"}));
  CHECK(b->deleteKey("alive/x"));  // a graceful goodbye
  b.reset();
  std::this_thread::sleep_for(100ms);
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
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(c.add("k", 1), StoreTimeout);
  CHECK(std::chrono::steady_clock::now() - start < 30s);  // not the 60 s wait bound
  CHECK_FALSE(c.usable());
  CHECK_THROWS_AS(c.add("k", 1), StoreConnectionError);
  ::close(fd);
}

TEST_CASE("store client: retryConnect false makes one connection attempt") {
  int port = ctorch::test::freePort();
  TcpStoreClientOptions o = clientOptions(protocol::Generation::Validated, 20s);
  o.retryConnect = false;
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(TcpStoreClient("127.0.0.1", static_cast<std::uint16_t>(port), o), StoreConnectionError);
  CHECK(std::chrono::steady_clock::now() - start < 10s);  // refused at once, not retried for 20 s
}

TEST_CASE("store client: a port nothing listens on is StoreRefused (a gone server), not a timeout") {
  // A port just served and closed: the machine answers with a refusal (store failover counts them).
  int port = 0;
  {
    TcpStoreServer server(TcpStoreServerOptions{});
    port = server.port();
  }
  TcpStoreClientOptions o;
  o.timeout = std::chrono::milliseconds(300);
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
