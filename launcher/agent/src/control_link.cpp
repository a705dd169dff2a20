// The agent's non-blocking link to the coordinator (control_link.hpp).
#include "control_link.hpp"

#include "ctorch/launcher/errors.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

namespace ctorch::launcher {

namespace cc = contract::control;

namespace {
constexpr std::uint64_t kSocketTag = 1;
constexpr std::uint64_t kTimerTag = 2;
// A connection that is not welcomed within this is given up and tried again.
constexpr std::chrono::milliseconds kHandshakeTimeout{5000};
constexpr std::chrono::milliseconds kFirstRetry{100};
constexpr std::chrono::milliseconds kMaxRetry{2000};
// Unsent frames: far more than the agent ever queues (a few registrations); past it the link is
// reset and what matters is said again once welcomed.
constexpr std::size_t kMaxOutput = 256 * 1024;
constexpr std::size_t kMaxInput = 8192;
} // namespace

ControlLink::ControlLink(Callbacks callbacks) : callbacks_(std::move(callbacks)) {
  epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_ < 0) throwErrno("epoll_create1");
  timer_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (timer_ < 0) throwErrno("timerfd_create");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kTimerTag;
  if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, timer_, &ev) != 0) throwErrno("epoll_ctl");
}

ControlLink::~ControlLink() {
  close();
  ::close(timer_);
  ::close(epoll_);
}

void ControlLink::open(const std::string& host, int port, std::string key, Message hello) {
  close();
  key_ = std::move(key);
  hello_ = std::move(hello);
  where_ = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    stage_ = Stage::kWaiting;
    backoff_ = kMaxRetry;
    arm(backoff_);
    return;
  }
  std::memcpy(&address_, res->ai_addr, res->ai_addrlen);
  addressLength_ = res->ai_addrlen;
  ::freeaddrinfo(res);
  backoff_ = std::chrono::milliseconds(0);
  connectNow();
}

void ControlLink::close() {
  if (socket_ >= 0) {
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, socket_, nullptr);
    ::close(socket_);
    socket_ = -1;
  }
  arm(std::chrono::milliseconds(0));
  stage_ = Stage::kClosed;
  in_.clear();
  out_.clear();
}

void ControlLink::arm(std::chrono::milliseconds after) {
  itimerspec spec{};
  spec.it_value.tv_sec = after.count() / 1000;
  spec.it_value.tv_nsec = (after.count() % 1000) * 1000000;
  ::timerfd_settime(timer_, 0, &spec, nullptr);
}

void ControlLink::watch(bool writable) {
  if (socket_ < 0) return;
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | (writable ? EPOLLOUT : 0u);
  ev.data.u64 = kSocketTag;
  ::epoll_ctl(epoll_, EPOLL_CTL_MOD, socket_, &ev);
}

void ControlLink::connectNow() {
  socket_ = ::socket(address_.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (socket_ < 0) return fail(std::string("socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(socket_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
  ev.data.u64 = kSocketTag;
  if (::epoll_ctl(epoll_, EPOLL_CTL_ADD, socket_, &ev) != 0) return fail(std::string("epoll_ctl: ") + std::strerror(errno));
  if (::connect(socket_, reinterpret_cast<const sockaddr*>(&address_), addressLength_) != 0 && errno != EINPROGRESS)
    return fail(std::string("connect: ") + std::strerror(errno));
  stage_ = Stage::kConnecting;
  arm(kHandshakeTimeout);
}

void ControlLink::fail(const std::string& why) {
  const bool wasReady = stage_ == Stage::kReady;
  if (socket_ >= 0) {
    ::epoll_ctl(epoll_, EPOLL_CTL_DEL, socket_, nullptr);
    ::close(socket_);
    socket_ = -1;
  }
  in_.clear();
  out_.clear();
  stage_ = Stage::kWaiting;
  backoff_ = std::clamp(backoff_ * 2, kFirstRetry, kMaxRetry);
  arm(backoff_);
  if (callbacks_.lost) callbacks_.lost((wasReady ? "lost: " : "cannot reach it at " + where_ + ": ") + why);
}

bool ControlLink::send(const Message& m) {
  if (stage_ != Stage::kReady) return false;
  out_ += channel_.seal(m);
  if (out_.size() > kMaxOutput) {
    fail("the coordinator does not read what it is sent");
    return false;
  }
  flush();
  return true;
}

void ControlLink::flush() {
  while (!out_.empty() && socket_ >= 0) {
    const ssize_t n = ::send(socket_, out_.data(), out_.size(), MSG_NOSIGNAL);
    if (n > 0) {
      out_.erase(0, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    return fail(std::string("send: ") + std::strerror(errno));
  }
  watch(!out_.empty());
}

void ControlLink::onReady() {
  epoll_event events[4];
  const int n = ::epoll_wait(epoll_, events, 4, 0);
  for (int i = 0; i < n; ++i) {
    if (events[i].data.u64 == kTimerTag) {
      std::uint64_t expirations = 0;
      [[maybe_unused]] auto r = ::read(timer_, &expirations, sizeof expirations);
      if (stage_ == Stage::kWaiting) connectNow();
      else if (stage_ != Stage::kReady && stage_ != Stage::kClosed) fail("no welcome within " + std::to_string(kHandshakeTimeout.count()) + " ms");
      continue;
    }
    if (socket_ < 0) continue;
    const std::uint32_t ev = events[i].events;
    if (stage_ == Stage::kConnecting && (ev & (EPOLLOUT | EPOLLERR | EPOLLHUP))) {
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(socket_, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        fail(std::strerror(err));
        continue;
      }
      nonce_ = cc::randomNonce();
      out_ = cc::clientHello(nonce_);
      stage_ = Stage::kServerHello;
    }
    if (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) readSome();
    if (socket_ >= 0) flush();
  }
}

void ControlLink::readSome() {
  char buffer[2048];
  for (;;) {
    const ssize_t n = ::recv(socket_, buffer, sizeof buffer, 0);
    if (n > 0) {
      in_.append(buffer, static_cast<std::size_t>(n));
      if (in_.size() > kMaxInput) return fail("the coordinator sent more than a frame can hold");
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    handleFrames();
    if (socket_ >= 0) fail(n == 0 ? "the coordinator closed the connection" : std::string("recv: ") + std::strerror(errno));
    return;
  }
  handleFrames();
}

void ControlLink::handleFrames() {
  try {
    if (stage_ == Stage::kServerHello) {
      if (in_.size() < cc::kServerHelloSize) return;
      const auto server = cc::verifyServerHello(key_, nonce_, in_.substr(0, cc::kServerHelloSize));
      if (!server) return fail("the workers' store at " + where_ + " did not prove this job's key");
      in_.erase(0, cc::kServerHelloSize);
      channel_ = cc::Channel(key_, nonce_, server->serverNonce, true);
      out_ += channel_.seal(hello_);
      stage_ = Stage::kWelcome;
    }
    while (socket_ >= 0 && stage_ != Stage::kServerHello) {
      auto m = channel_.open(in_);
      if (!m) return;
      if (stage_ == Stage::kWelcome) {
        if (m->type != cc::Type::kWelcome) return fail("refused: " + m->text);
        stage_ = Stage::kReady;
        backoff_ = std::chrono::milliseconds(0);
        arm(std::chrono::milliseconds(0));
        if (callbacks_.welcomed) callbacks_.welcomed();
        continue;
      }
      if (callbacks_.message) callbacks_.message(*m);
    }
  } catch (const cc::ProtocolError& e) {
    fail(e.what());
  }
}

} // namespace ctorch::launcher
