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
  m.noteReformed();  // every rank built the re-formed group: the next failure is a fault of its own
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

  // A second worker killed or crashed while the re-form is pending is a loss of its own (two workers
  // lost at once): replaced too, no fallback; an uncaught exception's SIGABRT still falls back.
  for (int sig : {SIGKILL, SIGSEGV, SIGBUS}) {
    GroupMonitor k(3, 5s, 3);
    REQUIRE(k.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL), 10)).replaceWorker);
    auto b = k.onWorkerExit(exitOf(0, ExitStatus::killed(sig), 12), true, /*joinedReform=*/false);
    CHECK(b.replaceWorker == 0);
    CHECK_FALSE(b.signalWorkers);
    CHECK_FALSE(k.outcome().inPlaceFellBack);
    CHECK(k.replaced().size() == 2);
  }
  GroupMonitor abort(2, 5s, 3);
  REQUIRE(abort.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL), 10)).replaceWorker);
  CHECK_FALSE(abort.onWorkerExit(exitOf(0, ExitStatus::killed(SIGABRT), 20), true, false).replaceWorker);
  CHECK(abort.outcome().inPlaceFellBack);

  // Once the group re-formed, a later failure of the same survivor is replaced as any failure.
  GroupMonitor n(2, 5s, 3);
  REQUIRE(n.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL))).replaceWorker);
  n.noteReformed();
  CHECK_FALSE(n.reformPending());
  CHECK(n.onWorkerExit(exitOf(0, ExitStatus::exited(1)), true, false).replaceWorker);

  // The replacement itself killed while pending is a loss of its own, replaced while budget lasts.
  GroupMonitor r(2, 5s, 3);
  REQUIRE(r.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL))).replaceWorker);
  CHECK(r.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL)), true, false).replaceWorker);
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

TEST_CASE("group monitor: a rank whose re-form fails restarts the group for this failure, not a second replacement "
          "(issue 58.3)") {
  // A survivor that joined the re-form and failed before every rank built the new group (its build
  // failed: a store an outsider filled to its cap), or the replacement failing the same way:
  // replacing it would meet the same re-form and cost a restart each time. One group restart.
  for (const bool survivor : {true, false}) {
    GroupMonitor m(2, 5s, /*replacements=*/3);
    REQUIRE(m.onWorkerExit(exitOf(1, ExitStatus::killed(SIGKILL), 10)).replaceWorker);
    auto a = m.onWorkerExit(exitOf(survivor ? 0 : 1, ExitStatus::exited(1), 20), true, /*joinedReform=*/true);
    CHECK_FALSE(a.replaceWorker);
    REQUIRE(a.signalWorkers);
    m.noteStopSent(std::chrono::system_clock::time_point(25ms));
    m.onWorkerExit(exitOf(survivor ? 1 : 0, ExitStatus::killed(SIGTERM), 30));
    auto o = m.outcome();
    CHECK(o.kind == GroupOutcome::Kind::Failed);
    CHECK(o.inPlaceFellBack);
    CHECK(o.fellBackInReform == survivor);  // a survivor's re-form failed (said in the agent's line)
    CHECK(m.replacementsUsed() == 1);
  }
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

// ---- the run's restart policy: what an attempt's outcome leads to -------------------------------

namespace {

RendezvousInfo twoNodes(int nodeRank) {
  RendezvousInfo info;
  info.numNodes = 2;
  info.nodeRank = nodeRank;
  info.nprocPerNode = {2, 2};
  info.computeRanks();
  return info;
}

GroupOutcome failedWith(std::vector<WorkerExit> failures, std::string reason = {}) {
  GroupOutcome o;
  o.kind = GroupOutcome::Kind::Failed;
  o.failures = std::move(failures);
  o.reason = std::move(reason);
  return o;
}

using Next = AttemptDecision::Next;
using Note = AttemptDecision::Note;

} // namespace

TEST_CASE("restart policy: a failure restarts while --max-restarts allows, then exits with the root cause's code") {
  RestartPolicy p(2, false);
  const RendezvousInfo info = twoNodes(1);
  for (int restart = 1; restart <= 2; ++restart) {
    auto d = p.decide(failedWith({exitOf(1, ExitStatus::exited(3))}), info, false);
    CHECK(d.next == Next::Restart);
    CHECK(d.note == Note::Restart);
    CHECK(d.reportFailure);
    CHECK(d.why == "rank 3 exit 3");  // global rank: node 1's local rank 1
    CHECK(p.restartCount() == restart);
  }
  auto d = p.decide(failedWith({exitOf(1, ExitStatus::exited(3))}), info, false);
  CHECK(d.next == Next::Exit);
  CHECK(d.note == Note::NoRestartsLeft);
  CHECK(d.exitCode == 3);
  CHECK(d.leave == AgentOutcome::Failed);
  CHECK(d.summary);
  CHECK(d.reportFailure);
  CHECK(p.restartCount() == 2);
  // A root cause that exited 0 (it vanished) still fails the job with 1; a signal gives 128+N.
  RestartPolicy none(0, false);
  CHECK(none.decide(failedWith({exitOf(0, ExitStatus::exited(0))}), info, false).exitCode == 1);
  auto killed = none.decide(failedWith({exitOf(0, ExitStatus::killed(SIGSEGV))}), info, false);
  CHECK(killed.exitCode == 128 + SIGSEGV);
  CHECK(killed.note == Note::None);  // --max-restarts 0: the summary says it all
}

TEST_CASE("restart policy: another node's failure is counted but not reported back, and exits 1 when none are left") {
  RestartPolicy p(1, false);
  auto d = p.decide(failedWith({}, "node 0 failed"), twoNodes(1), false);
  CHECK(d.next == Next::Restart);
  CHECK_FALSE(d.reportFailure);
  CHECK(d.why == "node 0 failed");
  auto e = p.decide(failedWith({}, "node 0 failed"), twoNodes(1), false);
  CHECK(e.next == Next::Exit);
  CHECK(e.note == Note::NoRestartsLeft);
  CHECK(e.exitCode == 1);
  CHECK_FALSE(e.summary);
  CHECK_FALSE(e.reportFailure);
  RestartPolicy none(0, false);
  CHECK(none.decide(failedWith({}, "node 0 failed"), twoNodes(1), false).note == Note::NoRestartsAllowed);
}

TEST_CASE("restart policy: exit 74 and an error that says 'never retry' spend no restart") {
  RestartPolicy p(3, false);
  auto write = p.decide(failedWith({exitOf(0, ExitStatus::exited(74))}), twoNodes(0), false);
  CHECK(write.next == Next::Exit);
  CHECK(write.note == Note::WriteFailed);
  CHECK(write.exitCode == 74);
  CHECK(write.summary);
  auto never = p.decide(failedWith({exitOf(0, ExitStatus::exited(2))}), twoNodes(0), true);
  CHECK(never.next == Next::Exit);
  CHECK(never.note == Note::RetryNever);
  CHECK(never.exitCode == 2);
  CHECK(p.restartCount() == 0);
  // With no restart left anyway, nothing more is said about it.
  RestartPolicy none(0, false);
  CHECK(none.decide(failedWith({exitOf(0, ExitStatus::exited(2))}), twoNodes(0), true).note == Note::None);
}

TEST_CASE("restart policy: preemption - every worker exited 75 after a stop signal - exits 75") {
  GroupOutcome o;
  o.kind = GroupOutcome::Kind::Interrupted;
  o.signal = SIGUSR1;
  o.stopped = {exitOf(0, ExitStatus::exited(75))};
  o.failures = {exitOf(1, ExitStatus::exited(75))};  // exited before the agent read its copy of the signal
  CHECK(preempted(o));
  RestartPolicy p(3, false);
  auto d = p.decide(o, twoNodes(0), false);
  CHECK(d.next == Next::Exit);
  CHECK(d.note == Note::Preempted);
  CHECK(d.exitCode == 75);
  CHECK(d.leave == AgentOutcome::Interrupted);
  CHECK_FALSE(d.summary);
  // A worker that really failed keeps the signal's code, with a summary; so does a group that
  // ended with nothing to show.
  o.failures = {exitOf(1, ExitStatus::exited(1))};
  CHECK_FALSE(preempted(o));
  auto e = p.decide(o, twoNodes(0), false);
  CHECK(e.exitCode == 128 + SIGUSR1);
  CHECK(e.summary);
  GroupOutcome empty;
  empty.kind = GroupOutcome::Kind::Interrupted;
  empty.signal = SIGTERM;
  CHECK_FALSE(preempted(empty));
  CHECK(p.decide(empty, twoNodes(0), false).exitCode == 128 + SIGTERM);
  CHECK(p.restartCount() == 0);  // never a restart after a stop signal
}

TEST_CASE("restart policy: success, membership changes and a failed rendezvous") {
  RestartPolicy p(1, false);
  GroupOutcome ok;
  auto s = p.decide(ok, twoNodes(0), false);
  CHECK(s.next == Next::Exit);
  CHECK(s.exitCode == 0);
  CHECK(s.leave == AgentOutcome::Succeeded);
  GroupOutcome moved;
  moved.kind = GroupOutcome::Kind::Rerendezvous;
  CHECK(p.decide(moved, twoNodes(0), false).next == Next::Rerendezvous);
  CHECK(p.restartCount() == 0);  // not counted
  GroupOutcome gaveUp;
  gaveUp.kind = GroupOutcome::Kind::RendezvousFailed;
  auto g = p.decide(gaveUp, twoNodes(0), false);
  CHECK(g.exitCode == 3);
  CHECK(g.leave == AgentOutcome::Interrupted);
  CHECK(g.note == Note::RendezvousFailed);
}

TEST_CASE("restart policy: in-place replacements count against --max-restarts, and a shared count wins") {
  RestartPolicy p(3, true);
  CHECK(p.replacementsAllowed() == 3);
  p.noteReplacement();
  CHECK(p.restartsUsed() == 1);
  CHECK(p.replacementsAllowed() == 2);
  p.adoptRestartCount(2);  // the c10d backend's count
  CHECK(p.restartCount() == 2);
  CHECK(p.replacementsAllowed() == 0);
  p.adoptRestartCount(std::nullopt);  // a backend without one: the local count stays
  CHECK(p.restartCount() == 2);
  // The budget is used up: the next failure exits.
  CHECK(p.decide(failedWith({exitOf(0, ExitStatus::exited(1))}), twoNodes(0), false).next == Next::Exit);
  RestartPolicy off(3, false);
  CHECK(off.replacementsAllowed() == 0);  // --recovery restart
}

TEST_CASE("restart policy: an in-place fallback makes the replaced worker the root cause, for that failure only "
          "(issue 58.3)") {
  RestartPolicy p(4, true);
  p.noteReplacement();
  GroupOutcome o = failedWith({exitOf(0, ExitStatus::exited(1))});
  o.inPlaceFellBack = true;
  const std::vector<WorkerExit> replaced = {exitOf(1, ExitStatus::killed(SIGKILL))};
  auto f = p.fallBack(o, replaced);
  REQUIRE(f);
  CHECK(f->firstTime);
  CHECK_FALSE(f->inReform);
  CHECK(f->replaced.localRank == 1);
  REQUIRE(f->survivor);
  CHECK(f->survivor->localRank == 0);
  REQUIRE(o.failures.size() == 2);
  CHECK(o.failures[0].localRank == 1);  // the root cause
  CHECK(p.replacementsUsed() == 0);     // its restart is the group's: one fault, one restart
  auto d = p.decide(o, twoNodes(0), false);
  CHECK(d.next == Next::Restart);
  CHECK(d.why == "rank 1 signal 9 (SIGKILL)");
  CHECK(p.restartsUsed() == 1);
  // In-place recovery is not switched off by what a failure suggests: the next group replaces
  // failed workers again, with what is left of --max-restarts.
  CHECK(p.replacementsAllowed() == 3);
  // Later fallbacks are not the first; another node's failure has no local survivor.
  GroupOutcome remote = failedWith({}, "node 1 failed");
  remote.inPlaceFellBack = true;
  p.noteReplacement();
  auto g = p.fallBack(remote, replaced);
  REQUIRE(g);
  CHECK_FALSE(g->firstTime);
  CHECK_FALSE(g->survivor);
  CHECK(remote.failures.empty());
  CHECK(p.replacementsUsed() == 0);
  CHECK(p.replacementsAllowed() == 3);
  // A re-form that failed says so.
  GroupOutcome inReform = failedWith({exitOf(0, ExitStatus::exited(1))});
  inReform.inPlaceFellBack = true;
  inReform.fellBackInReform = true;
  p.noteReplacement();
  auto h = p.fallBack(inReform, replaced);
  REQUIRE(h);
  CHECK(h->inReform);
  // Only what a rank declares turns it off.
  p.turnInPlaceOff();
  CHECK(p.replacementsAllowed() == 0);
  // No fallback without a replacement, or for an outcome that is not a failure.
  GroupOutcome plain = failedWith({exitOf(0, ExitStatus::exited(1))});
  CHECK_FALSE(p.fallBack(plain, replaced));
  o.inPlaceFellBack = true;
  o.kind = GroupOutcome::Kind::Interrupted;
  CHECK_FALSE(p.fallBack(o, replaced));
  o.kind = GroupOutcome::Kind::Failed;
  CHECK_FALSE(p.fallBack(o, {}));
}
