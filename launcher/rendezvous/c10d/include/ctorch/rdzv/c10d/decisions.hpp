// The c10d dynamic rendezvous as pure decisions: each function looks at the shared state and at
// this node's view (its identity, the settings, the time now and the time left) and returns the
// next action together with the new state to compare-and-set. No store, no clock, no sleeping:
// the Executor (executor.hpp) does the I/O. Semantics follow torch's DynamicRendezvousHandler
// (join → last call once MIN joined → close at MAX or when the last call ends; late nodes wait
// for the next round; expired heartbeats remove nodes), with stable node ranks (see assignRanks).
#pragma once

#include "ctorch/rdzv/c10d/settings.hpp"
#include "ctorch/rdzv/c10d/state.hpp"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ctorch::rdzv::c10d {

enum class Action {
  Finish,               // the operation is done (joined a complete round, left, closed, fresh heartbeat)
  Wait,                 // nothing to write now: read the state again a little later
  RemoveDead,           // drop nodes whose heartbeat expired (from every list)
  Join,                 // add this node to the participants of the open round
  OpenLastCall,         // MIN nodes joined: start the last-call window
  CloseRound,           // MAX joined or the last call ended: assign ranks, mark the round complete
  AddToWaitList,        // the round is running with room: ask for a new round (scale up)
  AddToRedundancyList,  // the round is running and full: wait as a spare
  LeaveRound,           // remove this node from the participants (before re-joining, or on timeout)
  Leave,                // leave the rendezvous for good (shutdown): out of every list
  LeaveWaitList,        // give up waiting (timeout)
  LeaveRedundancyList,  // room appeared: stop being a spare, then ask for a new round
  KeepAlive,            // refresh this node's heartbeat
  ReportFailure,        // record that this node's workers failed in the round (counted restart)
  MarkClosed,           // close the rendezvous for good (job finished / shut down)
  FailTimeout,          // give up: RendezvousTimeout with the reason
  FailClosed,           // give up: RendezvousClosed with the reason
  ExitRedundant,        // a spare leaves quietly: the job was closed without needing it
};

const char* toString(Action action);

// What this node knows when it decides.
struct NodeView {
  NodeInfo self;
  Settings settings;
  Timestamp now;                           // wall clock (compared with the state's timestamps)
  std::chrono::milliseconds remaining{0};  // until this operation's deadline; negative when past
};

struct Decision {
  Action action = Action::Wait;
  std::optional<State> next;  // the state to compare-and-set, for the actions that write
  std::string reason;         // one line for the log, or the error message for Fail*

  bool writes() const { return next.has_value(); }
};

// How long after its deadline a node still tries to take itself out of the round before failing
// (torch's rollback period), so that the others do not wait for its heartbeat to expire.
inline constexpr std::chrono::milliseconds kRollbackPeriod{5000};

// Join the next round (torch's _RendezvousJoinOp). `current` is nullopt when no state exists yet.
// Throws RendezvousStateError if the state belongs to another run id.
Decision decideJoin(const std::optional<State>& current, const NodeView& view);
// Leave the previous round before joining the next (torch's _RendezvousExitOp). Leaving a
// complete round also puts the node on the wait list, so that the next round expects it and can
// close as soon as every expected node is back (see `State::expected`).
Decision decideExit(const std::optional<State>& current, const NodeView& view);
// Leave the rendezvous for good (shutdown without closing it): removed from every list, so the
// others re-form without this node, if enough remain.
Decision decideLeave(const std::optional<State>& current, const NodeView& view);
// This node's workers failed in `round`: record the failure and count one restart for the job,
// unless the round moved on or a failure was already recorded for it.
Decision decideReportFailure(const std::optional<State>& current, const NodeView& view,
                             std::int64_t round, const std::string& reason);
// Remove these nodes now (the store host saw their connections drop: killed agents), if they are
// still in the rendezvous. `why` goes into the log line.
Decision decideRemove(const std::optional<State>& current, const NodeView& view,
                      const std::vector<std::string>& ids, const std::string& why);
// Periodic heartbeat; also removes expired nodes (torch's _RendezvousKeepAliveOp + sanitize).
Decision decideKeepAlive(const std::optional<State>& current, const NodeView& view);
// Close the rendezvous (torch's _RendezvousCloseOp, used on shutdown).
Decision decideClose(const std::optional<State>& current, const NodeView& view);

// The scalable join (executor.hpp). The node that writes for an open round: its participant
// that joined first; nullopt when the round is complete, closed or has no participant yet (then
// the node holding the first pending announcement admits).
std::optional<std::string> designatedWriter(const std::optional<State>& current);
// Admits the announcements numbered `state.announced + 1 .. lastNumber` (`batch`: those that
// could be read, in number order) into the open round in one write: each one for this round whose
// node is not yet a participant joins, in order, while there is room (as decideJoin's Join: off
// the wait list, a join sequence number, a heartbeat at `view.now`); the others are consumed
// (a stale round's: its node announces again; a full round's: its node becomes a spare). Then,
// as the designated writer would next: CloseRound at MAX or once every expected node joined,
// OpenLastCall at MIN. The action is Join (or CloseRound / OpenLastCall when one applies);
// `next.announced == lastNumber`. Finish (no write) if nothing is pending or the round is not open.
Decision admitAnnounced(const std::optional<State>& current, const NodeView& view,
                        const std::vector<Announcement>& batch, std::int64_t lastNumber);

// Nodes (any list) whose last heartbeat is older than `expiry` at `now`.
std::vector<std::string> expiredNodes(const State& state, Timestamp now, std::chrono::milliseconds expiry);
// The state without these nodes. A complete round left with no participant moves to the next
// round (which expects the nodes then on the wait list); an open round that falls below MIN
// loses its last-call deadline (torch's epilogue).
State removeNodes(const State& state, const std::vector<std::string>& ids, int minNodes);

// Node ranks for the participants of a closing round, in the order of `participants`:
//  1. a node that requested rank r < N (--node-rank, SLURM_NODEID) gets r, unless a node that
//     joined earlier requested the same r;
//  2. a node that had rank r < N in its previous round keeps r if still free;
//  3. every other node takes the lowest free rank, in order of joining.
// No hostname sorting (torch sorts node descriptors, PyTorch issue #137402).
std::vector<int> assignRanks(const std::vector<Participant>& participants);

// This node's place in a complete round.
struct NodeSlot {
  std::string id, host, addr;
  int nodeRank = 0;
  int nproc = 1;
  int rankBase = 0;  // global rank of its local rank 0: sum of nproc of the nodes ranked below
  std::optional<int> storePort;  // the workers' store it hosts (used when it is node rank 0)
  std::optional<int> standbyPort;  // its standby rendezvous store (store failover)
  bool storeHost = false;          // its agent serves the rendezvous store
};

struct RoundResult {
  std::int64_t round = 0;
  int nodeRank = 0;        // GROUP_RANK
  int nodeCount = 0;       // GROUP_WORLD_SIZE
  int localWorldSize = 1;  // this node's nproc
  int rankBase = 0;        // RANK of local rank i is rankBase + i
  int worldSize = 0;       // WORLD_SIZE: sum of every node's nproc
  std::vector<NodeSlot> nodes;  // by node rank
  std::vector<std::string> participantIds;  // by node rank
  std::optional<int> requestedRank;  // what this node asked for, to log when it differs
  std::int64_t restartCount = 0;     // counted restarts before this round (the same on every node)
};

// Throws RendezvousError if the round is not complete or `selfId` is not in it.
RoundResult roundResult(const State& state, std::string_view selfId);

// Is the round this node runs in still the one it joined?
enum class RoundStatus {
  Healthy,       // nothing changed
  NodesWaiting,  // nodes wait to join and there is room: re-rendezvous at the next step boundary
  PeerFailed,    // another node's workers failed in this round: restart (counted once, by the job)
  PeerLost,      // a participant left or was removed (dead): stop workers, re-rendezvous now
  Removed,       // this node is no longer a participant (its heartbeat expired): re-rendezvous
  Superseded,    // the state moved on to another round without this node
  Closed,        // the rendezvous was closed (the job is over)
};
const char* toString(RoundStatus status);

struct RoundAssessment {
  RoundStatus status = RoundStatus::Healthy;
  std::vector<std::string> nodes;  // the lost or waiting nodes
  std::string reason;
};

RoundAssessment assessRound(const std::optional<State>& current, const RoundResult& joined,
                            std::string_view selfId, const Settings& settings);

} // namespace ctorch::rdzv::c10d
