// A blocking client of in-place recovery's control channel (control_protocol.hpp): what a worker, a
// spare and a preloaded worker of ctorch's library use, and what tests use to act as one. Every
// wait has a deadline; a wait can also end early when `interrupted()` says so (a stop signal).
// The agent has its own non-blocking client (it must never block its event loop).
#pragma once

#include "ctorch/contract/control_protocol.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

namespace ctorch::contract::control {

// The coordinator cannot be reached, refused this process, proved no key, or went away.
class ControlError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class BlockingClient {
 public:
  using Clock = std::chrono::steady_clock;

  // Connects to the coordinator behind the workers' store at host:port, proves the key and says who
  // it is (`hello`); returns once welcomed (the welcome is welcome()). Throws ControlError.
  BlockingClient(const std::string& host, int port, std::string key, const Message& hello, std::chrono::milliseconds timeout,
                 std::function<bool()> interrupted = {})
      : key_(std::move(key)), interrupted_(std::move(interrupted)) {
    // A constructor that throws runs no destructor: without this, a process that tries again
    // would keep one socket (and one half-open session on the store) per failed try.
    struct CloseUnlessWelcomed {
      int& fd;
      bool welcomed = false;
      ~CloseUnlessWelcomed() {
        if (!welcomed && fd >= 0) ::close(fd);
      }
    } guard{fd_};
    const auto deadline = Clock::now() + timeout;
    connectTo(host, port, deadline);
    const Nonce mine = randomNonce();
    sendRaw(clientHello(mine), deadline);
    const std::string answer = readRaw(kServerHelloSize, deadline);
    const auto server = verifyServerHello(key_, mine, answer);
    if (!server)
      throw ControlError("the workers' store at " + host + ":" + std::to_string(port) +
                         " did not prove this job's control key (not this job's ctorchrun)");
    launch_ = server->launch;
    channel_ = Channel(key_, mine, server->serverNonce, true);
    send(hello, deadline);
    const auto reply = receive(deadline);
    if (!reply) throw ControlError("no answer from the coordinator within " + std::to_string(timeout.count()) + " ms");
    if (reply->type == Type::kRefused) throw ControlError("the coordinator refused this process: " + reply->text);
    if (reply->type != Type::kWelcome) throw ControlError("the coordinator answered with message type " + std::to_string(static_cast<int>(reply->type)));
    welcome_ = *reply;
    guard.welcomed = true;
  }
  ~BlockingClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  BlockingClient(const BlockingClient&) = delete;
  BlockingClient& operator=(const BlockingClient&) = delete;

  const Message& welcome() const { return welcome_; }
  const Nonce& launch() const { return launch_; }
  int fd() const { return fd_; }

  void send(const Message& m, Clock::time_point deadline) { sendRaw(channel_.seal(m), deadline); }
  void send(const Message& m) { send(m, Clock::now() + std::chrono::seconds(10)); }

  // The next message, or nullopt at the deadline or when interrupted() turned true. Throws
  // ControlError when the coordinator closed the connection or sent something unauthenticated.
  std::optional<Message> receive(Clock::time_point deadline) {
    for (;;) {
      try {
        if (auto m = channel_.open(in_)) return m;
      } catch (const ProtocolError& e) {
        throw ControlError(std::string("control channel: ") + e.what());
      }
      if (!waitFor(POLLIN, deadline)) return std::nullopt;
      char buffer[1024];
      const ssize_t n = ::recv(fd_, buffer, sizeof buffer, 0);
      if (n > 0) {
        in_.append(buffer, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      throw ControlError(n == 0 ? "the coordinator closed the control channel (its ctorchrun ended, or refused this process)"
                                : std::string("control channel: ") + std::strerror(errno));
    }
  }

 private:
  // Waits until the socket is ready for `events`; false at the deadline or when interrupted.
  bool waitFor(short events, Clock::time_point deadline) {
    for (;;) {
      if (interrupted_ && interrupted_()) return false;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, interrupted_ ? 50 : left)));
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) throw ControlError(std::string("control channel: poll: ") + std::strerror(errno));
    }
  }

  void connectTo(const std::string& host, int port, Clock::time_point deadline) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    addrinfo* res = nullptr;
    const std::string where = host + ":" + std::to_string(port);
    if (const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0)
      throw ControlError("cannot resolve the workers' store '" + host + "': " + ::gai_strerror(rc));
    std::unique_ptr<addrinfo, void (*)(addrinfo*)> guard(res, ::freeaddrinfo);
    std::string last = "no address";
    for (addrinfo* a = res; a; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) {
        last = std::strerror(errno);
        continue;
      }
      fd_ = fd;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS) {
        if (waitFor(POLLOUT, deadline)) {
          int err = 0;
          socklen_t len = sizeof err;
          ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
          if (err == 0) {
            int one = 1;
            ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            return;
          }
          last = std::strerror(err);
        } else {
          last = "timed out";
        }
      } else {
        last = std::strerror(errno);
      }
      ::close(fd);
      fd_ = -1;
    }
    throw ControlError("cannot connect to the workers' store at " + where + " for the control channel: " + last);
  }

  void sendRaw(const std::string& bytes, Clock::time_point deadline) {
    std::size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (!waitFor(POLLOUT, deadline)) throw ControlError("control channel: could not send within the deadline");
        continue;
      }
      throw ControlError(std::string("control channel: ") + std::strerror(errno));
    }
  }

  std::string readRaw(std::size_t n, Clock::time_point deadline) {
    std::string out;
    while (out.size() < n) {
      if (!waitFor(POLLIN, deadline)) throw ControlError("control channel: no answer from the workers' store in time");
      char buffer[64];
      const ssize_t r = ::recv(fd_, buffer, std::min(sizeof buffer, n - out.size()), 0);
      if (r > 0) {
        out.append(buffer, static_cast<std::size_t>(r));
        continue;
      }
      if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
      throw ControlError(r == 0 ? "the workers' store closed the control channel during the handshake (no control plane "
                                  "there: a ctorchrun without --recovery in-place, or another job)"
                                : std::string("control channel: ") + std::strerror(errno));
    }
    return out;
  }

  int fd_ = -1;
  std::string key_;
  std::function<bool()> interrupted_;
  Channel channel_;
  std::string in_;
  Nonce launch_{};
  Message welcome_;
};

} // namespace ctorch::contract::control
