// The store server reading requests, serving them through the engine (or the side protocol), and sending
// the replies (TcpStoreServer::Impl, tcp_store_server_impl.hpp).
#include "tcp_store_server_impl.hpp"

namespace ctorch::store {

using Clock = std::chrono::steady_clock;

bool TcpStoreServer::Impl::readFrom(std::uint64_t id, std::size_t budget, bool* drained) {
  Connection& c = conns_.at(id);
  std::size_t got = 0;
  while (got < budget) {
    // Into the one scratch buffer, then only what arrived is appended: growing `in` by a chunk
    // per read zero-filled 64 KiB for every byte a dripping client sent (most of the server's
    // time under 900 such clients).
    ssize_t n = ::recv(c.fd.get(), scratch_.data(), scratch_.size(), 0);
    if (n > 0) {
      c.in.insert(c.in.end(), scratch_.data(), scratch_.data() + n);
      got += static_cast<std::size_t>(n);
      if (static_cast<std::size_t>(n) < scratch_.size()) {
        if (drained) *drained = true;
        break;
      }
      continue;
    }
    if (n == 0) {
      serve(id);  // requests that arrived just before the close still count (SET then exit)
      close(id);
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (drained) *drained = true;
      break;
    }
    close(id);
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    stats_.bytesReceived += got;
  }
  return serve(id);
}

bool TcpStoreServer::Impl::serve(std::uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return false;
  Connection& c = it->second;
  if (options_.side && !c.identified) {
    // The side protocol's magic, whole or begun, before any c10d request: its connection.
    const std::string_view magic = options_.side->magic();
    const std::size_t n = std::min(c.in.size(), magic.size());
    if (n > 0 && std::memcmp(c.in.data(), magic.data(), n) == 0) {
      if (n < magic.size()) {  // the rest of the magic is still on its way, under the request deadline
        if (c.requestStart == Clock::time_point{}) startRequestClock(c);
        setHandshaking(c, true);
        return true;
      }
      c.side = c.identified = true;
      std::lock_guard<std::mutex> lock(statsMutex_);
      ++stats_.sideConnections;
    } else {
      setHandshaking(c, false);  // a begun magic that turned out to be a c10d request
    }
  }
  if (c.side) return serveSide(id, c);
  std::size_t offset = 0;
  std::string failure;
  const std::uint64_t examinedBefore = c.parser.bytesExamined();
  std::uint64_t served = 0;
  while (offset < c.in.size()) {
    if (c.out.size() >= options_.maxPendingOutput) {
      c.paused = true;
      break;
    }
    // Past the cap no request is served (its reply would add to what is held) until the
    // replies are taken: checked per request, so one batch goes past by one reply at most.
    if (suspended_ || buffered_ > options_.maxBufferedBytes) {
      suspendReading();
      holdBack(id, c);
      break;
    }
    Generation before = c.parser.generation();
    ParseResult r = c.parser.feed(c.in.data() + offset, c.in.size() - offset);
    offset += r.consumed;
    if (r.status == ParseResult::Status::NeedMore) break;
    if (r.status == ParseResult::Status::Error) {
      failure = r.error;
      break;
    }
    if (before == Generation::Unknown) countGeneration(c.parser.generation());
    c.identified = true;
    std::vector<StoreEngine::Reply> replies;
    try {
      engine_.execute(id, r.request, replies);
    } catch (const std::exception& e) {
      failure = e.what();
      break;
    }
    ++served;
    queue(id, replies);
  }
  c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(offset));
  // A large field, once taken, leaves its capacity behind: give it back, or every connection
  // that ever sent a large value would keep holding that much.
  if (c.in.capacity() > 2 * c.in.size() + kReadBudget) c.in = protocol::Bytes(c.in.begin(), c.in.end());
  if (pendingInput(c) == 0) {
    c.requestStart = {};
  } else if (served > 0 || c.requestStart == Clock::time_point{}) {
    startRequestClock(c);
  }
  account(c);
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    stats_.requests += served;
    stats_.bytesParsed += c.parser.bytesExamined() - examinedBefore;
    stats_.storedBytes = engine_.storedBytes();
  }
  noteStored();
  ephemeral_.store(engine_.ephemeralKeyCount());
  if (!failure.empty()) {
    drop(id, "store: dropping a client: " + failure);
  } else {
    flush(id);
  }
  flushTouched();
  if (bufferedIn_ > options_.maxBufferedBytes) dropLargestRequests();
  return conns_.count(id) > 0;
}

void TcpStoreServer::Impl::noteStored() {
  const std::size_t now = engine_.storedBytes();
  if (now > storedPeak_) storedPeak_ = now;
  const std::size_t freed = storedPeak_ - now;
  if (freed < kGiveBackStep && !(freed >= kGiveBackStep / 8 && now < freed)) return;
  storedPeak_ = now;
  engine_.compact();
  ::malloc_trim(0);
  std::lock_guard<std::mutex> lock(statsMutex_);
  ++stats_.memoryGivenBack;
}

bool TcpStoreServer::Impl::serveSide(std::uint64_t id, Connection& c) {
  std::vector<SideProtocol::Output> out;
  const std::string_view bytes(reinterpret_cast<const char*>(c.in.data()), c.in.size());
  bool established = false;
  try {
    established = options_.side->received(id, bytes, out);
  } catch (const std::exception& e) {
    c.in.clear();
    queueSide(out);
    drop(id, std::string("store: dropping a side-protocol client: ") + e.what());
    return false;
  }
  c.in.clear();
  if (established) c.requestStart = {};
  else if (c.requestStart == Clock::time_point{}) startRequestClock(c);
  setHandshaking(c, !established);
  account(c);
  queueSide(out);
  return conns_.count(id) > 0;
}

void TcpStoreServer::Impl::queueSide(std::vector<SideProtocol::Output>& out) {
  std::vector<std::uint64_t> closing;
  for (auto& o : out) {
    auto it = conns_.find(o.conn);
    if (it == conns_.end() || !it->second.side) continue;
    Connection& c = it->second;
    if (c.out.size() + o.bytes.size() > options_.maxPendingOutput) {
      overflowing_.push_back(o.conn);
      continue;
    }
    const bool first = c.out.empty();
    c.out.insert(c.out.end(), o.bytes.begin(), o.bytes.end());
    if (first) {
      startReplyClock(c, clockNow());
      noteTaken(c, c.replyStart);
    }
    notePending(c.out.size());
    account(c);
    touched_.push_back(o.conn);
    if (o.close) closing.push_back(o.conn);
  }
  flushTouched();
  for (std::uint64_t id : closing) close(id);
}

void TcpStoreServer::Impl::setHandshaking(Connection& c, bool on) {
  if (c.handshaking == on) return;
  c.handshaking = on;
  if (on) ++handshakes_;
  else --handshakes_;
}

void TcpStoreServer::Impl::account(Connection& c) {
  const std::size_t in = pendingInput(c), out = c.out.size();
  bufferedIn_ = bufferedIn_ - c.heldIn + in;
  bufferedOut_ = bufferedOut_ - c.heldOut + out;
  c.heldIn = in;
  c.heldOut = out;
  buffered_ = bufferedIn_ + bufferedOut_;
  std::lock_guard<std::mutex> lock(statsMutex_);
  stats_.bufferedBytes = buffered_;
  stats_.peakBufferedBytes = std::max<std::uint64_t>(stats_.peakBufferedBytes, buffered_);
}

void TcpStoreServer::Impl::queue(std::uint64_t requester, std::vector<StoreEngine::Reply>& replies) {
  for (auto& r : replies) {
    auto it = conns_.find(r.conn);
    if (it == conns_.end()) continue;
    Connection& c = it->second;
    if (r.conn != requester && c.out.size() + r.bytes.size() > options_.maxPendingOutput) {
      overflowing_.push_back(r.conn);
      continue;
    }
    if (c.out.empty()) {
      c.out = std::move(r.bytes);
      startReplyClock(c, clockNow());
      noteTaken(c, c.replyStart);
    } else {
      c.out.insert(c.out.end(), r.bytes.begin(), r.bytes.end());
    }
    account(c);
    notePending(c.out.size());
    if (r.conn != requester) touched_.push_back(r.conn);
  }
}

void TcpStoreServer::Impl::flushTouched() {
  std::vector<std::uint64_t> overflowing;
  overflowing.swap(overflowing_);
  for (std::uint64_t id : overflowing)
    drop(id, "store: dropping a client that does not read its notifications (over " +
                 std::to_string(options_.maxPendingOutput) + " bytes unsent)");
  std::vector<std::uint64_t> touched;
  touched.swap(touched_);
  for (std::uint64_t id : touched) flush(id);
}

void TcpStoreServer::Impl::flush(std::uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Connection& c = it->second;
  std::size_t sent = 0;
  while (sent < c.out.size()) {
    ssize_t n = ::send(c.fd.get(), c.out.data() + sent, c.out.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    close(id);
    return;
  }
  c.out.erase(c.out.begin(), c.out.begin() + static_cast<std::ptrdiff_t>(sent));
  if (sent > 0) {
    c.replyTaken += sent;
    noteTaken(c, clockNow());
    if (c.out.empty()) {
      c.replyStart = {};
      // A large reply, once sent, leaves its capacity behind (as a large request does in `in`).
      if (c.out.capacity() > kReadBudget) protocol::Bytes().swap(c.out);
    }
    account(c);
  }
  if (c.paused && c.out.size() <= options_.maxPendingOutput / 2) {
    // Drained enough: read again, and serve what it sent meanwhile (after this round of events,
    // not from here: serving may fill the output and flush again). Its request clock restarts.
    c.paused = false;
    if (c.requestStart != Clock::time_point{}) startRequestClock(c);
    if (!c.in.empty()) resumed_.push_back(id);
  }
  updateInterest(c, id);
}

void TcpStoreServer::Impl::updateInterest(Connection& c, std::uint64_t id) {
  std::uint32_t want = (c.paused || c.waiting ? 0u : (EPOLLIN | EPOLLRDHUP)) | (c.out.empty() ? 0u : EPOLLOUT);
  if (want == c.events) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = id;
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
  c.events = want;
}

void TcpStoreServer::Impl::countGeneration(Generation g) {
  std::lock_guard<std::mutex> lock(statsMutex_);
  if (g == Generation::Legacy) ++stats_.legacyConnections;
  if (g == Generation::Validated) ++stats_.validatedConnections;
}

} // namespace ctorch::store
