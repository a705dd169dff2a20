// The control plane's sessions: handshake, authenticated frames, the coordinator behind them.
#include "ctorch/control/control_plane.hpp"

namespace ctorch::control {

namespace cc = contract::control;

namespace {
// Unread bytes one connection may hold: a frame is at most ~530 bytes, a handshake 21.
constexpr std::size_t kMaxBuffered = 4096;
} // namespace

ControlPlane::ControlPlane(std::string key, std::function<void(const std::string&)> log)
    : key_(std::move(key)), log_(log), launch_(cc::randomNonce()), coordinator_(std::move(log)) {}

std::string_view ControlPlane::magic() const {
  return std::string_view(reinterpret_cast<const char*>(cc::kMagic.data()), cc::kMagic.size());
}

ControlPlaneStats ControlPlane::stats() const {
  std::lock_guard<std::mutex> lock(statsMutex_);
  return stats_;
}

void ControlPlane::refuseOnce(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.refused;
  }
  if (refusals_.size() < 64 && ++refusals_[why] == 1 && log_)
    log_("refused a control connection: " + why + " (each kind of refusal is logged once)");
}

void ControlPlane::deliver(std::vector<Outgoing>& outgoing, std::vector<Output>& out) {
  std::uint64_t welcomes = 0;
  for (auto& o : outgoing) {
    auto s = sessions_.find(o.peer);
    if (s == sessions_.end() || s->second.stage != Session::Stage::kReady) continue;
    out.push_back({o.peer, s->second.channel.seal(o.message), o.close});
    welcomes += o.message.type == Type::kWelcome;
  }
  outgoing.clear();
  std::lock_guard<std::mutex> lock(statsMutex_);
  stats_.welcomed += welcomes;
  stats_.generation = coordinator_.generation();
  stats_.killsOrdered = coordinator_.killsOrdered();
  stats_.capability = coordinator_.capability();
}

bool ControlPlane::received(std::uint64_t conn, std::string_view bytes, std::vector<Output>& out) {
  auto [it, fresh] = sessions_.try_emplace(conn);
  Session& s = it->second;
  if (fresh) {
    std::lock_guard<std::mutex> lock(statsMutex_);
    ++stats_.connections;
  }
  s.in.append(bytes);
  std::vector<Outgoing> outgoing;
  try {
    if (s.in.size() > kMaxBuffered) throw cc::ProtocolError("over " + std::to_string(kMaxBuffered) + " unread bytes");
    if (s.stage == Session::Stage::kClientHello) {
      if (s.in.size() < cc::kClientHelloSize) return false;
      const cc::Nonce client = cc::parseClientHello(s.in);
      const cc::Nonce server = cc::randomNonce();
      out.push_back({conn, cc::serverHello(key_, client, server, launch_), false});
      s.channel = cc::Channel(key_, client, server, false);
      s.in.erase(0, cc::kClientHelloSize);
      s.stage = Session::Stage::kHello;
    }
    const auto now = Clock::now();
    while (auto m = s.channel.open(s.in)) {
      if (s.stage == Session::Stage::kHello) {
        s.stage = Session::Stage::kReady;
        {
          std::lock_guard<std::mutex> lock(statsMutex_);
          ++stats_.authenticated;
        }
        coordinator_.hello(conn, *m, now, outgoing);
      } else {
        coordinator_.message(conn, *m, now, outgoing);
      }
      deliver(outgoing, out);
    }
    return s.stage == Session::Stage::kReady;
  } catch (const cc::ProtocolError& e) {
    deliver(outgoing, out);
    refuseOnce(e.what());
    throw;
  }
}

void ControlPlane::closed(std::uint64_t conn, std::vector<Output>& out) {
  if (!sessions_.erase(conn)) return;
  std::vector<Outgoing> outgoing;
  coordinator_.closed(conn, outgoing);
  deliver(outgoing, out);
}

} // namespace ctorch::control
