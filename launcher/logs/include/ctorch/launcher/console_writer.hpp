// Worker output onto ctorchrun's own stdout/stderr without ever blocking the agent: a console
// nobody reads (`| less` paused, a stuck log shipper) must not delay a worker's exit or a signal.
// Writes are non-blocking, on a private file description of the same pipe or terminal (the shared
// one keeps its flags); what the console cannot take yet waits in a bounded buffer, and beyond it
// whole chunks are dropped and counted, with a "[... N bytes dropped: console not read]" line once
// the console moves again. Log files (--tee, --redirects) are written apart and lose nothing.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ctorch::launcher {

class ConsoleWriter {
 public:
  static constexpr std::size_t kDefaultMaxPending = 4u << 20;

  // `fd` stays owned by the caller (ctorchrun's 1 or 2).
  explicit ConsoleWriter(int fd, std::size_t maxPending = kDefaultMaxPending);
  ~ConsoleWriter();
  ConsoleWriter(const ConsoleWriter&) = delete;
  ConsoleWriter& operator=(const ConsoleWriter&) = delete;

  // Queues `text` and writes what the console takes now; never blocks.
  void write(std::string_view text);
  // Writes what the console takes now; never blocks.
  void flush();
  bool pending() const { return !pending_.empty(); }
  // While pending(): wait for this fd to become writable, then flush().
  int pollFd() const { return fd_; }
  // At the end: waits up to `timeout` for the console to take the rest, then drops it (counted).
  void drain(std::chrono::milliseconds timeout);

  std::uint64_t droppedBytes() const { return droppedTotal_; }
  bool isTerminal() const { return terminal_; }

 private:
  bool writeSome();  // false: the console is full (or gone)
  static std::string marker(std::uint64_t bytes);

  int original_ = -1;
  int fd_ = -1;              // what we write to: a private non-blocking description, or original_
  bool ownFd_ = false;
  bool restoreFlags_ = false;
  int savedFlags_ = 0;
  bool socket_ = false;
  bool terminal_ = false;
  bool gone_ = false;        // EPIPE and the like: the console is closed for good
  std::size_t maxPending_;
  std::string pending_;
  std::size_t offset_ = 0;   // bytes of pending_ already written
  std::uint64_t droppedUnreported_ = 0;
  std::uint64_t droppedTotal_ = 0;
};

} // namespace ctorch::launcher
