// The agent's policy as a pure state machine: no processes, no clock.
#include "ctorch_catch.hpp"

#include "ctorch/launcher/group_monitor.hpp"

#include <csignal>

using namespace ctorch::launcher;
using namespace std::chrono_literals;

namespace {

WorkerExit exitOf(int localRank, ExitStatus s, int atMs = 0) {
  WorkerExit e;
  e.localRank = localRank;
  e.pid = 1000 + localRank;
  e.status = s;
  e.time = std::chrono::system_clock::time_point(std::chrono::milliseconds(atMs));
  return e;
}

} // namespace

TEST_CASE("group monitor: all workers succeed / nothing is signalled") {
  GroupMonitor m(3, 5s);
  for (int r = 0; r < 3; ++r) {
    auto a = m.onWorkerExit(exitOf(r, ExitStatus::exited(0)));
    CHECK_FALSE(a.signalWorkers);
    CHECK_FALSE(a.killWorkers);
  }
  CHECK(m.outcome().kind == GroupOutcome::Kind::Succeeded);
}

TEST_CASE("group monitor: the first failure stops the others with SIGTERM and arms the grace") {
  GroupMonitor m(3, 5s);
  m.onWorkerExit(exitOf(0, ExitStatus::exited(0)));
  auto a = m.onWorkerExit(exitOf(2, ExitStatus::killed(SIGSEGV), 10));
  REQUIRE(a.signalWorkers);
  CHECK(*a.signalWorkers == SIGTERM);
  REQUIRE(a.armGrace);
  CHECK(*a.armGrace == 5s);
  m.noteStopSent(std::chrono::system_clock::time_point(20ms));
  auto b = m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGTERM), 30));
  CHECK_FALSE(b.signalWorkers);  // no second stop
  auto o = m.outcome();
  CHECK(o.kind == GroupOutcome::Kind::Failed);
  REQUIRE(o.failures.size() == 1);
  CHECK(o.failures[0].localRank == 2);  // the root cause
  REQUIRE(o.stopped.size() == 1);
  CHECK(o.stopped[0].localRank == 1);
}

TEST_CASE("group monitor: a failure that happened before the stop was sent is a failure too") {
  GroupMonitor m(3, 5s);
  m.onWorkerExit(exitOf(0, ExitStatus::exited(3), 10));
  m.noteStopSent(std::chrono::system_clock::time_point(50ms));
  m.onWorkerExit(exitOf(1, ExitStatus::exited(4), 12));   // died on its own, reported late
  m.onWorkerExit(exitOf(2, ExitStatus::exited(143), 60)); // answered our SIGTERM
  auto o = m.outcome();
  REQUIRE(o.failures.size() == 2);
  CHECK(o.failures[0].localRank == 0);  // still the root cause: observed first
  CHECK(o.failures[1].localRank == 1);
  CHECK(o.stopped.size() == 1);
}

TEST_CASE("group monitor: grace expiry kills once") {
  GroupMonitor m(2, 1s);
  m.onWorkerExit(exitOf(0, ExitStatus::exited(1)));
  CHECK(m.onGraceExpired().killWorkers);
  CHECK_FALSE(m.onGraceExpired().killWorkers);
}

TEST_CASE("group monitor: a worker that fails on its own while the group stops is a failure, not 'stopped'") {
  GroupMonitor m(4, 10s);
  m.onWorkerExit(exitOf(0, ExitStatus::exited(3), 10));
  m.noteStopSent(std::chrono::system_clock::time_point{} + 20ms);
  m.onWorkerExit(exitOf(1, ExitStatus::exited(1), 40));              // its own error, after the stop
  m.onWorkerExit(exitOf(2, ExitStatus::killed(SIGTERM), 40));        // our SIGTERM
  m.onWorkerExit(exitOf(3, ExitStatus::exited(75), 50));             // saved its state on our SIGTERM
  auto o = m.outcome();
  REQUIRE(o.failures.size() == 2);
  CHECK(o.failures[0].localRank == 0);  // still the root cause
  CHECK(o.failures[1].localRank == 1);
  REQUIRE(o.stopped.size() == 2);
  CHECK(o.stopped[0].localRank == 2);
  CHECK(o.stopped[1].localRank == 3);
}

TEST_CASE("group monitor: grace expiry while running does nothing") {
  GroupMonitor m(2, 1s);
  CHECK_FALSE(m.onGraceExpired().killWorkers);
}

TEST_CASE("group monitor: a signal is forwarded as is - a second one kills - outcome interrupted") {
  GroupMonitor m(2, 10s);
  const auto t0 = std::chrono::steady_clock::time_point{} + 100s;
  auto a = m.onSignal(SIGINT, t0);
  REQUIRE(a.signalWorkers);
  CHECK(*a.signalWorkers == SIGINT);
  CHECK(a.armGrace);
  auto b = m.onSignal(SIGINT, t0 + kDuplicateStopWindow + 500ms);  // a deliberate second Ctrl-C
  CHECK(b.killWorkers);
  CHECK_FALSE(b.duplicateSignal);
  m.onWorkerExit(exitOf(0, ExitStatus::killed(SIGINT)));
  m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL)));
  auto o = m.outcome();
  CHECK(o.kind == GroupOutcome::Kind::Interrupted);
  CHECK(o.signal == SIGINT);
  CHECK(o.failures.empty());
}

TEST_CASE("group monitor: copies of one stop within the window are one stop - no second signal, no kill") {
  GroupMonitor m(2, 10s);
  const auto t0 = std::chrono::steady_clock::time_point{} + 100s;
  auto a = m.onSignal(SIGTERM, t0);
  REQUIRE(a.signalWorkers);
  // `timeout` signals ctorchrun and then its group; Slurm signals the tree while srun forwards.
  for (auto later : {0ms, 1ms, 300ms, kDuplicateStopWindow - 1ms}) {
    auto b = m.onSignal(later == 300ms ? SIGINT : SIGTERM, t0 + later);
    CHECK(b.duplicateSignal);
    CHECK_FALSE(b.signalWorkers);
    CHECK_FALSE(b.killWorkers);
    CHECK_FALSE(b.armGrace);
  }
  m.onWorkerExit(exitOf(0, ExitStatus::exited(75)));
  m.onWorkerExit(exitOf(1, ExitStatus::exited(75)));
  auto o = m.outcome();
  CHECK(o.kind == GroupOutcome::Kind::Interrupted);
  CHECK(o.signal == SIGTERM);
  // The grace period still ends in SIGKILL for workers that do not stop.
  CHECK(m.onGraceExpired().killWorkers);
}

TEST_CASE("group monitor: a signal during a failure stop makes the outcome an interruption") {
  GroupMonitor m(2, 10s);
  m.onWorkerExit(exitOf(0, ExitStatus::exited(2)));
  auto a = m.onSignal(SIGTERM, std::chrono::steady_clock::time_point{} + 100s);
  CHECK(a.signalWorkers);
  auto o = m.outcome();
  CHECK(o.kind == GroupOutcome::Kind::Interrupted);
  CHECK(o.failures.size() == 1);
}

TEST_CASE("group monitor: rendezvous events") {
  SECTION("membership change: re-rendezvous, not a failure") {
    GroupMonitor m(2, 1s);
    auto a = m.onRendezvousEvent({RendezvousEventKind::MembershipChanged, "node 3 joined"});
    CHECK(a.signalWorkers);
    CHECK(m.outcome().kind == GroupOutcome::Kind::Rerendezvous);
  }
  SECTION("remote failure: counted as a failure") {
    GroupMonitor m(2, 1s);
    m.onRendezvousEvent({RendezvousEventKind::RemoteFailure, "node 1 failed"});
    auto o = m.outcome();
    CHECK(o.kind == GroupOutcome::Kind::Failed);
    CHECK(o.reason == "node 1 failed");
  }
  SECTION("the rendezvous gave up") {
    GroupMonitor m(2, 1s);
    m.onRendezvousEvent({RendezvousEventKind::Failed, "below min nodes"});
    CHECK(m.outcome().kind == GroupOutcome::Kind::RendezvousFailed);
  }
  SECTION("events during a stop change nothing") {
    GroupMonitor m(2, 1s);
    m.onWorkerExit(exitOf(0, ExitStatus::exited(1)));
    auto a = m.onRendezvousEvent({RendezvousEventKind::MembershipChanged, "x"});
    CHECK_FALSE(a.signalWorkers);
    CHECK(m.outcome().kind == GroupOutcome::Kind::Failed);
  }
}

TEST_CASE("group monitor: a lost peer shortens the grace period but never lengthens it") {
  GroupMonitor m(2, std::chrono::milliseconds(30000));
  auto a = m.onRendezvousEvent(RendezvousEvent{RendezvousEventKind::MembershipChanged, "peer lost",
                                               std::chrono::milliseconds(5000)});
  REQUIRE(a.armGrace);
  CHECK(a.armGrace->count() == 5000);
  CHECK(a.signalWorkers == SIGTERM);
  GroupMonitor n(2, std::chrono::milliseconds(1000));
  auto b = n.onRendezvousEvent(RendezvousEvent{RendezvousEventKind::Failed, "cut off", std::chrono::milliseconds(5000)});
  REQUIRE(b.armGrace);
  CHECK(b.armGrace->count() == 1000);
  // Control: without a grace in the event, --shutdown-timeout.
  GroupMonitor o(2, std::chrono::milliseconds(30000));
  auto c = o.onRendezvousEvent(RendezvousEvent{RendezvousEventKind::MembershipChanged, "node waits", std::nullopt});
  CHECK(c.armGrace->count() == 30000);
}

TEST_CASE("group monitor: in-place recovery replaces a failed worker alone while replacements are left") {
  GroupMonitor m(2, 5s, /*replacements=*/2);
  auto a = m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL), 10));
  REQUIRE(a.replaceWorker);
  CHECK(*a.replaceWorker == 1);
  CHECK_FALSE(a.signalWorkers);  // the survivors are not touched
  CHECK_FALSE(m.stopping());
  auto b = m.onWorkerExit(exitOf(0, ExitStatus::exited(1), 20));
  REQUIRE(b.replaceWorker);
  CHECK(*b.replaceWorker == 0);
  CHECK(m.replacementsUsed() == 2);
  // The third failure finds none left: torchrun's policy, the group stops.
  auto c = m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGSEGV), 30));
  CHECK_FALSE(c.replaceWorker);
  REQUIRE(c.signalWorkers);
  CHECK(*c.signalWorkers == SIGTERM);
  m.noteStopSent(std::chrono::system_clock::time_point(35ms));
  m.onWorkerExit(exitOf(0, ExitStatus::killed(SIGTERM), 40));
  auto o = m.outcome();
  CHECK(o.kind == GroupOutcome::Kind::Failed);
  REQUIRE(o.failures.size() == 1);
  CHECK(o.failures[0].localRank == 1);
  CHECK(m.replaced().size() == 2);  // repaired, not failures of the group
}

TEST_CASE("group monitor: a survivor that ends without joining a pending re-form makes the group restart (issue 28.1)") {
  GroupMonitor m(2, 5s, /*replacements=*/3);
  REQUIRE(m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL), 10)).replaceWorker);
  CHECK(m.reformPending());
  auto a = m.onWorkerExit(exitOf(0, ExitStatus::exited(1), 20), true, /*joinedReform=*/false);
  CHECK_FALSE(a.replaceWorker);
  REQUIRE(a.signalWorkers);
  m.noteStopSent(std::chrono::system_clock::time_point(25ms));
  m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGTERM), 30));  // the replacement, stopped
  auto o = m.outcome();
  CHECK(o.kind == GroupOutcome::Kind::Failed);
  CHECK(o.inPlaceFellBack);
  REQUIRE(o.failures.size() == 1);
  CHECK(o.failures[0].localRank == 0);
  CHECK(m.replaced().size() == 1);

  // Once the group re-formed, a later failure of the same survivor is replaced as any failure.
  GroupMonitor n(2, 5s, 3);
  REQUIRE(n.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL))).replaceWorker);
  n.noteReformed();
  CHECK_FALSE(n.reformPending());
  CHECK(n.onWorkerExit(exitOf(0, ExitStatus::exited(1)), true, false).replaceWorker);

  // The replacement itself failing while pending is its own failure, replaced while budget lasts.
  GroupMonitor r(2, 5s, 3);
  REQUIRE(r.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL))).replaceWorker);
  CHECK(r.onWorkerExit(exitOf(1, ExitStatus::exited(4)), true, false).replaceWorker);
  CHECK_FALSE(r.outcome().inPlaceFellBack);

  // Another node's failure while this node's replacement waits: the same fault, one restart.
  GroupMonitor q(2, 5s, 3);
  REQUIRE(q.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL))).replaceWorker);
  q.onRendezvousEvent(RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 1 failed", std::nullopt});
  CHECK(q.outcome().inPlaceFellBack);
  // Control: no replacement pending, no fallback.
  GroupMonitor c(2, 5s, 3);
  c.onRendezvousEvent(RendezvousEvent{RendezvousEventKind::RemoteFailure, "node 1 failed", std::nullopt});
  CHECK_FALSE(c.outcome().inPlaceFellBack);
}

TEST_CASE("group monitor: with replacements the group succeeds once every current worker exited 0") {
  GroupMonitor m(2, 5s, 1);
  REQUIRE(m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL))).replaceWorker);
  m.onWorkerExit(exitOf(0, ExitStatus::exited(0)));
  // Not over yet: the replacement still runs (the process context is not finished; the outcome
  // counts it).
  CHECK(m.exitedCount() == 2);
  m.onWorkerExit(exitOf(1, ExitStatus::exited(0)));
  CHECK(m.outcome().kind == GroupOutcome::Kind::Succeeded);
}

TEST_CASE("group monitor: exit 75 (stopped on request) is never replaced in place") {
  GroupMonitor m(2, 5s, 3);
  auto a = m.onWorkerExit(exitOf(0, ExitStatus::exited(75)));
  CHECK_FALSE(a.replaceWorker);
  CHECK(a.signalWorkers);
}

TEST_CASE("group monitor: without replacements (--recovery restart) nothing is replaced") {
  GroupMonitor m(2, 5s);
  auto a = m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL)));
  CHECK_FALSE(a.replaceWorker);
  CHECK(a.signalWorkers);
}
