// In-place recovery's control channel (docs/reliability.md, "Who can steer a job"): every value an
// agent or a worker acts on in in-place recovery travels here, never through the c10d store. A
// connection to the workers' store port that opens with kMagic is handed to the job's coordinator
// (node rank 0's ctorchrun) instead of the store. Both sides prove they hold the job's control key in
// a challenge-response with a fresh nonce from each side, and every frame after it carries an
// HMAC over its direction and sequence number under a key of that connection alone: a stranger who
// reaches the port can neither read a command into being, nor replay one recorded from another
// connection, launch or generation. Header-only, no dependencies: the launcher's coordinator and
// agent, the library's workers and the tests share it as part of the worker contract.
#pragma once

#include "ctorch/contract/control_auth.hpp"

#include <sys/random.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ctorch::contract::control {

// The first bytes of a control connection: 0xC7 is no c10d query type (1.x sends one first, 2.x
// sends VALIDATE), so the store tells the two protocols apart on the first byte.
inline constexpr std::array<std::uint8_t, 4> kMagic = {0xC7, 'C', 'T', 'L'};
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kNonceSize = 16;
inline constexpr std::size_t kMacSize = 16;
inline constexpr std::size_t kMaxText = 256;     // a message's text field
inline constexpr std::size_t kMaxPayload = 512;  // an encoded message
// Client: magic, version, its nonce. Server: its nonce, the launch id, its proof of the key.
inline constexpr std::size_t kClientHelloSize = kMagic.size() + 1 + kNonceSize;
inline constexpr std::size_t kServerHelloSize = kNonceSize + kNonceSize + kMacSize;

using Nonce = std::array<std::uint8_t, kNonceSize>;

// A malformed, oversized or unauthenticated frame: the connection is closed.
class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Fresh random bytes from the kernel (getrandom; /dev/urandom where it is missing).
inline void randomFill(void* out, std::size_t n) {
  auto* p = static_cast<std::uint8_t*>(out);
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(p + got, n - got, 0);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    std::FILE* f = std::fopen("/dev/urandom", "rb");
    const bool ok = f && std::fread(p + got, 1, n - got, f) == n - got;
    if (f) std::fclose(f);
    if (!ok) throw std::runtime_error("no source of random bytes (getrandom and /dev/urandom failed)");
    return;
  }
}
inline Nonce randomNonce() {
  Nonce n{};
  randomFill(n.data(), n.size());
  return n;
}
// A process's incarnation: the random id its agent gives it (CTORCH_INCARNATION, hex). Never 0.
inline std::uint64_t randomIncarnation() {
  std::uint64_t v = 0;
  while (v == 0) randomFill(&v, sizeof v);
  return v;
}
inline std::string incarnationText(std::uint64_t v) {
  std::array<std::uint8_t, 8> b{};
  for (int i = 0; i < 8; ++i) b[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v >> (56 - 8 * i));
  return auth::toHex(b.data(), b.size());
}
// CTORCH_INCARNATION's reader: exactly 16 hex digits, not all zero.
inline std::optional<std::uint64_t> parseIncarnation(std::string_view hex) {
  if (hex.size() != 16) return std::nullopt;
  const auto bytes = auth::fromHex(hex);
  if (!bytes) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : *bytes) v = (v << 8) | static_cast<std::uint8_t>(c);
  if (v == 0) return std::nullopt;
  return v;
}

// ---- Messages ------------------------------------------------------------------------------------
// Who a connection speaks for, said in its first frame (kHello).
enum class Role : std::uint8_t { kAgent = 1, kWorker = 2, kSpare = 3 };

enum class Type : std::uint8_t {
  // The first frame and its answer.
  kHello = 1,    // client: value = Role. Agent: rank = its first global rank, value2 = how many,
                 //   generation = world size, text = node rank. Worker: rank, incarnation,
                 //   value2 = pid. Spare: incarnation, value2 = pid, text = "<node rank> <spare id>".
  kWelcome = 2,  // coordinator: accepted; generation = the group's generation now
  kRefused = 3,  // coordinator: text = why; the connection closes
  // Worker -> coordinator.
  kDeclare = 10,      // value = 1: this rank can recover in place, 0: it cannot (text = why)
  kReform = 11,       // its group of `generation` failed; value = 1 if it holds the training state
  kJoin = 12,         // a replacement joins the running group
  kEvictSilent = 13,  // waiting in the re-form of `generation` for value ms: evict the silent ranks
  kGroupBuilt = 14,   // it built the group of `generation` (the one kFormed named)
  // Coordinator -> worker.
  kFormed = 20,    // every rank is in: build the group of `generation` (text = its key nonce, hex);
                   //   value = how many ranks hold the training state
  kAssign = 21,    // to a spare: take rank `rank` over; value = local rank, value2 = replacement number
  kEvicting = 22,  // answer to kEvictSilent: value = processes ordered killed now, value2 = ranks whose
                   //   replacement is on its way (started, or about to be); text = who is missing
  // Agent -> coordinator.
  kRegister = 30,     // rank `rank` is now process `incarnation`; value = 1 for a replacement
  kAssignSpare = 31,  // spare `text` (process `incarnation`) takes rank `rank` over;
                      //   value = local rank, value2 = replacement number
  // Coordinator -> agent.
  kKill = 40,        // kill process `incarnation` of rank `rank`: it stopped answering its peers
  kRankState = 41,   // process `incarnation` of rank `rank` takes part in the re-form
  kReformed = 42,    // the group re-formed at `generation`: every rank built it (kGroupBuilt)
  kCapability = 43,  // value = 1: every rank can recover in place; 0: rank `rank` cannot (text = why)
  kSpareReady = 44,  // spare `text` (process `incarnation`) is connected and waits for a rank
};

struct Message {
  Type type = Type::kHello;
  std::int32_t rank = -1;
  std::uint64_t incarnation = 0;
  std::int64_t generation = -1;
  std::int64_t value = 0;
  std::int64_t value2 = 0;
  std::string text;
};

namespace detail {
inline void putInt(std::string& out, std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline std::uint64_t getInt(std::string_view in, std::size_t& at, int bytes) {
  if (at + static_cast<std::size_t>(bytes) > in.size()) throw ProtocolError("a control message is cut short");
  std::uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v = (v << 8) | static_cast<std::uint8_t>(in[at + static_cast<std::size_t>(i)]);
  at += static_cast<std::size_t>(bytes);
  return v;
}
} // namespace detail

inline std::string encode(const Message& m) {
  if (m.text.size() > kMaxText) throw ProtocolError("a control message's text is over " + std::to_string(kMaxText) + " bytes");
  std::string out;
  out.reserve(39 + m.text.size());
  detail::putInt(out, static_cast<std::uint8_t>(m.type), 1);
  detail::putInt(out, static_cast<std::uint32_t>(m.rank), 4);
  detail::putInt(out, m.incarnation, 8);
  detail::putInt(out, static_cast<std::uint64_t>(m.generation), 8);
  detail::putInt(out, static_cast<std::uint64_t>(m.value), 8);
  detail::putInt(out, static_cast<std::uint64_t>(m.value2), 8);
  detail::putInt(out, m.text.size(), 2);
  out += m.text;
  return out;
}

inline Message decode(std::string_view in) {
  std::size_t at = 0;
  Message m;
  m.type = static_cast<Type>(detail::getInt(in, at, 1));
  m.rank = static_cast<std::int32_t>(static_cast<std::uint32_t>(detail::getInt(in, at, 4)));
  m.incarnation = detail::getInt(in, at, 8);
  m.generation = static_cast<std::int64_t>(detail::getInt(in, at, 8));
  m.value = static_cast<std::int64_t>(detail::getInt(in, at, 8));
  m.value2 = static_cast<std::int64_t>(detail::getInt(in, at, 8));
  const auto length = static_cast<std::size_t>(detail::getInt(in, at, 2));
  if (length > kMaxText || at + length != in.size()) throw ProtocolError("a control message's text length is wrong");
  m.text.assign(in.substr(at, length));
  return m;
}

// ---- The handshake -------------------------------------------------------------------------------
inline std::string clientHello(const Nonce& clientNonce) {
  std::string out(kMagic.begin(), kMagic.end());
  out.push_back(static_cast<char>(kVersion));
  out.append(reinterpret_cast<const char*>(clientNonce.data()), clientNonce.size());
  return out;
}

// The client's nonce from its first kClientHelloSize bytes; throws on another magic or version.
inline Nonce parseClientHello(std::string_view in) {
  if (in.size() < kClientHelloSize || in.substr(0, kMagic.size()) != std::string_view(reinterpret_cast<const char*>(kMagic.data()), kMagic.size()))
    throw ProtocolError("not a control connection");
  if (static_cast<std::uint8_t>(in[kMagic.size()]) != kVersion)
    throw ProtocolError("control protocol version " + std::to_string(static_cast<std::uint8_t>(in[kMagic.size()])) +
                        " (this side speaks " + std::to_string(kVersion) + ": every node must run the same ctorchrun)");
  Nonce n{};
  for (std::size_t i = 0; i < n.size(); ++i) n[i] = static_cast<std::uint8_t>(in[kMagic.size() + 1 + i]);
  return n;
}

namespace detail {
inline std::string joined(std::string_view label, const Nonce& a, const Nonce& b, const Nonce* c = nullptr) {
  std::string m(label);
  m.append(reinterpret_cast<const char*>(a.data()), a.size());
  m.append(reinterpret_cast<const char*>(b.data()), b.size());
  if (c) m.append(reinterpret_cast<const char*>(c->data()), c->size());
  return m;
}
inline bool equalTime(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}
inline std::string truncatedMac(std::string_view key, std::string_view message) {
  const auth::Digest d = auth::hmacSha256(key, message);
  return std::string(reinterpret_cast<const char*>(d.data()), kMacSize);
}
} // namespace detail

// The server's answer: its nonce, the launch id (fresh for every workers' store, that is every
// launch and every restart round), and its proof that it holds the key, bound to both nonces.
inline std::string serverHello(std::string_view key, const Nonce& clientNonce, const Nonce& serverNonce, const Nonce& launch) {
  std::string out(reinterpret_cast<const char*>(serverNonce.data()), serverNonce.size());
  out.append(reinterpret_cast<const char*>(launch.data()), launch.size());
  out += detail::truncatedMac(key, detail::joined("ctorch control server", clientNonce, serverNonce, &launch));
  return out;
}

struct ServerHello {
  Nonce serverNonce{};
  Nonce launch{};
};
// The server's nonce and launch id, or nullopt when its proof is wrong (not this job's coordinator).
inline std::optional<ServerHello> verifyServerHello(std::string_view key, const Nonce& clientNonce, std::string_view in) {
  if (in.size() != kServerHelloSize) return std::nullopt;
  ServerHello h;
  for (std::size_t i = 0; i < kNonceSize; ++i) {
    h.serverNonce[i] = static_cast<std::uint8_t>(in[i]);
    h.launch[i] = static_cast<std::uint8_t>(in[kNonceSize + i]);
  }
  const std::string expected = detail::truncatedMac(key, detail::joined("ctorch control server", clientNonce, h.serverNonce, &h.launch));
  if (!detail::equalTime(expected, in.substr(2 * kNonceSize))) return std::nullopt;
  return h;
}

// ---- Frames after the handshake -------------------------------------------------------------------
// [u16 payload length][payload][MAC of direction, sequence number and payload], under a key derived
// from the job's key and both nonces: valid on this connection only, in this order only.
class Channel {
 public:
  Channel() = default;
  Channel(std::string_view key, const Nonce& clientNonce, const Nonce& serverNonce, bool client)
      : key_(connectionKey(key, clientNonce, serverNonce)),
        send_(client ? 'c' : 's'),
        receive_(client ? 's' : 'c') {}

  std::string seal(const Message& m) {
    const std::string payload = encode(m);
    std::string out;
    detail::putInt(out, payload.size(), 2);
    out += payload;
    out += mac(send_, sendSeq_++, payload);
    return out;
  }

  // The next frame at the front of `in`, which it removes; nullopt while it is incomplete. Throws
  // ProtocolError for an oversized frame, a wrong MAC (forged, replayed, reordered) or bad content.
  std::optional<Message> open(std::string& in) {
    if (in.size() < 2) return std::nullopt;
    std::size_t at = 0;
    const auto length = static_cast<std::size_t>(detail::getInt(in, at, 2));
    if (length > kMaxPayload) throw ProtocolError("a control frame of " + std::to_string(length) + " bytes (at most " + std::to_string(kMaxPayload) + ")");
    if (in.size() < 2 + length + kMacSize) return std::nullopt;
    const std::string payload = in.substr(2, length);
    if (!detail::equalTime(mac(receive_, receiveSeq_, payload), std::string_view(in).substr(2 + length, kMacSize)))
      throw ProtocolError("a control frame failed authentication (forged, replayed or out of order)");
    ++receiveSeq_;
    in.erase(0, 2 + length + kMacSize);
    return decode(payload);
  }

 private:
  static std::string connectionKey(std::string_view key, const Nonce& clientNonce, const Nonce& serverNonce) {
    const auth::Digest d = auth::hmacSha256(key, detail::joined("ctorch control connection", clientNonce, serverNonce));
    return std::string(reinterpret_cast<const char*>(d.data()), d.size());
  }
  std::string mac(char direction, std::uint64_t seq, const std::string& payload) const {
    std::string m(1, direction);
    detail::putInt(m, seq, 8);
    m += payload;
    return detail::truncatedMac(key_, m);
  }

  std::string key_;
  char send_ = 'c';
  char receive_ = 's';
  std::uint64_t sendSeq_ = 0;
  std::uint64_t receiveSeq_ = 0;
};

// ---- First frames -----------------------------------------------------------------------------------
inline Message agentHello(int nodeRank, int firstRank, int count, int worldSize) {
  Message m;
  m.type = Type::kHello;
  m.value = static_cast<std::int64_t>(Role::kAgent);
  m.rank = firstRank;
  m.value2 = count;
  m.generation = worldSize;
  m.text = std::to_string(nodeRank);
  return m;
}
inline Message workerHello(int rank, std::uint64_t incarnation, long pid) {
  Message m;
  m.type = Type::kHello;
  m.value = static_cast<std::int64_t>(Role::kWorker);
  m.rank = rank;
  m.incarnation = incarnation;
  m.value2 = pid;
  return m;
}
inline Message spareHello(int nodeRank, const std::string& spareId, std::uint64_t incarnation, long pid) {
  Message m;
  m.type = Type::kHello;
  m.value = static_cast<std::int64_t>(Role::kSpare);
  m.incarnation = incarnation;
  m.value2 = pid;
  m.text = std::to_string(nodeRank) + " " + spareId.substr(0, 64);
  return m;
}
inline Message message(Type type) {
  Message m;
  m.type = type;
  return m;
}

// Where the store keeps keys that LIST_KEYS does not name (ctorch::store::kUnlistedPrefix, the
// same string: the contract depends on nothing).
inline constexpr std::string_view kUnlistedPrefix = "ctorch/unlisted/";

// A group generation's key prefix in the store: generation 0 is Python's own "default_pg"; a group
// re-formed in place adds the coordinator's fresh nonce (128 random bits, sent only on this
// channel) and lives under kUnlistedPrefix, which LIST_KEYS does not show: nobody outside the job
// can name its keys, so nobody can overwrite or delete them.
inline std::string groupPrefix(std::int64_t generation, std::string_view nonceHex) {
  if (generation == 0) return "default_pg";
  return std::string(kUnlistedPrefix) + "default_pg_g" + std::to_string(generation) + "_" + std::string(nonceHex);
}

} // namespace ctorch::contract::control
