// Settings of the c10d dynamic rendezvous and how they are given on the command line:
// `--rdzv-conf key=value,...` (torchrun's keys and defaults) and `--rdzv-endpoint host[:port]`.
// Parsed and validated once; errors are RendezvousConfigError naming the bad key or value.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ctorch::rdzv::c10d {

using std::chrono::milliseconds;

// torchrun's defaults (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
// c10d_rendezvous_backend.py).
inline constexpr milliseconds kDefaultJoinTimeout{600'000};
inline constexpr milliseconds kDefaultLastCallTimeout{30'000};
inline constexpr milliseconds kDefaultCloseTimeout{30'000};
inline constexpr milliseconds kDefaultHeartbeatTimeout{5'000};
inline constexpr milliseconds kDefaultReadTimeout{60'000};
inline constexpr milliseconds kDefaultKeepAliveInterval{5'000};
inline constexpr int kDefaultKeepAliveMaxAttempt = 3;
inline constexpr int kDefaultRendezvousPort = 29400;

struct Settings {
  std::string runId;                 // --rdzv-id; part of the state key, so jobs never mix
  int minNodes = 1;                  // --nnodes MIN[:MAX]
  int maxNodes = 1;
  milliseconds joinTimeout = kDefaultJoinTimeout;          // a round must complete within this
  milliseconds lastCallTimeout = kDefaultLastCallTimeout;  // extra wait once MIN nodes joined
  milliseconds closeTimeout = kDefaultCloseTimeout;        // to mark the rendezvous closed
  milliseconds heartbeatTimeout = kDefaultHeartbeatTimeout;  // one heartbeat write must finish within
  milliseconds readTimeout = kDefaultReadTimeout;          // store operations (used by the store client)
  milliseconds keepAliveInterval = kDefaultKeepAliveInterval;  // heartbeat period
  int keepAliveMaxAttempt = kDefaultKeepAliveMaxAttempt;       // missed heartbeats before "dead"

  // A node whose last heartbeat is older than this is dead (torch: interval x max attempts).
  milliseconds heartbeatExpiry() const { return keepAliveInterval * keepAliveMaxAttempt; }
  // Throws RendezvousConfigError on an empty run id, MIN < 1, MAX < MIN, non-positive times.
  void validate() const;
};

// ctorchrun's heartbeat, where torchrun's (5 s x 3) would leave a dead node unnoticed for up to
// 17.5 s: a node is dead after 3 missed heartbeats of 1 s (ctorchrunSettings applies them).
inline constexpr milliseconds kCtorchrunKeepAliveInterval{1000};
inline constexpr int kCtorchrunKeepAliveMaxAttempt = 3;

// `--rdzv-conf`, parsed once (ctorchrun's LaunchConfig carries it): the entries as given, in order
// (for the log), and the keys the c10d rendezvous reads, typed; only the keys that were set.
struct RdzvConf {
  std::vector<std::pair<std::string, std::string>> entries;  // key=value as given, trimmed
  std::optional<milliseconds> joinTimeout, lastCallTimeout, closeTimeout, heartbeatTimeout,
      readTimeout, keepAliveInterval;
  std::optional<int> keepAliveMaxAttempt;
  std::optional<bool> isHost;  // host the store here (true) / never (false) / decide (unset)
};

// Which keys a --rdzv-conf may hold: the c10d rendezvous' (anything else is refused), or any key
// (a backend that reads none, as torchrun's static one: only the key=value syntax is checked).
enum class RdzvConfKeys { kC10d, kAny };

// Parses "k=v,k=v". Keys (torchrun's): join_timeout, last_call_timeout, close_timeout,
// heartbeat_timeout, read_timeout (seconds, decimals allowed), keep_alive_interval (seconds; alias
// `heartbeat`), keep_alive_max_attempt (count), is_host (true/false/1/0/yes/no), store_type (tcp
// only). Underscores and dashes are interchangeable in keys. Throws RendezvousConfigError.
RdzvConf parseRdzvConf(std::string_view text, RdzvConfKeys keys = RdzvConfKeys::kC10d);

// Settings for a run: defaults, overridden by the conf, validated.
Settings makeSettings(std::string runId, int minNodes, int maxNodes, const RdzvConf& conf);
// The same with ctorchrun's heartbeat defaults (kCtorchrunKeepAlive*) for the keys not given.
Settings ctorchrunSettings(std::string runId, int minNodes, int maxNodes, const RdzvConf& conf);

// The names parseRdzvConf accepts (for --help and error messages).
const std::vector<std::string>& rdzvConfKeys();

} // namespace ctorch::rdzv::c10d
