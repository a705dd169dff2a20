// One job per snapshot slot (issue 27): a second job pointed at a slot that a running job uses
// fails at once (exit 2) with one line naming the other job (run id, pid, host), and leaves the
// running job's files alone; once the holder is gone, the slot is free again.
#include "trainer_test_util.hpp"

#include <ctorch/contract/worker_contract.hpp>
#include <ctorch/snapshot.hpp>

#include <csignal>
#include <thread>

using namespace traintest;
using ctorch::test::TempDir;

namespace {

std::vector<std::string> slowToy(const std::string& seed, const std::string& epochs = "4") {
  return {"--model", "linear", "--dataset", "synthetic-regression", "--synthetic-size", "512", "--batch-size", "16",
          "--test-limit", "64", "--log-interval", "4", "--epochs", epochs, "--step-delay-ms", "30", "--seed", seed,
          "--snapshot-path", "run/snapshot.pt", "--save-every-steps", "4"};
}

} // namespace

TEST_CASE("slot lock: a second job on a slot in use fails at once naming the first, the first is untouched, "
          "the slot is free once the holder has gone", "[trainer][process][slotlock]") {
  TempDir dir("slot-lock");
  // The holder runs until it is stopped below (200 epochs of 16 steps of 30 ms or more: minutes),
  // so that it holds the slot however slowly a loaded machine starts the second job.
  Process first(trainUnderLauncher(dir.path(), 2, slowToy("1", "200"), gracefulStop()));
  std::string seen;
  REQUIRE(waitForOutput(first, std::regex("epoch 1/200"), std::chrono::seconds(60), &seen));
  std::smatch id;
  REQUIRE(std::regex_search(seen, id, std::regex(R"(rendezvous standalone id ([0-9a-f-]+))")));
  const int holder = findWorkerPid(dir.path(), 0);
  REQUIRE(holder > 0);

  const auto second = ctorch::test::run(trainUnderLauncher(dir.path(), 2, slowToy("2"), {}, std::chrono::seconds(60)));
  INFO(show(second));
  CHECK(second.exitCode == ctorch::contract::kExitUsage);
  // At once: another job's holder is never waited for (only this job's own previous rank 0 is, and
  // the wait says so first).
  CHECK(second.output.find("for it to let go") == std::string::npos);
  CHECK_THAT(second.output, Catch::Contains("snapshot slot run/snapshot.pt is in use by another job (run " +
                                            id[1].str() + ", pid " + std::to_string(holder) + " on "));
  CHECK_THAT(second.output, Catch::Contains("rank 1: snapshot slot run/snapshot.pt is in use by another job"));
  REQUIRE(::kill(holder, 0) == 0);  // the holder was there all along

  // Stopped like a job at its time limit: it saves and lets go of the slot.
  REQUIRE(::kill(first.pid(), SIGTERM) == 0);
  const auto r = first.wait();
  INFO(show(r));
  CHECK(r.exitCode == ctorch::contract::kExitPreempted);
  CHECK(r.output.find("grace period over") == std::string::npos);  // saved and exited, not killed
  CHECK(r.output.find("resume:") != std::string::npos);
  const auto snap = ctorch::loadSnapshot(dir / "run" / "snapshot.pt");
  CHECK(snap.header.config.at("seed") == "1");  // only the first job wrote the slot
  CHECK_FALSE(std::filesystem::exists(dir / "run" / "snapshot.pt.lock"));  // a run that ends tidies up (issue 42.9)

  // The holder has exited: the slot is free (here for a fresh start of another configuration).
  auto fresh = slowToy("2");
  fresh.insert(fresh.end(), {"--resume", "never", "--epochs", "1"});
  const auto third = ctorch::test::run(trainUnderLauncher(dir.path(), 2, fresh));
  INFO(show(third));
  CHECK(third.ok());
  CHECK_FALSE(std::filesystem::exists(dir / "run" / "snapshot.pt.lock"));
}

TEST_CASE("slot lock: a rank 0 its group went on without (frozen, the run now in a later rendezvous round) loses the "
          "slot: the later round takes the lock over and resumes, the old one writes nothing after it thaws",
          "[trainer][process][slotlock]") {
  // Issue 58: a store host that also ran rank 0 froze for 70 s; the others re-formed without it, but
  // every new round failed at the slot's lock (the frozen rank 0 still held it) until no restart was
  // left; frozen 20 s, it thawed and wrote a snapshot after the group had removed it. Here the two
  // rounds' rank 0 are ctorch-train processes of one run id, given their rounds as ctorchrun gives
  // them (CTORCH_RDZV_ROUND).
  TempDir dir("slot-lock-fence");
  const fs::path slot = dir / "run" / "snapshot.pt";
  SpawnOptions first = trainAlone(dir.path(), slowToy("1", "200"), std::chrono::seconds(300));
  first.setEnv["TORCHELASTIC_RUN_ID"] = "fenced-run";
  first.setEnv["CTORCH_RDZV_ROUND"] = "0";
  Process old(first);
  // It holds the lock and has written a snapshot; then its node freezes (it keeps the lock).
  REQUIRE(waitForOutput(old, std::regex("snapshot written|epoch 1/200"), std::chrono::seconds(120)));
  for (int i = 0; i < 2400 && !(fs::exists(slot) && fs::exists(slot.string() + ".lock")); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(fs::exists(slot));
  REQUIRE(::kill(old.pid(), SIGSTOP) == 0);
  CHECK_THAT(ctorch::test::readFile(slot.string() + ".lock"), Catch::Contains("run=fenced-run round=0 pid="));

  SpawnOptions second = trainAlone(dir.path(), slowToy("1", "2"), std::chrono::seconds(300));
  second.setEnv["TORCHELASTIC_RUN_ID"] = "fenced-run";
  second.setEnv["CTORCH_RDZV_ROUND"] = "1";
  const auto r = ctorch::test::run(second);
  INFO(show(r));
  CHECK(r.ok());
  CHECK_THAT(r.output, Catch::Contains("an earlier round of this run that the group went on without: taking the lock "
                                       "over for round 1"));
  CHECK_THAT(r.output, Catch::Contains("resuming from"));
  // It left its line: the old holder, should it wake, must find the later round there.
  CHECK_THAT(ctorch::test::readFile(slot.string() + ".lock"), Catch::Contains("run=fenced-run round=1 pid="));
  const std::string written = ctorch::test::readFile(slot);

  // The old rank 0 thaws and goes on training: its next save is refused before it touches a file,
  // and it stops (a failed write); the slot holds what round 1 wrote, byte for byte.
  REQUIRE(::kill(old.pid(), SIGCONT) == 0);
  const auto o = old.wait();
  INFO(show(o));
  CHECK(o.exitCode == ctorch::contract::kExitWriteFailed);
  // Refused by the fence; or, had it frozen inside a write past the fence's last check, its temporary
  // file was removed by round 1's first write and the rename fails: either way nothing of it lands.
  const bool fenced = o.output.find("is held by round 1 of this run") != std::string::npos &&
                      o.output.find("writes nothing more") != std::string::npos;
  CHECK((fenced || o.output.find("No such file or directory") != std::string::npos));
  CHECK(ctorch::test::readFile(slot) == written);
  for (const auto& entry : fs::directory_iterator(dir / "run"))
    CHECK(entry.path().filename().string().find(".tmp-") == std::string::npos);  // nothing of its left behind
}
