// Small POSIX socket helpers shared by the store server and client (internal).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <system_error>

namespace ctorch::store::detail {

[[noreturn]] void throwErrno(const std::string& what);

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

void setNonBlocking(int fd);
void setNoDelay(int fd);
// Server side: a peer that vanished without closing (its machine cut off or powered down) is
// dropped after about 5 s instead of holding its connection (and ephemeral keys) for hours.
void setDeadPeerDetection(int fd);

// Connects to host:port, trying every resolved address; throws std::system_error.
Fd connectTo(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout);

// Numeric local address of a connected socket ("10.0.0.2", "::1"); IPv4-mapped IPv6 addresses
// are given as IPv4.
std::string localAddressOf(int fd);

// Who is at the other end of an accepted TCP connection, for fairness at a server's connection
// cap (issue 58.2): the peer's numeric address (IPv4-mapped given as IPv4), whether it is on this
// machine (a loopback address), and then the Unix user that owns the peer's socket, asked of the
// kernel through sock_diag (`diagFd`, from openSockDiag(); -1: not asked). Nullopt owner: not on
// this machine, or the kernel could not say (no sock_diag, the peer already gone).
struct PeerOf {
  std::string address;
  bool local = false;
  std::optional<std::uint32_t> owner;
};
PeerOf peerOf(int fd, int diagFd);
// A NETLINK_SOCK_DIAG socket whose answers are waited for at most 100 ms; invalid where the
// kernel offers none.
Fd openSockDiag();

// Blocking full send/receive with a deadline (steady clock). Throw StoreConnectionError on EOF or
// error, StoreTimeout at the deadline.
void sendAll(int fd, const void* data, std::size_t size);
void recvAll(int fd, void* data, std::size_t size, std::chrono::steady_clock::time_point deadline);
// Waits until fd is readable; false at the deadline.
bool waitReadable(int fd, std::chrono::steady_clock::time_point deadline);

} // namespace ctorch::store::detail
