#include "ctorch/rdzv/c10d/store_host.hpp"

#include "ctorch/text/text.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>

namespace ctorch::rdzv::c10d {

namespace {

// Numeric form of an IPv4/IPv6 literal, or nullopt if `s` is not one.
std::optional<std::string> canonicalIp(std::string_view s) {
  std::string text(s);
  unsigned char buf[sizeof(in6_addr)];
  char out[INET6_ADDRSTRLEN] = {};
  if (::inet_pton(AF_INET, text.c_str(), buf) == 1) {
    ::inet_ntop(AF_INET, buf, out, sizeof(out));
    return std::string(out);
  }
  if (::inet_pton(AF_INET6, text.c_str(), buf) == 1) {
    ::inet_ntop(AF_INET6, buf, out, sizeof(out));
    return std::string(out);
  }
  return std::nullopt;
}

bool isLoopback(const std::string& ip) {
  return ip.rfind("127.", 0) == 0 || ip == "::1";
}

std::string numeric(const sockaddr* sa) {
  char out[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, out, sizeof(out));
  else if (sa->sa_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, out, sizeof(out));
  return out;
}

} // namespace

StoreHostDecision decideStoreHost(std::string_view endpointHost, std::optional<bool> isHostConf,
                                  const LocalIdentity& local,
                                  const std::vector<std::string>& endpointAddresses) {
  StoreHostDecision d;
  if (isHostConf) {
    d.isHost = *isHostConf;
    d.explicitChoice = true;
    d.reason = std::string("is_host=") + (*isHostConf ? "true" : "false") + " in --rdzv-conf";
    return d;
  }
  const std::string host = text::toLower(endpointHost);
  if (host == "localhost") {
    d.isHost = true;
    d.reason = "the endpoint is localhost";
    return d;
  }
  if (auto ip = canonicalIp(host)) {
    if (isLoopback(*ip)) {
      d.isHost = true;
      d.reason = "the endpoint " + *ip + " is a loopback address";
      return d;
    }
    for (const auto& a : local.addresses)
      if (canonicalIp(a) == ip) {
        d.isHost = true;
        d.reason = "the endpoint " + *ip + " is an address of this machine";
        return d;
      }
    d.reason = "the endpoint " + *ip + " is not an address of this machine";
    return d;
  }
  if (!local.hostname.empty() && host == text::toLower(local.hostname)) {
    d.isHost = true;
    d.reason = "the endpoint '" + std::string(endpointHost) + "' is this machine's host name";
    return d;
  }
  if (!local.fqdn.empty() && host == text::toLower(local.fqdn)) {
    d.isHost = true;
    d.reason = "the endpoint '" + std::string(endpointHost) + "' is this machine's FQDN";
    return d;
  }
  for (const auto& ea : endpointAddresses) {
    auto ip = canonicalIp(ea);
    if (!ip) continue;
    // A name that resolves to loopback here names this machine (Debian maps its own hostname to
    // 127.0.1.1); on any other machine it would resolve to a routable address.
    if (isLoopback(*ip)) {
      d.isHost = true;
      d.reason = "the endpoint '" + std::string(endpointHost) + "' resolves to loopback " + *ip;
      return d;
    }
    for (const auto& a : local.addresses)
      if (canonicalIp(a) == ip) {
        d.isHost = true;
        d.reason = "the endpoint '" + std::string(endpointHost) + "' resolves to " + *ip +
                   ", an address of this machine";
        return d;
      }
  }
  d.reason = "the endpoint '" + std::string(endpointHost) + "' is not this machine (" +
             (endpointAddresses.empty() ? std::string("it does not resolve here")
                                        : "it resolves to " + endpointAddresses.front()) +
             ")";
  return d;
}

bool loopbackEndpoint(std::string_view endpointHost) {
  const std::string host = text::toLower(endpointHost);
  if (host == "localhost") return true;
  const auto ip = canonicalIp(host);
  return ip && isLoopback(*ip);
}

LocalIdentity discoverLocalIdentity() {
  LocalIdentity id;
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) == 0) id.hostname = name;
  if (!id.hostname.empty()) {
    addrinfo hints{};
    hints.ai_flags = AI_CANONNAME;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(id.hostname.c_str(), nullptr, &hints, &res) == 0) {
      if (res && res->ai_canonname) id.fqdn = res->ai_canonname;
      ::freeaddrinfo(res);
    }
  }
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr) continue;
      if (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6) continue;
      std::string a = numeric(i->ifa_addr);
      if (!a.empty() && std::find(id.addresses.begin(), id.addresses.end(), a) == id.addresses.end())
        id.addresses.push_back(a);
    }
    ::freeifaddrs(ifs);
  }
  return id;
}

std::vector<std::string> resolveHost(const std::string& host) {
  std::vector<std::string> out;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* r = res; r; r = r->ai_next) {
    std::string a = numeric(r->ai_addr);
    if (!a.empty() && std::find(out.begin(), out.end(), a) == out.end()) out.push_back(a);
  }
  ::freeaddrinfo(res);
  return out;
}

} // namespace ctorch::rdzv::c10d
