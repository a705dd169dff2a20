#include "lab.hpp"

#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <sstream>
#include <stdexcept>

#ifndef CTORCH_LAB_SCRIPTS_DIR
#error "CTORCH_LAB_SCRIPTS_DIR must name scripts/lab of the source tree"
#endif

namespace ctorch::test::lab {

namespace {

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

// Runs a lab script to completion; throws with its output unless it succeeds. The timeouts below
// only keep a stuck script from hanging a test: a busy machine makes them slow, never wrong.
std::string runScript(const std::vector<std::string>& argv, std::chrono::milliseconds timeout) {
  SpawnOptions o;
  o.argv = argv;
  o.timeout = timeout;
  auto r = run(o);
  if (!r.ok()) {
    std::ostringstream os;
    for (const auto& a : argv) os << a << ' ';
    throw std::runtime_error(os.str() + "failed (" + r.describe() + "): " + trim(r.output));
  }
  return r.output;
}

std::string reasonFrom(const std::string& script) {
  SpawnOptions o;
  o.argv = {script, "check"};
  o.timeout = std::chrono::seconds(60);
  auto r = run(o);
  if (r.ok()) return "";
  std::string why = trim(r.output);
  return why.empty() ? script + " check: " + r.describe() : why;
}

} // namespace

std::string netnsScript() { return std::string(CTORCH_LAB_SCRIPTS_DIR) + "/netns.sh"; }
std::string slurmScript() { return std::string(CTORCH_LAB_SCRIPTS_DIR) + "/slurm.sh"; }

std::string netnsUnavailableReason() {
  static std::once_flag once;
  static std::string reason;
  std::call_once(once, [] { reason = reasonFrom(netnsScript()); });
  return reason;
}

std::string slurmUnavailableReason() {
  static std::once_flag once;
  static std::string reason;
  std::call_once(once, [] { reason = reasonFrom(slurmScript()); });
  return reason;
}

std::map<std::string, std::string> parseVars(const std::string& text) {
  std::map<std::string, std::string> vars;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    auto eq = line.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    std::string key = line.substr(0, eq);
    bool ok = true;
    for (char c : key) ok = ok && (std::isupper(static_cast<unsigned char>(c)) || c == '_' ||
                                   std::isdigit(static_cast<unsigned char>(c)));
    if (ok) vars[key] = line.substr(eq + 1);
  }
  return vars;
}

// ---- NetnsLab ------------------------------------------------------------------------------------------
NetnsLab::NetnsLab(int hosts) {
  auto out = runScript({netnsScript(), "up", std::to_string(hosts), "--owner", std::to_string(::getpid())},
                       std::chrono::seconds(120));
  vars_ = parseVars(out);
  if (!vars_.count("LAB_PREFIX") || !vars_.count("LAB_SUBNET"))
    throw std::runtime_error("netns.sh up printed no lab: " + out);
  prefix_ = vars_["LAB_PREFIX"];
  subnet_ = vars_["LAB_SUBNET"];
  bridgeAddr_ = vars_["LAB_BRIDGE_ADDR"];
  size_ = hosts;
  up_ = true;
}

NetnsLab::~NetnsLab() {
  try {
    down();
  } catch (const std::exception& e) {
    std::cerr << "NetnsLab teardown: " << e.what() << "\n";
  }
}

std::string NetnsLab::addr(int host) const {
  if (host < 1 || host > size_) throw std::out_of_range("lab has hosts 1.." + std::to_string(size_));
  return subnet_ + "." + std::to_string(host);
}

std::vector<std::string> NetnsLab::inHost(int host, const std::vector<std::string>& argv) const {
  std::vector<std::string> full{netnsScript(), "exec", prefix_, std::to_string(host)};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

SpawnOptions NetnsLab::spawnIn(int host, SpawnOptions options) const {
  options.argv = inHost(host, options.argv);
  return options;
}

void NetnsLab::script(const std::vector<std::string>& args) const {
  std::vector<std::string> argv{netnsScript()};
  argv.insert(argv.end(), args.begin(), args.end());
  runScript(argv, std::chrono::seconds(60));
}

void NetnsLab::cut(int host) { script({"cut", prefix_, std::to_string(host)}); }
void NetnsLab::restore(int host) { script({"restore", prefix_, std::to_string(host)}); }
void NetnsLab::cutBetween(int a, int b) { script({"cutpair", prefix_, std::to_string(a), std::to_string(b)}); }
void NetnsLab::restoreBetween(int a, int b) {
  script({"restorepair", prefix_, std::to_string(a), std::to_string(b)});
}
void NetnsLab::block(int host, int port) {
  script({"block", prefix_, std::to_string(host), std::to_string(port)});
}
void NetnsLab::unblock(int host, int port) {
  script({"unblock", prefix_, std::to_string(host), std::to_string(port)});
}
void NetnsLab::killHost(int host) { script({"kill", prefix_, std::to_string(host)}); }

std::vector<int> NetnsLab::pids(int host) const {
  auto out = runScript({netnsScript(), "pids", prefix_, std::to_string(host)}, std::chrono::seconds(60));
  std::vector<int> result;
  std::istringstream in(out);
  int pid;
  while (in >> pid) result.push_back(pid);
  return result;
}

void NetnsLab::down() {
  if (!up_) return;
  up_ = false;
  runScript({netnsScript(), "down", prefix_}, std::chrono::seconds(120));
}

// ---- SlurmLab ------------------------------------------------------------------------------------------
SlurmLab::SlurmLab(const SlurmLabOptions& options) : nodes_(options.nodes) {
  auto out = runScript({slurmScript(), "up", std::to_string(options.nodes), "--gpus",
                        std::to_string(options.gpusPerNode), "--cpus", std::to_string(options.cpusPerNode),
                        "--owner", std::to_string(::getpid())},
                       std::chrono::seconds(180));
  vars_ = parseVars(out);
  if (!vars_.count("SLURM_CONF") || !vars_.count("LAB_SLURM_DIR") || !vars_.count("LAB_PREFIX"))
    throw std::runtime_error("slurm.sh up printed no cluster: " + out);
  up_ = true;
}

SlurmLab::~SlurmLab() {
  try {
    down();
  } catch (const std::exception& e) {
    std::cerr << "SlurmLab teardown: " << e.what() << "\n";
  }
}

ProcessResult SlurmLab::run(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                            const std::map<std::string, std::string>& extraEnv,
                            const std::string& cwd) const {
  SpawnOptions o;
  o.argv = argv;
  o.timeout = timeout;
  o.setEnv = env();
  for (const auto& [k, v] : extraEnv) o.setEnv[k] = v;
  if (!cwd.empty()) o.cwd = cwd;
  return ctorch::test::run(o);
}

void SlurmLab::down() {
  if (!up_) return;
  up_ = false;
  runScript({slurmScript(), "down", dir()}, std::chrono::seconds(120));
}

} // namespace ctorch::test::lab
