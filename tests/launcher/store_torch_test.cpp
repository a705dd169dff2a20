// The native TCPStore server against LibTorch's own C++ client (c10d::TCPStore of the installed
// LibTorch, 1.13 here): every Store operation, 1.13's watchKey callback connection, and Gloo
// process groups that rendezvous through it. Only this test links LibTorch; ctorchrun never does.
#include "ctorch_catch.hpp"

#include "core/compat.hpp"
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include "ctorch/store/tcp_store_server.hpp"

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

using namespace std::chrono_literals;

namespace {

std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string str(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

c10::intrusive_ptr<c10d::TCPStore> client(int port, std::optional<std::size_t> workers = std::nullopt) {
  c10d::TCPStoreOptions o;
  ctorch::compat::setUseLibUV(o, ctorch::compat::useLibUVFromEnvironment());
  o.port = static_cast<std::uint16_t>(port);
  o.isServer = false;
  if (workers) o.numWorkers = *workers;
  o.timeout = std::chrono::milliseconds(60000);  // a hang guard: every reply comes at once
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
}

} // namespace

TEST_CASE("store torch: LibTorch's c10d::TCPStore client / every operation against the native server") {
  ctorch::store::TcpStoreServer server({});
  auto s = client(server.port(), 2);  // numWorkers: the client ADDs "init/" first, as 1.13 does
  s->set("a", bytes("1"));
  CHECK(str(s->get("a")) == "1");
  CHECK(s->add("n", 10) == 10);
  CHECK(s->add("n", -3) == 7);
  CHECK(str(s->compareSet("a", bytes("1"), bytes("2"))) == "2");
  CHECK(str(s->compareSet("a", bytes("x"), bytes("3"))) == "2");
  CHECK(str(s->compareSet("new", {}, bytes("v"))) == "v");
  CHECK(s->check({"a", "n"}));
  CHECK_FALSE(s->check({"a", "nope"}));
  s->wait({"a", "n"});
  CHECK(s->getNumKeys() == 4);  // init/, /a, /n, /new
  CHECK(s->deleteKey("new"));
  CHECK_FALSE(s->deleteKey("new"));
  CHECK_THROWS(s->wait({"never"}, 200ms));
#if TORCH_VERSION_MAJOR < 2
  CHECK(server.stats().legacyConnections >= 1);
#else
  CHECK(server.stats().validatedConnections >= 1);
#endif
  CHECK(server.stats().protocolErrors == 0);
}

#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 0)
TEST_CASE("store torch: 1.13 watchKey (the callback connection) gets created/updated/deleted events") {
  ctorch::store::TcpStoreServer server({});
  auto watcher = client(server.port());
  auto writer = client(server.port());
  std::mutex m;
  std::condition_variable cv;
  std::vector<std::string> events;
  watcher->watchKey("w", [&](c10::optional<std::string> oldV, c10::optional<std::string> newV) {
    std::lock_guard<std::mutex> lock(m);
    events.push_back(oldV.value_or("<none>") + "->" + newV.value_or("<none>"));
    cv.notify_all();
  });
  writer->set("w", bytes("1"));
  writer->set("w", bytes("2"));
  writer->deleteKey("w");
  std::unique_lock<std::mutex> lock(m);
  REQUIRE(cv.wait_for(lock, 60s, [&] { return events.size() >= 3; }));
  CHECK(events[0] == "<none>->1");
  CHECK(events[1] == "1->2");
  CHECK(events[2] == "2-><none>");
}
#endif

TEST_CASE("store torch: Gloo process groups rendezvous through the native store and all-reduce") {
  ctorch::store::TcpStoreServer server({});
  const int world = 3;
  std::vector<std::thread> ranks;
  std::vector<float> results(world, 0.f);
  std::atomic<int> failures{0};
  for (int rank = 0; rank < world; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        auto store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_0", client(server.port(), world));
        auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(60000));
        options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
        c10d::ProcessGroupGloo pg(store, rank, world, options);
        std::vector<at::Tensor> t{torch::full({4}, static_cast<float>(rank + 1))};
        pg.allreduce(t)->wait();
        results[static_cast<std::size_t>(rank)] = t[0][0].item<float>();
      } catch (const std::exception& e) {
        UNSCOPED_INFO("rank " << rank << ": " << e.what());
        ++failures;
      }
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(failures == 0);
  for (float r : results) CHECK(r == Approx(6.0f));
  CHECK(server.stats().protocolErrors == 0);
}
