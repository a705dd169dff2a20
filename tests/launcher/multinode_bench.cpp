// Measurements (hidden test cases, tag [.bench]; run them with bench/multinode_bench.sh): how long
// N real ctorchrun agents take to complete a c10d rendezvous on loopback, and how long the peers
// of a killed or cut-off node take to notice it and to run the next round, on network-namespace
// hosts with ctorchrun's default heartbeat settings. Prints MEASURE lines; asserts nothing about
// time.
#include "ctorch_catch.hpp"

#include "lab.hpp"
#include "launcher_test_util.hpp"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <regex>
#include <sstream>
#include <thread>

using namespace ctorch;
using namespace ctorch::launcher_test;
using namespace std::chrono_literals;
using std::chrono::milliseconds;

namespace {

using SysTime = std::chrono::system_clock::time_point;

// "STAMP <tag> <ns since the epoch>" lines.
std::vector<SysTime> stamps(const std::string& output, const std::string& tag) {
  std::vector<SysTime> out;
  std::regex re("STAMP " + tag + R"( (\d+))");
  for (std::sregex_iterator it(output.begin(), output.end(), re), end; it != end; ++it)
    out.push_back(SysTime(std::chrono::duration_cast<SysTime::duration>(std::chrono::nanoseconds(std::stoll((*it)[1])))));
  return out;
}

// spdlog's "[HH:MM:SS.mmm]" (local time) of the first line containing `text` logged after
// `after`, as a time point on the day of `after`.
std::optional<SysTime> logTime(const std::string& output, const std::string& text, SysTime after) {
  std::time_t t = std::chrono::system_clock::to_time_t(after);
  std::tm day{};
  ::localtime_r(&t, &day);
  day.tm_hour = day.tm_min = day.tm_sec = 0;
  SysTime midnight = std::chrono::system_clock::from_time_t(std::mktime(&day));
  std::istringstream in(output);
  std::string line;
  std::regex stamp(R"(^\[(\d\d):(\d\d):(\d\d)\.(\d\d\d)\])");
  std::smatch m;
  while (std::getline(in, line)) {
    if (line.find(text) == std::string::npos || !std::regex_search(line, m, stamp)) continue;
    auto at = midnight + std::chrono::hours(std::stoi(m[1])) + std::chrono::minutes(std::stoi(m[2])) +
              std::chrono::seconds(std::stoi(m[3])) + milliseconds(std::stoi(m[4]));
    if (at + milliseconds(1) >= after) return at;
  }
  return std::nullopt;
}

double ms(SysTime::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

std::string summary(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  char buf[160];
  std::snprintf(buf, sizeof buf, "median %.0f ms (min %.0f, max %.0f, n=%zu)", v[v.size() / 2], v.front(), v.back(),
                v.size());
  return buf;
}

} // namespace

TEST_CASE("bench: c10d rendezvous of 2 / 8 / 32 ctorchrun agents on loopback", "[.bench]") {
  const int reps = std::getenv("BENCH_REPS") ? std::atoi(std::getenv("BENCH_REPS")) : 5;
  for (int n : {2, 8, 32}) {
    std::vector<double> total, afterLast;
    for (int rep = 0; rep < reps; ++rep) {
      // The rendezvous store is the bench's own (port 0): every agent is a client, as all but one
      // are when an agent hosts it.
      const auto store = test::HostedStore::rendezvous();
      std::vector<std::unique_ptr<test::Process>> agents;
      SysTime t0 = std::chrono::system_clock::now();
      for (int i = 0; i < n; ++i)
        agents.push_back(std::make_unique<test::Process>(ctorchrunSpawn(
            {"--nnodes", std::to_string(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             "127.0.0.1:" + std::to_string(store.port()), "--rdzv-id", "bench" + std::to_string(rep), "--rdzv-conf",
             "is_host=false", fakeWorkerBin(), "stamp", "ready"},
            {}, 120s)));
      SysTime tLast = std::chrono::system_clock::now();
      SysTime done = t0;
      for (auto& a : agents) {
        auto r = a->wait();
        INFO(r.output);
        REQUIRE(r.ok());
        auto s = stamps(r.output, "ready");
        REQUIRE(s.size() == 1);
        done = std::max(done, s[0]);
      }
      total.push_back(ms(done - t0));
      afterLast.push_back(ms(done - tLast));
    }
    std::printf("MEASURE rendezvous agents=%d start-of-first-agent-to-last-worker: %s\n", n, summary(total).c_str());
    std::printf("MEASURE rendezvous agents=%d start-of-last-agent-to-last-worker: %s\n", n, summary(afterLast).c_str());
  }
}

TEST_CASE("bench: peers notice a killed and a cut-off node (netns hosts and default heartbeats)", "[.bench]") {
  CTORCH_REQUIRE_NETNS();
  const int reps = std::getenv("BENCH_REPS") ? std::atoi(std::getenv("BENCH_REPS")) : 5;
  for (const std::string how : {"killed", "cut off"}) {
    std::vector<double> notice, newRound, selfGiveUp;
    for (int rep = 0; rep < reps; ++rep) {
      test::lab::NetnsLab lab(3);
      std::vector<std::string> worker = {"if-world", "3", "stamp", "w3", "if-world", "2", "stamp", "w2",
                                         "if-world", "2", "exit", "0", "trap-term", "0", "hang"};
      std::vector<std::unique_ptr<test::Process>> agents;
      for (int h = 1; h <= 3; ++h) {
        std::vector<std::string> args = {"--log-level", "info", "--nnodes", "2:3", "--node-rank", std::to_string(h - 1),
                                         "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:29400", "--rdzv-id", "b",
                                         fakeWorkerBin()};
        args.insert(args.end(), worker.begin(), worker.end());
        agents.push_back(std::make_unique<test::Process>(lab.spawnIn(h, ctorchrunSpawn(args, {}, 120s))));
      }
      for (auto& a : agents) REQUIRE(eventually([&] { return a->outputSoFar().find("STAMP w3") != std::string::npos; }, 60s));
      // A random phase against the heartbeat period.
      std::this_thread::sleep_for(milliseconds(1000 + 137 * rep));
      SysTime t = std::chrono::system_clock::now();
      if (how == "killed")
        lab.killHost(3);
      else
        lab.cut(3);
      for (int h = 0; h < 2; ++h) {
        auto r = agents[static_cast<std::size_t>(h)]->wait();
        INFO(r.output);
        REQUIRE(r.ok());
        auto seen = logTime(r.output, "[agent] [warning] rendezvous:", t);
        REQUIRE(seen);
        notice.push_back(ms(*seen - t));
        auto w2 = stamps(r.output, "w2");
        REQUIRE(w2.size() == 1);
        newRound.push_back(ms(w2[0] - t));
      }
      if (how == "cut off") {
        auto r = agents[2]->wait();
        INFO(r.output);
        CHECK(r.exitCode == 3);
        auto gaveUp = logTime(r.output, "[agent] [error] rendezvous failed", t);
        REQUIRE(gaveUp);
        selfGiveUp.push_back(ms(*gaveUp - t));
      }
    }
    std::printf("MEASURE %s node: survivors notice after %s\n", how.c_str(), summary(notice).c_str());
    std::printf("MEASURE %s node: survivors' next round runs after %s\n", how.c_str(), summary(newRound).c_str());
    if (!selfGiveUp.empty())
      std::printf("MEASURE %s node: the cut-off agent gives up after %s\n", how.c_str(), summary(selfGiveUp).c_str());
  }
}
