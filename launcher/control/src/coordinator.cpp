// The coordinator's decisions (coordinator.hpp).
#include "ctorch/control/coordinator.hpp"

#include <algorithm>

namespace ctorch::control {

namespace cc = contract::control;

namespace {

constexpr int kMaxWorld = 1 << 20;
constexpr std::int64_t kMaxGraceMs = 3600 * 1000;
// A replacement that has not joined is evicted only after much longer than a silent survivor: it
// starts a process, loads LibTorch and sets its program up, none of which the collectives' timeout
// bounds, and which a loaded machine stretches tenfold (docs/performance.md, "Figures behind
// choices in the code").
constexpr int kStartGraceFactor = 4;
constexpr std::chrono::milliseconds kMinStartGrace{20000};

Message make(Type type) { return cc::message(type); }

// A small non-negative decimal, or -1.
int smallNumber(const std::string& text) {
  if (text.empty() || text.size() > 7) return -1;
  int v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

} // namespace

Coordinator::Coordinator(std::function<void(const std::string&)> log) : log_(std::move(log)) {}

void Coordinator::logOnce(const std::string& kind, const std::string& line) {
  if (logged_.size() < 64 && ++logged_[kind] == 1) logLine(line);
}

void Coordinator::refuse(PeerId peer, const std::string& why, std::vector<Outgoing>& out) {
  Message m = make(Type::kRefused);
  m.text = why.substr(0, cc::kMaxText);
  out.push_back({peer, m, true});
  logOnce("refused: " + why, "refused a control connection: " + why);
}

void Coordinator::welcome(PeerId peer, std::vector<Outgoing>& out) const {
  Message m = make(Type::kWelcome);
  m.generation = generation_;
  out.push_back({peer, m, false});
}

Message Coordinator::capabilityMessage() const {
  Message m = make(Type::kCapability);
  m.value = capability_;
  m.rank = incapableRank_;
  m.text = incapableWhy_;
  return m;
}

void Coordinator::toAgentOf(int rank, Message m, std::vector<Outgoing>& out) const {
  for (const auto& [node, n] : nodes_)
    if (n.peer != 0 && rank >= n.firstRank && rank < n.firstRank + n.count) {
      out.push_back({n.peer, std::move(m), false});
      return;
    }
}

void Coordinator::toAgents(const Message& m, std::vector<Outgoing>& out) const {
  for (const auto& [node, n] : nodes_)
    if (n.peer != 0) out.push_back({n.peer, m, false});
}

// ---- hello -------------------------------------------------------------------------------------------
void Coordinator::hello(PeerId peer, const Message& hello, Clock::time_point, std::vector<Outgoing>& out) {
  if (hello.type != Type::kHello) return refuse(peer, "the first message must be a hello", out);
  Peer p;
  switch (static_cast<cc::Role>(hello.value)) {
    case cc::Role::kAgent: return helloAgent(peer, p, hello, out);
    case cc::Role::kWorker: return helloWorker(peer, p, hello, out);
    case cc::Role::kSpare: return helloSpare(peer, p, hello, out);
  }
  refuse(peer, "unknown role " + std::to_string(hello.value), out);
}

void Coordinator::helloAgent(PeerId peer, Peer& p, const Message& hello, std::vector<Outgoing>& out) {
  const int node = smallNumber(hello.text);
  const auto world = hello.generation;
  const int first = hello.rank;
  const auto count = hello.value2;
  if (node < 0 || world < 1 || world > kMaxWorld || first < 0 || count < 1 || first + count > world)
    return refuse(peer, "an agent's hello names node '" + hello.text.substr(0, 16) + "', ranks " + std::to_string(first) +
                            " + " + std::to_string(count) + " of " + std::to_string(world),
                  out);
  if (world_ == 0) {
    world_ = static_cast<int>(world);
    ranks_.assign(static_cast<std::size_t>(world_), Rank{});
  } else if (world != world_) {
    return refuse(peer, "node " + std::to_string(node) + " says the world has " + std::to_string(world) +
                            " ranks, this group has " + std::to_string(world_),
                  out);
  }
  Node& n = nodes_[node];
  if (n.peer != 0 && n.peer != peer) {
    // The same agent again (it reconnected): the older connection is a dead one.
    Message bye = make(Type::kRefused);
    bye.text = "replaced by a newer connection of the same agent";
    out.push_back({n.peer, bye, true});
    peers_.erase(n.peer);
  }
  n = Node{peer, first, static_cast<int>(count)};
  p.role = Role::kAgent;
  p.node = node;
  p.welcomed = true;
  peers_[peer] = p;
  welcome(peer, out);
  if (capability_ != -1) out.push_back({peer, capabilityMessage(), false});
  for (const auto& [id, s] : peers_)
    if (s.role == Role::kSpare && s.node == node) {
      Message ready = make(Type::kSpareReady);
      ready.text = s.spareId;
      ready.incarnation = s.incarnation;
      out.push_back({peer, ready, false});
    }
}

void Coordinator::helloWorker(PeerId peer, Peer& p, const Message& hello, std::vector<Outgoing>& out) {
  if (hello.rank < 0 || hello.rank >= kMaxWorld || (world_ > 0 && hello.rank >= world_) || hello.incarnation == 0)
    return refuse(peer, "a worker's hello names rank " + std::to_string(hello.rank) + " of a world of " +
                            std::to_string(world_),
                  out);
  std::size_t pending = 0;
  for (const auto& [id, q] : peers_) pending += !q.welcomed;
  if (pending >= maxPending()) return refuse(peer, "too many processes wait to be registered", out);
  p.role = Role::kWorker;
  p.rank = hello.rank;
  p.incarnation = hello.incarnation;
  p.pid = static_cast<long>(hello.value2);
  peers_[peer] = p;
  welcomePending(hello.rank, out);
}

void Coordinator::helloSpare(PeerId peer, Peer& p, const Message& hello, std::vector<Outgoing>& out) {
  const auto space = hello.text.find(' ');
  const int node = space == std::string::npos ? -1 : smallNumber(hello.text.substr(0, space));
  if (node < 0 || hello.incarnation == 0 || space + 1 >= hello.text.size())
    return refuse(peer, "a spare's hello names '" + hello.text.substr(0, 40) + "'", out);
  p.role = Role::kSpare;
  p.node = node;
  p.spareId = hello.text.substr(space + 1);
  p.incarnation = hello.incarnation;
  p.pid = static_cast<long>(hello.value2);
  p.welcomed = true;
  peers_[peer] = p;
  welcome(peer, out);
  const auto pending = pendingAssignments_.find({node, p.spareId, p.incarnation});
  if (pending != pendingAssignments_.end()) {
    // Its agent gave it a rank while it was still starting: it takes it over now.
    const Message assign = pending->second;
    pendingAssignments_.erase(pending);
    return handOver(peer, peers_[peer], assign, out);
  }
  const auto n = nodes_.find(node);
  if (n != nodes_.end() && n->second.peer != 0) {
    Message ready = make(Type::kSpareReady);
    ready.text = p.spareId;
    ready.incarnation = p.incarnation;
    out.push_back({n->second.peer, ready, false});
  }
}

void Coordinator::handOver(PeerId peer, Peer& p, const Message& assign, std::vector<Outgoing>& out) {
  p.role = Role::kWorker;
  p.rank = assign.rank;
  Rank& r = ranks_[static_cast<std::size_t>(assign.rank)];
  if (r.incarnation == p.incarnation) r.peer = peer;
  out.push_back({peer, assign, false});
}

// Workers whose process is now the registered one for `rank` are welcomed and become its peer.
void Coordinator::welcomePending(int rank, std::vector<Outgoing>& out) {
  if (world_ == 0 || rank < 0 || rank >= world_) return;
  Rank& r = ranks_[static_cast<std::size_t>(rank)];
  for (auto& [id, p] : peers_) {
    if (p.welcomed || p.role != Role::kWorker || p.rank != rank || p.incarnation != r.incarnation) continue;
    p.welcomed = true;
    r.peer = id;
    welcome(id, out);
  }
}

// ---- messages ----------------------------------------------------------------------------------------
void Coordinator::message(PeerId peer, const Message& m, Clock::time_point now, std::vector<Outgoing>& out) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.welcomed) {
    refuse(peer, "a message before this process was welcomed", out);
    peers_.erase(peer);
    return;
  }
  Peer& p = it->second;
  if (p.role == Role::kAgent) return fromAgent(p, m, now, out);
  if (p.role == Role::kWorker) return fromWorker(peer, p, m, now, out);
  logOnce("spare message", "ignoring a message from spare " + p.spareId + " that holds no rank yet");
}

void Coordinator::registerProcess(int rank, std::uint64_t incarnation, bool replacement, Clock::time_point now) {
  Rank& r = ranks_[static_cast<std::size_t>(rank)];
  if (r.incarnation == incarnation) return;  // said again (the agent reconnected)
  r.incarnation = incarnation;
  r.registeredAt = now;
  r.peer = 0;
  r.holdsState = false;
  r.phase = replacement ? Phase::kStarting : Phase::kRunning;
}

void Coordinator::fromAgent(Peer& p, const Message& m, Clock::time_point now, std::vector<Outgoing>& out) {
  const Node& n = nodes_[p.node];
  const bool ours = m.rank >= n.firstRank && m.rank < n.firstRank + n.count;
  switch (m.type) {
    case Type::kRegister:
      if (!ours || m.incarnation == 0)
        return logOnce("register", "ignoring node " + std::to_string(p.node) + "'s registration of rank " + std::to_string(m.rank));
      registerProcess(m.rank, m.incarnation, m.value != 0, now);
      welcomePending(m.rank, out);
      return;
    case Type::kAssignSpare: {
      if (!ours || m.incarnation == 0) return logOnce("assign", "ignoring an assignment of rank " + std::to_string(m.rank));
      auto spare = std::find_if(peers_.begin(), peers_.end(), [&](const auto& e) {
        return e.second.role == Role::kSpare && e.second.node == p.node && e.second.spareId == m.text &&
               e.second.incarnation == m.incarnation;
      });
      registerProcess(m.rank, m.incarnation, true, now);
      Message assign = make(Type::kAssign);
      assign.rank = m.rank;
      assign.value = m.value;
      assign.value2 = m.value2;
      if (spare != peers_.end()) return handOver(spare->first, spare->second, assign, out);
      // Not connected yet (a spare started a moment ago, still loading): it gets the rank when
      // it says hello; one that never does is evicted as a replacement that never joins.
      if (pendingAssignments_.size() >= maxPending())
        return logOnce("pending assignments", "too many ranks wait for spares that have not connected");
      pendingAssignments_[{p.node, m.text.substr(0, 64), m.incarnation}] = assign;
      return;
    }
    default:
      logOnce("agent message", "ignoring message type " + std::to_string(static_cast<int>(m.type)) + " from node " +
                                   std::to_string(p.node) + "'s agent");
  }
}

void Coordinator::fromWorker(PeerId peer, Peer& p, const Message& m, Clock::time_point now, std::vector<Outgoing>& out) {
  Rank& r = ranks_[static_cast<std::size_t>(p.rank)];
  if (r.incarnation != p.incarnation || r.peer != peer) {
    // A process that no longer holds its rank (replaced, being killed): what it says changes nothing.
    return logOnce("stale " + std::to_string(p.incarnation), "ignoring rank " + std::to_string(p.rank) +
                                                                  "'s former process (pid " + std::to_string(p.pid) + ")");
  }
  switch (m.type) {
    case Type::kDeclare:
      return declare(p.rank, m, out);
    case Type::kReform: {
      if (m.generation != generation_)
        return logOnce("reform " + std::to_string(p.rank), "ignoring rank " + std::to_string(p.rank) +
                                                               "'s re-form of generation " + std::to_string(m.generation) +
                                                               " (the group is at " + std::to_string(generation_) + ")");
      r.phase = Phase::kWaiting;
      r.holdsState = m.value != 0;
      Message state = make(Type::kRankState);
      state.rank = p.rank;
      state.incarnation = r.incarnation;
      toAgentOf(p.rank, state, out);
      return tryForm(out);
    }
    case Type::kJoin: {
      if (r.phase != Phase::kStarting)
        return logOnce("join " + std::to_string(p.rank), "ignoring a join of rank " + std::to_string(p.rank) +
                                                             ", which is no replacement");
      r.phase = Phase::kJoining;
      r.holdsState = false;
      Message state = make(Type::kRankState);
      state.rank = p.rank;
      state.incarnation = r.incarnation;
      toAgentOf(p.rank, state, out);
      return tryForm(out);
    }
    case Type::kGroupBuilt:
      return built(p.rank, m.generation, out);
    case Type::kEvictSilent:
      if (r.phase != Phase::kWaiting || m.generation != generation_) return;
      return evictSilent(peer, std::chrono::milliseconds(std::clamp<std::int64_t>(m.value, 0, kMaxGraceMs)), now, out);
    default:
      logOnce("worker message", "ignoring message type " + std::to_string(static_cast<int>(m.type)) + " from rank " +
                                    std::to_string(p.rank));
  }
}

void Coordinator::declare(int rank, const Message& m, std::vector<Outgoing>& out) {
  Rank& r = ranks_[static_cast<std::size_t>(rank)];
  r.declared = m.value != 0 ? 1 : 0;
  if (r.declared == 0 && capability_ != 0) {
    capability_ = 0;
    incapableRank_ = rank;
    incapableWhy_ = m.text.substr(0, 200);
    logLine("rank " + std::to_string(rank) + " cannot recover in place: " + incapableWhy_);
    toAgents(capabilityMessage(), out);
    return;
  }
  if (capability_ == -1 &&
      std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& x) { return x.declared == 1; })) {
    capability_ = 1;
    toAgents(capabilityMessage(), out);
  }
}

// Every process of the group that is neither waiting in the re-form nor joining it, registered at
// least `grace` ago and not ordered killed before, is killed by its agent: it stopped answering.
void Coordinator::evictSilent(PeerId requester, std::chrono::milliseconds grace, Clock::time_point now,
                              std::vector<Outgoing>& out) {
  int ordered = 0, underWay = 0;
  std::string missing;
  const auto startGrace = std::max<std::chrono::milliseconds>(kStartGraceFactor * grace, kMinStartGrace);
  for (int s = 0; s < world_; ++s) {
    Rank& r = ranks_[static_cast<std::size_t>(s)];
    if (inReform(r)) continue;
    if (missing.size() < 160) missing += (missing.empty() ? "" : ", ") + std::to_string(s);
    const bool starting = r.phase == Phase::kStarting;
    // A replacement is on its way: its process starts, or its agent is about to start one.
    if (starting || r.phase == Phase::kGone || r.killed == r.incarnation) ++underWay;
    if (r.phase == Phase::kGone || r.phase == Phase::kUnknown || r.incarnation == 0 || r.killed == r.incarnation ||
        now - r.registeredAt < (starting ? startGrace : grace))
      continue;
    const auto n = std::find_if(nodes_.begin(), nodes_.end(), [&](const auto& e) {
      return e.second.peer != 0 && s >= e.second.firstRank && s < e.second.firstRank + e.second.count;
    });
    if (n == nodes_.end()) continue;  // its agent is not connected: asked again at the next request
    Message kill = make(Type::kKill);
    kill.rank = s;
    kill.incarnation = r.incarnation;
    out.push_back({n->second.peer, kill, false});
    r.killed = r.incarnation;
    ++ordered;
    ++underWay;
    ++kills_;
    logLine("rank " + std::to_string(s) + " stopped answering its peers in the re-form of generation " +
            std::to_string(generation_) + ": its agent kills it");
  }
  Message answer = make(Type::kEvicting);
  answer.value = ordered;
  answer.value2 = underWay;
  answer.text = missing.empty() ? "" : "waiting for rank(s) " + missing;
  out.push_back({requester, answer, false});
}

// Once every rank's process waits in the re-form or joins it, the group re-forms at the next
// generation, under a fresh key nonce.
void Coordinator::tryForm(std::vector<Outgoing>& out) {
  if (world_ == 0 || !std::all_of(ranks_.begin(), ranks_.end(), [&](const Rank& r) { return inReform(r) && r.peer != 0; }))
    return;
  ++generation_;
  cc::Nonce nonce = cc::randomNonce();
  const std::string nonceHex = contract::auth::toHex(nonce.data(), nonce.size());
  const auto survivors = std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.holdsState; });
  Message formed = make(Type::kFormed);
  formed.generation = generation_;
  formed.value = survivors;
  formed.text = nonceHex;
  for (Rank& r : ranks_) {
    out.push_back({r.peer, formed, false});
    r.phase = Phase::kRunning;
    r.holdsState = false;
    r.built = false;
  }
  awaitingBuild_ = true;
  logLine("the group re-formed at generation " + std::to_string(generation_) + " (" + std::to_string(survivors) + " of " +
          std::to_string(world_) + " ranks hold the training state)");
}

// The agents hear that the group re-formed only once every rank built it: until then a rank whose
// build fails (a store filled to its cap) fails inside the re-form, and its agent falls back to a
// group restart for this failure instead of replacing it.
void Coordinator::built(int rank, std::int64_t generation, std::vector<Outgoing>& out) {
  if (!awaitingBuild_ || generation != generation_) return;
  ranks_[static_cast<std::size_t>(rank)].built = true;
  if (!std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.built; })) return;
  awaitingBuild_ = false;
  Message reformed = make(Type::kReformed);
  reformed.generation = generation_;
  toAgents(reformed, out);
}

void Coordinator::closed(PeerId peer, std::vector<Outgoing>&) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  const Peer p = it->second;
  peers_.erase(it);
  if (p.role == Role::kAgent) {
    auto n = nodes_.find(p.node);
    if (n != nodes_.end() && n->second.peer == peer) n->second.peer = 0;
    return;
  }
  if (p.role == Role::kWorker && world_ > 0 && p.rank >= 0 && p.rank < world_) {
    Rank& r = ranks_[static_cast<std::size_t>(p.rank)];
    if (r.peer == peer) {
      r.peer = 0;
      r.phase = Phase::kGone;
    }
  }
}

} // namespace ctorch::control
