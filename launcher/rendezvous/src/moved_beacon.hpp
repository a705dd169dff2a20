// Store failover, issue 58.12: the node that took a lost rendezvous store over tells the job's
// original endpoint where the store lives now (rdzv::c10d::movedValue), so that a node started
// later with that endpoint - at a ctorchrun restarted on the old store host - joins the live store
// instead of forming a second round 0 under the same run id.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace ctorch::launcher {

// A thread that writes one key into whatever store answers at host:port, every `interval`, until
// destroyed. Each write is one bounded request (connect and reply each within `requestBound`),
// so nothing the endpoint does - nobody listening, a dead machine, a store that never answers -
// holds the agent: the thread only tries again at the next interval.
class MovedBeacon {
 public:
  struct Options {
    std::string host;
    int port = 0;
    std::string key, value;
    std::chrono::milliseconds interval{500};
    std::chrono::milliseconds requestBound{1000};
  };
  explicit MovedBeacon(Options options);
  ~MovedBeacon();
  MovedBeacon(const MovedBeacon&) = delete;
  MovedBeacon& operator=(const MovedBeacon&) = delete;

 private:
  void run();

  Options o_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

} // namespace ctorch::launcher
