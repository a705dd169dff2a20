#include "ctorch/launcher/console_writer.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace ctorch::launcher {

ConsoleWriter::ConsoleWriter(int fd, std::size_t maxPending)
    : original_(fd), fd_(fd), maxPending_(maxPending) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    gone_ = true;  // nothing to write to (closed stdout): everything is dropped quietly
    return;
  }
  terminal_ = ::isatty(fd) == 1;
  if (S_ISREG(st.st_mode) || S_ISBLK(st.st_mode)) return;  // a file: writes never wait on a reader
  if (S_ISSOCK(st.st_mode)) {
    socket_ = true;  // send(MSG_DONTWAIT) is non-blocking per call
    return;
  }
  // A pipe or a terminal: a new description of the same object, so that O_NONBLOCK does not leak
  // to the shell or whoever else shares ours.
  std::string self = "/proc/self/fd/" + std::to_string(fd);
  int own = ::open(self.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (own >= 0) {
    fd_ = own;
    ownFd_ = true;
    return;
  }
  // No /proc: make the shared one non-blocking while we run, and put it back afterwards.
  savedFlags_ = ::fcntl(fd, F_GETFL);
  if (savedFlags_ >= 0 && ::fcntl(fd, F_SETFL, savedFlags_ | O_NONBLOCK) == 0) restoreFlags_ = true;
}

ConsoleWriter::~ConsoleWriter() {
  flush();
  if (ownFd_) ::close(fd_);
  if (restoreFlags_) ::fcntl(original_, F_SETFL, savedFlags_);
}

std::string ConsoleWriter::marker(std::uint64_t bytes) {
  return "[... " + std::to_string(bytes) + " bytes dropped: console not read]\n";
}

bool ConsoleWriter::writeSome() {
  while (offset_ < pending_.size()) {
    const char* p = pending_.data() + offset_;
    std::size_t left = pending_.size() - offset_;
    ssize_t n = socket_ ? ::send(fd_, p, left, MSG_DONTWAIT | MSG_NOSIGNAL) : ::write(fd_, p, left);
    if (n > 0) {
      offset_ += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    // EPIPE and the like: the console went away; drop the output, keep the workers running.
    gone_ = true;
    pending_.clear();
    offset_ = 0;
    return false;
  }
  pending_.clear();
  offset_ = 0;
  return true;
}

void ConsoleWriter::flush() {
  if (gone_) return;
  if (!pending_.empty() && !writeSome()) return;
  if (droppedUnreported_ > 0) {
    pending_ = marker(droppedUnreported_);
    droppedUnreported_ = 0;
    writeSome();
  }
}

void ConsoleWriter::write(std::string_view text) {
  if (text.empty()) return;
  if (gone_) return;
  flush();
  if (droppedUnreported_ > 0 && pending_.empty()) {
    pending_ = marker(droppedUnreported_);
    droppedUnreported_ = 0;
  }
  if (pending_.size() - offset_ + text.size() > maxPending_) {
    droppedUnreported_ += text.size();
    droppedTotal_ += text.size();
    return;
  }
  // Compact now and then so that the buffer does not grow with what was already written.
  if (offset_ > 0 && offset_ >= pending_.size() / 2) {
    pending_.erase(0, offset_);
    offset_ = 0;
  }
  pending_.append(text);
  writeSome();
}

void ConsoleWriter::drain(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    flush();
    if (gone_ || (pending_.empty() && droppedUnreported_ == 0)) return;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd_, POLLOUT, 0};
    int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno != EINTR) break;
  }
  std::uint64_t rest = pending_.size() - offset_;
  droppedTotal_ += rest;
  droppedUnreported_ = 0;
  pending_.clear();
  offset_ = 0;
}

} // namespace ctorch::launcher
