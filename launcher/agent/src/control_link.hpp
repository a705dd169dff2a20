// The agent's connection to the job's coordinator (control_protocol.hpp), without ever blocking the
// agent's event loop: a non-blocking socket and a retry timer behind one epoll descriptor (fd())
// that the agent watches; the handshake, the frames and the reconnection (with a doubling pause)
// happen in onReady(). What the coordinator says comes out through the callbacks. Private to the
// agent (launcher/agent/src).
#pragma once

#include "ctorch/contract/control_protocol.hpp"

#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <string>

namespace ctorch::launcher {

class ControlLink {
 public:
  using Message = contract::control::Message;
  struct Callbacks {
    std::function<void()> welcomed;                      // ready: say what the coordinator must know
    std::function<void(const Message&)> message;         // a message from the coordinator
    std::function<void(const std::string& why)> lost;    // the connection ended (it is retried)
  };

  explicit ControlLink(Callbacks callbacks);
  ~ControlLink();
  ControlLink(const ControlLink&) = delete;
  ControlLink& operator=(const ControlLink&) = delete;

  // Readable whenever onReady() has something to do.
  int fd() const { return epoll_; }
  // Connects to the coordinator behind the workers' store at host:port (resolved once, here), and
  // keeps reconnecting until close(). `hello` is this agent's first frame.
  void open(const std::string& host, int port, std::string key, Message hello);
  void close();
  bool ready() const { return stage_ == Stage::kReady; }
  // Sends when ready(); false (nothing sent) otherwise: what matters is said again on welcome.
  bool send(const Message& m);
  void onReady();

 private:
  enum class Stage { kClosed, kWaiting, kConnecting, kServerHello, kWelcome, kReady };
  void connectNow();
  void fail(const std::string& why);
  void arm(std::chrono::milliseconds after);
  void watch(bool writable);
  void readSome();
  void flush();
  void handleFrames();

  Callbacks callbacks_;
  int epoll_ = -1;
  int timer_ = -1;
  int socket_ = -1;
  Stage stage_ = Stage::kClosed;
  sockaddr_storage address_{};
  socklen_t addressLength_ = 0;
  std::string where_;
  std::string key_;
  Message hello_;
  contract::control::Nonce nonce_{};
  contract::control::Channel channel_;
  std::string in_;
  std::string out_;
  std::chrono::milliseconds backoff_{0};
};

} // namespace ctorch::launcher
