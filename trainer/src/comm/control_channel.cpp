#include "comm/control_channel.hpp"

#include "comm/group_state.hpp"

#include "ctorch/errors.hpp"
#include "ctorch/stop_signal.hpp"

#include <ctorch/contract/control_auth.hpp>
#include <ctorch/contract/worker_contract.hpp>

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>

namespace ctorch::detail {

namespace {

// The job's control key (CTORCH_CONTROL_KEY, hex) that proves this process on the control channel;
// empty when ctorchrun gave none.
std::string controlKeyFrom(const EnvLookup& lookup) {
  const auto hex = lookup(contract::env::kControlKey);
  if (!hex) return "";
  return contract::auth::fromHex(*hex).value_or("");
}

bool stopRequested() { return stopSignal() != 0; }

std::uint64_t incarnationFrom(const EnvLookup& lookup) {
  const auto text = lookup(contract::env::kIncarnation).value_or("");
  const auto incarnation = contract::control::parseIncarnation(text);
  if (!incarnation)
    throw ConfigError(std::string(contract::env::kIncarnation) + " '" + text.substr(0, 32) +
                      "' is not 16 hex digits: this process was not started by ctorchrun --recovery in-place");
  return *incarnation;
}

} // namespace

// This worker on the job's control channel, behind the workers' store (node rank 0's ctorchrun).
std::unique_ptr<contract::control::BlockingClient> connectControl(const DistributedEnv& env, const EnvLookup& lookup,
                                                                  std::chrono::milliseconds timeout) {
  const std::string key = controlKeyFrom(lookup);
  if (key.empty())
    throw ConfigError(std::string("no ") + contract::env::kControlKey + " to prove this process on the control channel");
  return std::make_unique<contract::control::BlockingClient>(
      env.masterAddr, env.masterPort, key,
      contract::control::workerHello(env.rank, incarnationFrom(lookup), static_cast<long>(::getpid())), timeout,
      stopRequested);
}

// Waits on the control channel until the coordinator re-forms the group. A replacement said it joins;
// a survivor that it waits in the re-form of the failed generation, and every `timeout` / 2 it asks
// the coordinator to have the processes that stopped answering killed (their agents replace them).
// While a replacement is on its way (a LibTorch process on a loaded machine takes longer to start
// than the collectives' timeout), the wait goes on a `timeout` past the coordinator's last word:
// each replacement costs one of ctorchrun's restarts, which bounds it, and so does kMaxWaits.
Joined awaitFormed(contract::control::BlockingClient& control, const DistributedEnv& env, std::int64_t failed,
                   std::chrono::milliseconds timeout) {
  namespace cc = contract::control;
  using Clock = std::chrono::steady_clock;
  constexpr int kMaxWaits = 10;
  const auto start = Clock::now();
  const auto last = start + kMaxWaits * timeout;
  // A replacement (failed < 0) waits as long as the coordinator waits for a replacement to join
  // (max(4 x timeout, 20 s)): another one may still be starting (two workers lost at once, each
  // LibTorch process seconds to start on a loaded machine), and only the survivors hear of it.
  auto deadline = failed < 0 ? std::min(last, start + std::max<std::chrono::milliseconds>(4 * timeout, std::chrono::seconds(20)))
                             : start + timeout;
  auto nextEviction = start + timeout / 2;
  std::string missing = "no rank said why";
  for (;;) {
    auto m = control.receive(failed < 0 ? deadline : std::min(deadline, nextEviction));
    if (const int signo = stopSignal())
      throw Stopped("rank " + std::to_string(env.rank) + " stopped by signal " + std::to_string(signo) +
                    " while the group re-formed in place");
    const auto now = Clock::now();
    if (m && m->type == cc::Type::kFormed) return Joined{m->generation, m->text, m->value};
    if (m && m->type == cc::Type::kEvicting) {
      if (!m->text.empty()) missing = m->text;
      if (m->value > 0 || m->value2 > 0) deadline = std::min(last, std::max(deadline, now + timeout));
      continue;
    }
    if (m) continue;  // nothing else is for a waiting worker
    if (now >= deadline)
      throw DistributedTimeout("in-place recovery timed out after " +
                               seconds(std::chrono::duration_cast<std::chrono::milliseconds>(now - start)) +
                               ": the group did not re-form (" + missing + ")");
    if (failed >= 0 && now >= nextEviction) {
      cc::Message ask = cc::message(cc::Type::kEvictSilent);
      ask.generation = failed;
      ask.value = (timeout / 2).count();
      control.send(ask, deadline);
      nextEviction = now + timeout / 2;
    }
  }
}

void tellGroupBuilt(contract::control::BlockingClient& control, const DistributedEnv& env, std::int64_t generation) {
  namespace cc = contract::control;
  cc::Message built = cc::message(cc::Type::kGroupBuilt);
  built.generation = generation;
  try {
    control.send(built);
  } catch (const std::exception& e) {
    std::cerr << "ctorch: rank " + std::to_string(env.rank) + ": could not tell the coordinator that group generation " +
                     std::to_string(generation) + " is built: " + e.what() + "\n"
              << std::flush;
  }
}

// A spare worker (ctorchrun --spare-workers): waits on the control channel until the coordinator
// hands it a failed worker's rank (its agent chose it), then makes the assignment this process's
// environment (the rest of the program, and initProcessGroup, read it from there) and returns the
// channel, which from then on speaks for that rank. Waits as long as the job runs: the agent kills
// unused spares when the group ends. The assignment arrives authenticated on this connection only
// and carries numbers only, each checked: the error file follows from CTORCH_SPARE_LOG_DIR and
// LOCAL_RANK. A stop signal while it waits ends it (ctorch::Stopped): it holds nothing to save.
std::unique_ptr<contract::control::BlockingClient> awaitSpareAssignment(const std::string& id, const EnvLookup& lookup) {
  namespace cenv = contract::env;
  namespace cc = contract::control;
  const std::string controlKey = controlKeyFrom(lookup);
  if (controlKey.empty() || !contract::isTruthy(lookup(cenv::kUseAgentStore).value_or("")))
    throw ConfigError(std::string(cenv::kSpare) + "='" + id + "' is set, but this process was not started as a spare "
                      "by ctorchrun --spare-workers (it has no " + cenv::kControlKey + " or agent store): unset " +
                      cenv::kSpare);
  const std::string addr = lookup(cenv::kMasterAddr).value_or("");
  const std::string port = lookup(cenv::kMasterPort).value_or("");
  int portNumber = 0;
  try {
    portNumber = std::stoi(port);
  } catch (const std::exception&) {
  }
  if (addr.empty() || portNumber <= 0 || portNumber > 65535)
    throw ConfigError("spare worker '" + id + "': MASTER_ADDR/MASTER_PORT ('" + addr + "', '" + port +
                      "') do not name the workers' store");
  auto number = [&](const char* name) {
    try {
      return std::stoi(lookup(name).value_or(""));
    } catch (const std::exception&) {
      throw ConfigError("spare worker '" + id + "': " + name + " is not a number");
    }
  };
  const int worldSize = number(cenv::kWorldSize), localWorldSize = number(cenv::kLocalWorldSize);
  const int nodeRank = number(cenv::kGroupRank);
  auto control = std::make_unique<cc::BlockingClient>(
      addr, portNumber, controlKey, cc::spareHello(nodeRank, id, incarnationFrom(lookup), static_cast<long>(::getpid())),
      std::chrono::seconds(60), stopRequested);
  std::optional<cc::Message> assignment;
  while (!assignment) {
    if (const int signo = stopSignal())
      throw Stopped("spare worker '" + id + "' stopped by signal " + std::to_string(signo) +
                    " before it took a rank over");
    auto m = control->receive(std::chrono::steady_clock::now() + std::chrono::seconds(1));
    if (m && m->type == cc::Type::kAssign) assignment = m;
  }
  auto check = [&](const char* name, std::int64_t value, std::int64_t limit) {
    if (value < 0 || value >= limit)
      throw DistributedError("spare worker '" + id + "': its assignment's " + name + " " + std::to_string(value) +
                             " is not in [0, " + std::to_string(limit) + ")");
    return std::to_string(value);
  };
  const std::string rank = check(cenv::kRank, assignment->rank, worldSize);
  ::setenv(cenv::kRank, rank.c_str(), 1);
  ::setenv(cenv::kRoleRank, rank.c_str(), 1);
  const std::string localRank = check(cenv::kLocalRank, assignment->value, localWorldSize);
  ::setenv(cenv::kLocalRank, localRank.c_str(), 1);
  ::setenv(cenv::kReplacement, check(cenv::kReplacement, assignment->value2, INT_MAX).c_str(), 1);
  if (const auto dir = lookup(cenv::kSpareLogDir); dir && !dir->empty()) {
    const auto file = std::filesystem::path(*dir) / localRank / "error.json";
    ::setenv(cenv::kErrorFile, file.c_str(), 1);
  } else {
    ::unsetenv(cenv::kErrorFile);
  }
  ::unsetenv(cenv::kSpare);
  ::unsetenv(cenv::kSpareLogDir);
  return control;
}

namespace {

// A preloaded worker (ctorchrun --preloaded-workers) waits for its assignment here, while the program
// starts: LibTorch's libraries are loaded and initialised (most of a new process's start;
// docs/performance.md has the figure), the program's main() has not run. With its rank variables set it goes on
// and runs the program from the start, as the replacement a new process would have been. An error
// ends it in one line (the agent then starts a new process for the next failure).
bool awaitPreloadedAssignment() {
  const char* id = std::getenv(contract::env::kSpare);
  const char* preloaded = std::getenv(contract::env::kPreloaded);
  if (!id || !preloaded || std::string(preloaded) != "1") return false;
  ::unsetenv(contract::env::kPreloaded);
  try {
    groupState().control = awaitSpareAssignment(id, processEnvironment());
  } catch (const std::exception& e) {
    std::cerr << std::string("ctorch: preloaded worker: ") + e.what() + "\n" << std::flush;
    std::_Exit(1);
  }
  return true;
}
[[maybe_unused]] const bool gPreloadedAssigned = awaitPreloadedAssignment();

} // namespace

} // namespace ctorch::detail
