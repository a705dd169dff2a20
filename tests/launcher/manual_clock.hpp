// A clock a test moves by hand, for a store server's deadlines (TcpStoreServerOptions::clock): a
// request or reply deadline passes when the test says so, never because the machine was slow, and
// a test can show that a deadline had not fired yet without timing anything.
#pragma once

#include "ctorch/store/tcp_store_server.hpp"
#include "launcher_test_util.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace ctorch::launcher_test {

class ManualClock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  // Starts at the steady clock's now: never the epoch, which the server takes for "not started".
  ManualClock() : start_(std::chrono::steady_clock::now()) {}
  ManualClock(const ManualClock&) = delete;
  ManualClock& operator=(const ManualClock&) = delete;

  TimePoint now() const { return start_ + std::chrono::nanoseconds(offset_.load()); }
  // For TcpStoreServerOptions::clock (the clock must outlive the server).
  std::function<TimePoint()> source() const {
    return [this] { return now(); };
  }
  void advance(std::chrono::nanoseconds by) { offset_ += by.count(); }

 private:
  TimePoint start_;
  std::atomic<std::int64_t> offset_{0};
};

// Moves `clock` on by `by` in steps of 100 ms, and after each step waits until `server` has checked
// every connection against its deadline at the new time (its stats' lastSweep). 100 ms is the
// server's sweep interval, so each step brings a sweep; and a pass over events that a step falls
// into takes 100 ms on this clock at most, which the server does not count as its own busy time: the
// deadlines see all of it. Stops early after a step whose sweep dropped a client for its deadline
// (the caller's checks say whether it should have). False if a sweep did not come within 60 s
// (sweeps run only while a request or a handshake is in progress, or reading is suspended).
inline bool advanceAndSweep(ManualClock& clock, const store::TcpStoreServer& server, std::chrono::milliseconds by) {
  constexpr std::chrono::milliseconds kStep{100};
  const auto timedOut = server.stats().timedOutConnections;
  for (auto left = by; left > std::chrono::milliseconds::zero(); left -= kStep) {
    clock.advance(kStep);
    const auto target = clock.now();
    if (!eventually([&] { return server.stats().lastSweep >= target; }, std::chrono::seconds(60))) return false;
    if (server.stats().timedOutConnections != timedOut) return true;
  }
  return true;
}

} // namespace ctorch::launcher_test
