// Who holds a store server's connections, and which one makes room for a new connection at the cap
// (issue 58.2): the policy, pure - names and numbers in, a decision out - apart from the epoll shell
// (tcp_store_server.cpp) that accepts, asks the kernel who a peer is, and closes. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

namespace ctorch::store::detail {

class Admission {
 public:
  // A connection the server holds now, for `peer` (who holds it: a remote address, or for a
  // connection from the server's machine the Unix user owning its socket).
  void opened(std::uint64_t id, const std::string& peer) {
    if (!peerOf_.emplace(id, peer).second) return;
    auto& ids = groups_[peer];
    if (!ids.empty()) bySize_.erase({ids.size(), peer});
    ids.insert(id);
    bySize_.insert({ids.size(), peer});
  }

  void closed(std::uint64_t id) {
    const auto p = peerOf_.find(id);
    if (p == peerOf_.end()) return;
    const std::string peer = p->second;
    peerOf_.erase(p);
    auto g = groups_.find(peer);
    bySize_.erase({g->second.size(), peer});
    g->second.erase(id);
    if (g->second.empty())
      groups_.erase(g);
    else
      bySize_.insert({g->second.size(), peer});
  }

  std::size_t held(const std::string& peer) const {
    const auto g = groups_.find(peer);
    return g == groups_.end() ? 0 : g->second.size();
  }

  struct Room {
    std::uint64_t victim = 0;  // the connection to close for the new one
    bool fairness = false;     // false: an idle one; true: its peer held far more than the new one's
    std::string why;           // for the log
  };
  // There is no room for a new connection of `incoming`: which connection makes room, or nullopt
  // (the new one is closed). First the oldest idle connection (`oldestIdle`: one that has sent no
  // complete request yet, or not finished a handshake - the shell knows which); else the newest
  // connection of the peer holding the most, when that peer holds more than twice what `incoming`
  // would then hold. A job's few connections per host or user get in past an outsider who holds the
  // rest; peers holding about as much as each other are left alone.
  std::optional<Room> makeRoom(const std::string& incoming, std::optional<std::uint64_t> oldestIdle) const {
    if (oldestIdle) return Room{*oldestIdle, false, "the oldest connection that has sent no request yet"};
    const std::size_t mine = held(incoming);
    for (auto it = bySize_.rbegin(); it != bySize_.rend(); ++it) {
      if (it->second == incoming) continue;
      if (it->first <= 2 * (mine + 1)) return std::nullopt;
      return Room{*groups_.at(it->second).rbegin(), true,
                  it->second + " holds " + std::to_string(it->first) + " connections, " + incoming + " " +
                      std::to_string(mine) + ": closing the newest of the former's"};
    }
    return std::nullopt;
  }

 private:
  std::unordered_map<std::uint64_t, std::string> peerOf_;
  std::unordered_map<std::string, std::set<std::uint64_t>> groups_;  // ids ordered: newest last
  std::set<std::pair<std::size_t, std::string>> bySize_;
};

} // namespace ctorch::store::detail
