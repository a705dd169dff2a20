// ctorch-train --sync allreduce|parameter-server and --ps-servers: the flags and what they refuse, and
// the real program under the real ctorchrun: 2 workers + 1 or 2 servers end with final weights
// bit-identical to 2 ranks of allreduce (SGD with momentum, and Adam), also when stopped and resumed.
#include "trainer_test_util.hpp"

#include <ctorch/train/options.hpp>

#include <signal.h>

#include <regex>
#include <thread>

using namespace traintest;

namespace synctest {

ctorch::train::ParsedCommandLine parse(std::vector<std::string> args) { return ctorch::train::parseCommandLine(args); }

// A toy run: 2 epochs of 16 steps at 2 data ranks, a snapshot every 4 steps.
const std::vector<std::string> kSyncToy = {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size",
                                       "256", "--batch-size", "8", "--epochs", "2", "--test-limit", "64",
                                       "--log-interval", "8", "--lr", "0.05", "--threads", "1",
                                       "--save-every-steps", "4", "--progress", "lines"};

ProcessResult launch(const fs::path& dir, int nproc, const std::vector<std::string>& args) {
  const auto r = ctorch::test::run(trainUnderLauncher(dir, nproc, args));
  INFO(show(r));
  REQUIRE(r.ok());
  return r;
}

// Runs `args` under ctorchrun (`nproc` ranks, --max-restarts 1) with every rank held after global
// step `atStep` (--hold-after-step; a step with a snapshot), kills rank `victim` with SIGKILL once
// rank 0 wrote that step's snapshot, and lets the launcher restart the group, which resumes from it
// and finishes. Returns the launcher's result.
ProcessResult killAndResume(const fs::path& dir, int nproc, const std::vector<std::string>& args, int victim,
                            std::int64_t atStep) {
  // --log-saves: a line for every save, mid-epoch ones included.
  const auto held = with(args, {"--log-saves", "--hold-after-step", std::to_string(atStep), "--hold-file",
                                (dir / "never-released").string()});
  ctorch::test::Process p(trainUnderLauncher(dir, nproc, held, {"--max-restarts", "1"}));
  const std::regex written(R"(snapshot written: \S*snapshot\.pt \([^,]*, global step )" + std::to_string(atStep) + R"(\b)");
  const bool saved = waitForOutput(p, written, std::chrono::seconds(90)).has_value();
  int pid = -1;
  for (int i = 0; saved && i < 500 && pid < 0; ++i) {
    pid = findWorkerPid(dir, victim);
    if (pid < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const bool killed = pid > 0 && ::kill(pid, SIGKILL) == 0;
  auto result = p.wait();
  INFO(show(result));
  REQUIRE(saved);
  REQUIRE(killed);
  return result;
}

}  // namespace synctest


TEST_CASE("sync options: --sync allreduce (default) or parameter-server, --ps-servers, and what cannot work with them",
          "[trainer][options][sync]") {
  using ctorch::train::SyncChoice;
  CHECK(synctest::parse({}).options->sync == SyncChoice::kAllreduce);
  const auto ps = synctest::parse({"--sync", "parameter-server"});
  REQUIRE(ps.options);
  CHECK(ps.options->sync == SyncChoice::kParameterServer);
  CHECK(ps.options->psServers == 1);
  CHECK(ps.options->describe().find("parameter server on the last 1 rank") != std::string::npos);
  const auto two = synctest::parse({"--sync", "parameter-server", "--ps-servers", "2"});
  REQUIRE(two.options);
  CHECK(two.options->psServers == 2);
  // Bound to the snapshot (the servers read no data: the same world splits it another way), only
  // when on: an allreduce run's configuration is what it was before the flag existed.
  CHECK(synctest::parse({}).options->bindingConfig().count("sync") == 0);
  CHECK(two.options->bindingConfig().at("sync") == "parameter-server");
  CHECK(two.options->bindingConfig().at("ps_servers") == "2");

  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--sync", "gossip"}, "--sync 'gossip' is not one of: allreduce, parameter-server"},
      {{"--ps-servers", "2"}, "--ps-servers '2' needs --sync parameter-server"},
      {{"--sync", "parameter-server", "--ps-servers", "0"}, "--ps-servers '0' must be in [1, 1024]"},
      {{"--sync", "parameter-server", "--sharding", "optimizer"},
       "--sync parameter-server with --sharding optimizer: the servers already hold the optimizer state"},
      {{"--sync", "parameter-server", "--clip-grad-norm", "1"}, "--sync parameter-server with --clip-grad-norm"},
      {{"--sync", "parameter-server", "--amp", "--device", "cuda"},
       "--sync parameter-server with --amp float16 (loss scaling) is not supported"},
  };
  for (const auto& [args, message] : refused) {
    const auto r = synctest::parse(args);
    INFO(r.message);
    CHECK_FALSE(r.options);
    CHECK(r.message.find(message) != std::string::npos);
    CHECK(std::count(r.message.begin(), r.message.end(), '\n') == 1);  // one line
  }
  CHECK(synctest::parse({"--sync", "parameter-server", "--amp", "--amp-dtype", "bfloat16", "--device", "cpu"}).options);
}

TEST_CASE("sync: ctorch-train --sync parameter-server under ctorchrun ends bit-identical to allreduce (SGD, Adam, 1 "
          "and 2 servers), also stopped by --max-steps and resumed",
          "[trainer][process][sync]") {
  for (const std::string optimizer : {"sgd", "adam"}) {
    const auto args = with(synctest::kSyncToy, {"--optimizer", optimizer});
    TempDir reference("sync-allreduce");
    synctest::launch(reference.path(), 2, args);
    for (int servers : {1, 2}) {
      INFO(optimizer << ", " << servers << " server(s)");
      TempDir dir("sync-ps");
      const auto psArgs = with(args, {"--sync", "parameter-server", "--ps-servers", std::to_string(servers)});
      const auto r = synctest::launch(dir.path(), 2 + servers, psArgs);
      CHECK(r.output.find("8 per worker x 2 workers") != std::string::npos);
      CHECK(r.output.find(servers == 1 ? "1 parameter server (rank 2)" : "2 parameter servers (ranks 2-3)") != std::string::npos);
      CHECK(bitDifference(reference / "model.pt", dir / "model.pt") == "");
      // Every rank wrote its shard of the snapshot.
      CHECK(ctorch::snapshotShardFiles(dir / "snapshot.pt").size() == static_cast<std::size_t>(2 + servers));
      if (servers != 2) continue;
      // Stopped mid-epoch 1 (16 steps per epoch) with its snapshot, then resumed by the same command.
      TempDir stopped("sync-ps-stopped");
      synctest::launch(stopped.path(), 4, with(psArgs, {"--max-steps", "10"}));
      const auto resumed = synctest::launch(stopped.path(), 4, psArgs);
      CHECK(resumed.output.find("exactly where it stopped") != std::string::npos);
      CHECK(bitDifference(reference / "model.pt", stopped / "model.pt") == "");
    }
  }
}

TEST_CASE("sync: a run with 1 server resumes with 2 (another world size: from the epoch boundary, the servers' "
          "optimizer shards resharded) and ends bit-identical to allreduce",
          "[trainer][process][sync]") {
  const auto args = with(synctest::kSyncToy, {"--optimizer", "adam"});
  TempDir reference("sync-allreduce"), dir("sync-ps-reshard");
  synctest::launch(reference.path(), 2, args);
  const auto ps = with(args, {"--sync", "parameter-server"});
  synctest::launch(dir.path(), 3, with(ps, {"--epochs", "1", "--ps-servers", "1"}));
  // ps_servers is bound to the snapshot (the same world size would split the data another way).
  const auto r = synctest::launch(dir.path(), 4, with(ps, {"--ps-servers", "2", "--allow-config-change"}));
  CHECK(r.output.find("written by 3 ranks at an epoch boundary, continued by 4 ranks") != std::string::npos);
  CHECK(bitDifference(reference / "model.pt", dir / "model.pt") == "");
}

TEST_CASE("sync: a server or a worker killed mid-run: ctorchrun restarts the group, which resumes from the snapshot "
          "(the servers' optimizer shards included) and ends bit-identical to allreduce",
          "[trainer][process][sync][faults]") {
  const auto args = with(synctest::kSyncToy, {"--optimizer", "adam"});
  TempDir reference("sync-allreduce");
  synctest::launch(reference.path(), 2, args);
  for (int victim : {2, 1}) {  // the server, then a worker
    INFO("rank " << victim << " killed");
    TempDir dir("sync-ps-killed");
    // --hold-after-step holds the run at step 8 for the kill; it changes no result.
    const auto r = synctest::killAndResume(dir.path(), 3, with(args, {"--sync", "parameter-server"}), victim, 8);
    INFO(show(r));
    CHECK(r.ok());
    CHECK(r.output.find("exactly where it stopped") != std::string::npos);  // the restarted group resumed
    CHECK(bitDifference(reference / "model.pt", dir / "model.pt") == "");
  }
}

TEST_CASE("sync: the control - another learning rate differs, and a world with no worker is refused in one line",
          "[trainer][process][sync][control]") {
  TempDir reference("sync-allreduce"), other("sync-ps-other"), none("sync-ps-none");
  synctest::launch(reference.path(), 2, synctest::kSyncToy);
  synctest::launch(other.path(), 3, with(synctest::kSyncToy, {"--sync", "parameter-server", "--lr", "0.04"}));
  CHECK(bitDifference(reference / "model.pt", other / "model.pt") != "");
  const auto r = ctorch::test::run(trainUnderLauncher(none.path(), 2, with(synctest::kSyncToy, {"--sync", "parameter-server", "--ps-servers", "2"})));
  INFO(show(r));
  CHECK_FALSE(r.ok());
  CHECK(r.output.find("2 server(s) in a world of 2 leave no worker") != std::string::npos);
  CHECK(r.output.find("Exception raised from") == std::string::npos);
}
