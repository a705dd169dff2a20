// A second protocol on the store's port. A connection whose first bytes are magic() is served by
// this handler instead of the c10d store: ctorchrun's control channel for in-place recovery uses it,
// so that every worker and agent reaches the job's coordinator at the address it already knows
// (MASTER_ADDR:MASTER_PORT). The store's shell still owns the sockets, their limits and their
// output; the handler sees bytes in and says bytes out. Called on the server thread only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::store {

class SideProtocol {
 public:
  struct Output {
    std::uint64_t conn = 0;
    std::string bytes;
    bool close = false;  // close the connection once these bytes are sent (as far as they can be)
  };
  virtual ~SideProtocol() = default;
  // The first bytes that mark a connection as this protocol's (1 to 16 bytes).
  virtual std::string_view magic() const = 0;
  // Bytes that arrived on connection `conn` (the first call starts with magic()). Returns whether
  // the connection is established (its handshake done): until then the store's request deadline
  // applies to it. Throws to have the connection dropped.
  virtual bool received(std::uint64_t conn, std::string_view bytes, std::vector<Output>& out) = 0;
  // Connection `conn` closed (by its peer or by the shell).
  virtual void closed(std::uint64_t conn, std::vector<Output>& out) = 0;
};

} // namespace ctorch::store
