// The store server's flow control (TcpStoreServer::Impl, tcp_store_server_impl.hpp): its own time not
// charged to clients, backpressure past maxBufferedBytes, the request deadline and the reply window - what
// keeps one client from holding the others back.
#include "tcp_store_server_impl.hpp"

namespace ctorch::store {

using Clock = std::chrono::steady_clock;

void TcpStoreServer::Impl::startReplyClock(Connection& c, Clock::time_point now) {
  c.replyStart = now;
  c.busyAtReplyStart = busyTime_;
  c.replyTaken = 0;
  const double perWindow = static_cast<double>(options_.minReplyRate) *
                           std::chrono::duration<double>(options_.replyTimeout).count();
  c.replyQuota = std::max<std::size_t>(1, std::min(c.out.size(), static_cast<std::size_t>(perWindow)));
}

void TcpStoreServer::Impl::creditBusyPass(Clock::time_point now) {
  if (wokeAt_ == Clock::time_point{}) return;
  const auto busy = (now - wokeAt_) - (suspendedTime(now) - suspendedAtWake_);
  if (busy > kAttentivePass) busyTime_ += busy - std::chrono::duration_cast<Clock::duration>(kAttentivePass);
  wokeAt_ = {};
}

void TcpStoreServer::Impl::suspendReading() {
  if (suspended_) return;
  suspended_ = true;
  suspendedSince_ = clockNow();
  for (auto& entry : conns_)
    if (!entry.second.out.empty()) startReplyClock(entry.second, suspendedSince_);
  debug("store: reading suspended: the server holds " + std::to_string(buffered_) + " bytes (" +
        std::to_string(bufferedOut_) + " of replies not taken yet), more than maxBufferedBytes (" +
        std::to_string(options_.maxBufferedBytes) + ")");
  std::lock_guard<std::mutex> lock(statsMutex_);
  ++stats_.readSuspensions;
}

void TcpStoreServer::Impl::holdBack(std::uint64_t id, Connection& c) {
  if (c.waiting) return;
  c.waiting = true;
  waiting_.push_back(id);
  updateInterest(c, id);
}

void TcpStoreServer::Impl::maybeResumeReading() {
  if (!suspended_ || bufferedOut_ > options_.maxBufferedBytes / 2 || buffered_ > options_.maxBufferedBytes) return;
  const auto now = clockNow();
  suspendedTotal_ += now - suspendedSince_;
  suspended_ = false;
  std::vector<std::uint64_t> waiting;
  waiting.swap(waiting_);
  for (std::uint64_t id : waiting) {
    auto it = conns_.find(id);
    if (it == conns_.end() || !it->second.waiting) continue;
    it->second.waiting = false;
    updateInterest(it->second, id);
    if (!it->second.in.empty()) resumed_.push_back(id);
  }
}

void TcpStoreServer::Impl::dropLargestRequests() {
  while (bufferedIn_ > options_.maxBufferedBytes) {
    auto largest = std::max_element(conns_.begin(), conns_.end(),
                                    [](const auto& a, const auto& b) { return a.second.heldIn < b.second.heldIn; });
    if (largest == conns_.end() || largest->second.heldIn == 0) return;
    drop(largest->first, "store: dropping a client holding " + std::to_string(largest->second.heldIn) +
                             " bytes of unfinished requests: the server holds " + std::to_string(bufferedIn_) +
                             " bytes of requests over all connections, more than maxBufferedBytes (" +
                             std::to_string(options_.maxBufferedBytes) + ")");
  }
}

Clock::duration TcpStoreServer::Impl::allowedFor(const Connection& c) const {
  auto allowed = std::chrono::duration_cast<Clock::duration>(options_.requestTimeout);
  if (options_.minRequestRate > 0)
    allowed += std::chrono::milliseconds(pendingInput(c) * 1000 / options_.minRequestRate);
  return allowed;
}

void TcpStoreServer::Impl::dropSlowRequests() {
  auto now = clockNow();
  std::vector<std::uint64_t> late;
  for (const auto& [id, c] : conns_)
    if (requestLate(c, now)) late.push_back(id);
  if (late.empty()) return;
  std::vector<std::uint64_t> slow;
  for (std::uint64_t id : late) {
    if (suspended_) break;  // reading stopped meanwhile: clocks stopped too, judged after it resumes
    if (!conns_.count(id)) continue;
    bool drained = false;
    if (!readFrom(id, kDrainBudget, &drained)) continue;
    auto it = conns_.find(id);
    if (it == conns_.end() || !drained) continue;  // not drained: bytes still pouring in
    if (requestLate(it->second, clockNow())) slow.push_back(id);
  }
  if (slow.empty()) return;
  debug("store: dropping " + std::to_string(slow.size()) + " client(s) whose request took longer than requestTimeout (" +
        std::to_string(options_.requestTimeout.count()) + " ms) plus 1 s per minRequestRate (" +
        std::to_string(options_.minRequestRate) + ") bytes received");
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    stats_.timedOutConnections += slow.size();
    stats_.droppedConnections += slow.size();
  }
  for (std::uint64_t id : slow) close(id);
}

bool TcpStoreServer::Impl::replyWindowOver(const Connection& c, Clock::time_point now, bool& late) const {
  late = false;
  if (c.out.empty()) return false;
  if ((now - c.replyStart) - (busyTime_ - c.busyAtReplyStart) < options_.replyTimeout) return false;
  late = c.replyTaken < c.replyQuota;
  return true;
}

void TcpStoreServer::Impl::dropSlowReaders() {
  const auto now = clockNow();
  std::vector<std::uint64_t> late;
  for (auto& [id, c] : conns_) {
    bool slow = false;
    if (stalledReader(c, now)) {
      late.push_back(id);
      continue;
    }
    if (!replyWindowOver(c, now, slow)) continue;
    if (slow) late.push_back(id);
    else startReplyClock(c, now);
  }
  for (std::uint64_t id : late) {
    flush(id);
    auto it = conns_.find(id);
    if (it == conns_.end() || it->second.out.empty()) continue;
    const auto then = clockNow();
    const bool stalled = stalledReader(it->second, then);
    bool slow = false;
    if (!stalled && !(replyWindowOver(it->second, then, slow) && slow)) continue;
    {
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.slowReaders;
    }
    drop(id, "store: dropping a client that takes its replies slower than minReplyRate (" +
                 std::to_string(options_.minReplyRate) + " bytes/s) over replyTimeout (" +
                 std::to_string(options_.replyTimeout.count()) + " ms) while reading is suspended (" +
                 std::to_string(it->second.out.size()) + " bytes unsent" +
                 (stalled ? ", none taken for replyTimeout" : "") + "; the server holds " +
                 std::to_string(buffered_) + ", more than maxBufferedBytes (" +
                 std::to_string(options_.maxBufferedBytes) + "))");
  }
}

} // namespace ctorch::store
