// Which agent hosts the rendezvous TCPStore: the one whose own host name or address matches the
// --rdzv-endpoint host, unless `is_host` in --rdzv-conf says so explicitly (torch's
// _matches_machine_hostname + is_host). The decision is pure; discoverLocalIdentity() and
// resolveHost() do the I/O that feeds it.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ctorch::rdzv::c10d {

struct LocalIdentity {
  std::string hostname;                 // gethostname()
  std::string fqdn;                     // canonical name of hostname, if it resolves
  std::vector<std::string> addresses;   // numeric addresses of every local interface (v4 and v6)
};

struct StoreHostDecision {
  bool isHost = false;
  bool explicitChoice = false;  // from is_host: do not fall back to client if binding fails
  std::string reason;           // for the log: which rule decided
};

// endpointAddresses: what the endpoint host resolves to (may be empty if it does not resolve).
StoreHostDecision decideStoreHost(std::string_view endpointHost, std::optional<bool> isHostConf,
                                  const LocalIdentity& local,
                                  const std::vector<std::string>& endpointAddresses);

// Whether `endpointHost` is a literal loopback address (127.x.y.z, ::1) or "localhost": then every
// node of the job runs on this machine, and the job's stores listen where they are announced (the
// loopback) instead of on every interface. A name that merely resolves to loopback here (Debian maps
// its own host name to 127.0.1.1) is not: other machines resolve it to a routable address.
bool loopbackEndpoint(std::string_view endpointHost);

// I/O helpers: this machine's names and interface addresses; a host's addresses (getaddrinfo,
// empty when it does not resolve).
LocalIdentity discoverLocalIdentity();
std::vector<std::string> resolveHost(const std::string& host);

} // namespace ctorch::rdzv::c10d
