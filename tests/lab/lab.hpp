// The multi-node test lab for Catch2 tests: network-namespace "hosts" (scripts/lab/netns.sh) and
// a real single-host Slurm cluster (scripts/lab/slurm.sh), brought up by a constructor and torn
// down by the destructor. Tests call CTORCH_REQUIRE_NETNS() / CTORCH_REQUIRE_SLURM() first: they
// skip (CTORCH_SKIP) only where this machine cannot create namespaces or lacks Slurm.
#pragma once

#include "multiproc.hpp"

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace ctorch::test::lab {

// Why no network lab can be made here, or "" when one can (asked once, then cached).
std::string netnsUnavailableReason();
// Why no Slurm cluster can be made here, or "" when one can.
std::string slurmUnavailableReason();

// Absolute paths of the scripts (from the source tree this test was built from).
std::string netnsScript();
std::string slurmScript();

// N hosts n1..nN with addresses <subnet>.1..N; this machine is <subnet>.254 on their bridge.
class NetnsLab {
 public:
  explicit NetnsLab(int hosts);
  ~NetnsLab();
  NetnsLab(const NetnsLab&) = delete;
  NetnsLab& operator=(const NetnsLab&) = delete;

  const std::string& prefix() const { return prefix_; }
  int size() const { return size_; }
  std::string addr(int host) const;  // 1-based
  const std::string& bridgeAddr() const { return bridgeAddr_; }
  std::string nsName(int host) const { return prefix_ + "-h" + std::to_string(host); }
  // The environment variables printed by `netns.sh up` (LAB_PREFIX, LAB_SUBNET, ...).
  const std::map<std::string, std::string>& vars() const { return vars_; }

  // argv that runs `argv` inside `host` (own network namespace, hostname n<host>).
  std::vector<std::string> inHost(int host, const std::vector<std::string>& argv) const;
  // Spawns a process inside `host`; options.argv is the command as seen inside.
  SpawnOptions spawnIn(int host, SpawnOptions options) const;

  void cut(int host);       // link down: packets to and from the host vanish
  void restore(int host);   // link up again
  void cutBetween(int a, int b);      // only a and b stop reaching each other (a partial partition)
  void restoreBetween(int a, int b);
  void block(int host, int port);    // DROP incoming TCP to `port` inside the host
  void unblock(int host, int port);
  void killHost(int host);  // SIGKILL every process in the host
  std::vector<int> pids(int host) const;  // live processes in the host

  void down();  // idempotent; the destructor calls it

 private:
  void script(const std::vector<std::string>& args) const;
  std::string prefix_, subnet_, bridgeAddr_;
  int size_ = 0;
  bool up_ = false;
  std::map<std::string, std::string> vars_;
};

struct SlurmLabOptions {
  int nodes = 2;
  int gpusPerNode = 0;  // fake GPUs (character devices + gres.conf)
  int cpusPerNode = 4;
};

// slurmctld + `nodes` slurmd n1..nN, partition "lab" (default). Run clients with env().
class SlurmLab {
 public:
  explicit SlurmLab(const SlurmLabOptions& options);
  ~SlurmLab();
  SlurmLab(const SlurmLab&) = delete;
  SlurmLab& operator=(const SlurmLab&) = delete;

  // SLURM_CONF for srun/sbatch/salloc/sinfo.
  std::map<std::string, std::string> env() const { return {{"SLURM_CONF", vars_.at("SLURM_CONF")}}; }
  const std::map<std::string, std::string>& vars() const { return vars_; }
  const std::string& prefix() const { return vars_.at("LAB_PREFIX"); }
  const std::string& dir() const { return vars_.at("LAB_SLURM_DIR"); }
  int nodes() const { return nodes_; }

  // Runs a Slurm client command (srun ..., sbatch ...) against this cluster.
  ProcessResult run(const std::vector<std::string>& argv,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60),
                    const std::map<std::string, std::string>& extraEnv = {},
                    const std::string& cwd = "") const;

  void down();  // idempotent; the destructor calls it

 private:
  std::map<std::string, std::string> vars_;
  int nodes_ = 0;
  bool up_ = false;
};

// KEY=VALUE lines (as printed by the scripts) into a map; other lines are ignored.
std::map<std::string, std::string> parseVars(const std::string& text);

} // namespace ctorch::test::lab

#define CTORCH_REQUIRE_NETNS()                                                          \
  do {                                                                                  \
    if (auto why_ = ::ctorch::test::lab::netnsUnavailableReason(); !why_.empty())        \
      CTORCH_SKIP("no network namespaces on this machine: " << why_);                   \
  } while (false)

#define CTORCH_REQUIRE_SLURM()                                                          \
  do {                                                                                  \
    if (auto why_ = ::ctorch::test::lab::slurmUnavailableReason(); !why_.empty())        \
      CTORCH_SKIP("no Slurm lab on this machine: " << why_);                            \
  } while (false)
