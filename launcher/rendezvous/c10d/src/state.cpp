#include "ctorch/rdzv/c10d/state.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace ctorch::rdzv::c10d {

using nlohmann::json;

std::string stateKey(std::string_view runId) {
  // torch keeps its pickled state at "torch.rendezvous.<run id>"; a different key keeps a Python
  // agent pointed at the same store from misreading ours (and the other way round).
  return "ctorchrun.rendezvous." + std::string(runId);
}

const Participant* State::participant(std::string_view id) const {
  for (const auto& p : participants)
    if (p.node.id == id) return &p;
  return nullptr;
}

bool State::inWaitList(std::string_view id) const {
  return std::find(waitList.begin(), waitList.end(), id) != waitList.end();
}

bool State::inRedundancyList(std::string_view id) const {
  return std::find(redundancyList.begin(), redundancyList.end(), id) != redundancyList.end();
}

bool State::isExpected(std::string_view id) const {
  return std::find(expected.begin(), expected.end(), id) != expected.end();
}

bool State::operator==(const State& o) const {
  return runId == o.runId && round == o.round && complete == o.complete && closed == o.closed &&
         lastCallDeadline == o.lastCallDeadline && nextJoinSeq == o.nextJoinSeq &&
         participants == o.participants && waitList == o.waitList &&
         redundancyList == o.redundancyList && heartbeats == o.heartbeats &&
         restarts == o.restarts && failure == o.failure && expected == o.expected &&
         roundSize == o.roundSize && announced == o.announced;
}

State freshState(std::string runId) {
  State s;
  s.runId = std::move(runId);
  return s;
}

std::string makeNodeId(std::string_view host, long pid, int localId) {
  return std::string(host) + "_" + std::to_string(pid) + "_" + std::to_string(localId);
}

namespace {

json optionalInt(const std::optional<int>& v) { return v ? json(*v) : json(nullptr); }

json encodeNode(const Participant& p) {
  return json{{"id", p.node.id},
              {"host", p.node.host},
              {"addr", p.node.addr},
              {"nproc", p.node.nproc},
              {"requested_rank", optionalInt(p.node.requestedRank)},
              {"previous_rank", optionalInt(p.node.previousRank)},
              {"join_seq", p.joinSeq},
              {"rank", p.rank},
              {"store_port", optionalInt(p.node.storePort)},
              {"standby_port", optionalInt(p.node.standbyPort)},
              {"store_host", p.node.storeHost}};
}

[[noreturn]] void corrupt(const std::string& why) {
  throw RendezvousStateError("the rendezvous state in the store is unusable: " + why);
}

// `where` by value: a reference to its temporary would look, to GCC 13+, as if the result could dangle.
const json& field(const json& obj, const char* name, std::string_view where) {
  auto it = obj.find(name);
  if (it == obj.end()) corrupt(std::string(where) + " has no '" + name + "'");
  return *it;
}

template <typename T>
T get(const json& obj, const char* name, const std::string& where) {
  const json& v = field(obj, name, where);
  try {
    return v.get<T>();
  } catch (const json::exception&) {
    corrupt(where + "." + name + " has the wrong type (" + v.dump() + ")");
  }
}

std::optional<int> getOptionalInt(const json& obj, const char* name, const std::string& where,
                                  bool mayBeAbsent = false) {
  if (mayBeAbsent && !obj.contains(name)) return std::nullopt;
  const json& v = field(obj, name, where);
  if (v.is_null()) return std::nullopt;
  if (!v.is_number_integer()) corrupt(where + "." + name + " is not an integer (" + v.dump() + ")");
  return v.get<int>();
}

} // namespace

std::string encodeState(const State& s) {
  json participants = json::array();
  for (const auto& p : s.participants) participants.push_back(encodeNode(p));
  json heartbeats = json::object();
  for (const auto& [id, t] : s.heartbeats) heartbeats[id] = t.time_since_epoch().count();
  json j = {{"format", kStateFormat},
            {"version", kStateVersion},
            {"run_id", s.runId},
            {"round", s.round},
            {"complete", s.complete},
            {"closed", s.closed},
            {"last_call_deadline_ms",
             s.lastCallDeadline ? json(s.lastCallDeadline->time_since_epoch().count()) : json(nullptr)},
            {"next_join_seq", s.nextJoinSeq},
            {"participants", participants},
            {"wait_list", s.waitList},
            {"redundancy_list", s.redundancyList},
            {"heartbeats_ms", heartbeats},
            {"restarts", s.restarts},
            {"failure", s.failure ? json{{"round", s.failure->round},
                                         {"node", s.failure->node},
                                         {"reason", s.failure->reason}}
                                  : json(nullptr)},
            {"expected", s.expected},
            {"round_size", s.roundSize},
            {"announced", s.announced}};
  return j.dump();
}

State decodeState(std::string_view text) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    std::string head(text.substr(0, 60));
    corrupt("not JSON ('" + head + (text.size() > 60 ? "...'" : "'") + ")");
  }
  if (!j.is_object()) corrupt("not a JSON object");
  const std::string top = "state";
  auto format = get<std::string>(j, "format", top);
  if (format != kStateFormat) corrupt("format '" + format + "' is not '" + kStateFormat + "'");
  auto version = get<int>(j, "version", top);
  if (version > kStateVersion)
    throw RendezvousStateError("the rendezvous state has format version " + std::to_string(version) +
                               ", newer than this ctorchrun understands (" +
                               std::to_string(kStateVersion) +
                               "): run the same ctorchrun version on every node");
  if (version < 1) corrupt("version " + std::to_string(version) + " is invalid");

  State s;
  s.runId = get<std::string>(j, "run_id", top);
  s.round = get<std::int64_t>(j, "round", top);
  s.complete = get<bool>(j, "complete", top);
  s.closed = get<bool>(j, "closed", top);
  const json& deadline = field(j, "last_call_deadline_ms", top);
  if (!deadline.is_null()) {
    if (!deadline.is_number_integer()) corrupt("last_call_deadline_ms is not an integer");
    s.lastCallDeadline = Timestamp(std::chrono::milliseconds(deadline.get<std::int64_t>()));
  }
  s.nextJoinSeq = get<std::int64_t>(j, "next_join_seq", top);
  const json& participants = field(j, "participants", top);
  if (!participants.is_array()) corrupt("participants is not an array");
  for (std::size_t i = 0; i < participants.size(); ++i) {
    const json& pj = participants[i];
    std::string where = "participants[" + std::to_string(i) + "]";
    if (!pj.is_object()) corrupt(where + " is not an object");
    Participant p;
    p.node.id = get<std::string>(pj, "id", where);
    p.node.host = get<std::string>(pj, "host", where);
    p.node.addr = get<std::string>(pj, "addr", where);
    p.node.nproc = get<int>(pj, "nproc", where);
    p.node.requestedRank = getOptionalInt(pj, "requested_rank", where);
    p.node.previousRank = getOptionalInt(pj, "previous_rank", where);
    p.joinSeq = get<std::int64_t>(pj, "join_seq", where);
    p.rank = get<int>(pj, "rank", where);
    p.node.storePort = getOptionalInt(pj, "store_port", where, /*mayBeAbsent=*/version < 2);
    p.node.standbyPort = getOptionalInt(pj, "standby_port", where, /*mayBeAbsent=*/version < 4);
    if (version >= 4) p.node.storeHost = get<bool>(pj, "store_host", where);
    if (p.node.id.empty()) corrupt(where + " has an empty id");
    if (p.node.nproc < 1) corrupt(where + " has nproc " + std::to_string(p.node.nproc));
    if (s.isParticipant(p.node.id)) corrupt("node '" + p.node.id + "' is a participant twice");
    s.participants.push_back(std::move(p));
  }
  s.waitList = get<std::vector<std::string>>(j, "wait_list", top);
  s.redundancyList = get<std::vector<std::string>>(j, "redundancy_list", top);
  const json& heartbeats = field(j, "heartbeats_ms", top);
  if (!heartbeats.is_object()) corrupt("heartbeats_ms is not an object");
  for (const auto& [id, t] : heartbeats.items()) {
    if (!t.is_number_integer()) corrupt("heartbeats_ms['" + id + "'] is not an integer");
    s.heartbeats[id] = Timestamp(std::chrono::milliseconds(t.get<std::int64_t>()));
  }
  if (version >= 2) {
    s.restarts = get<std::int64_t>(j, "restarts", top);
    if (s.restarts < 0) corrupt("restarts is negative (" + std::to_string(s.restarts) + ")");
    const json& failure = field(j, "failure", top);
    if (!failure.is_null()) {
      if (!failure.is_object()) corrupt("failure is not an object");
      Failure f;
      f.round = get<std::int64_t>(failure, "round", "failure");
      f.node = get<std::string>(failure, "node", "failure");
      f.reason = get<std::string>(failure, "reason", "failure");
      s.failure = std::move(f);
    }
    s.expected = get<std::vector<std::string>>(j, "expected", top);
    s.roundSize = get<int>(j, "round_size", top);
  } else if (s.complete) {
    s.roundSize = s.participantCount();
  }
  if (version >= 3) {
    s.announced = get<std::int64_t>(j, "announced", top);
    if (s.announced < 0) corrupt("announced is negative (" + std::to_string(s.announced) + ")");
  }
  return s;
}

std::string announceCountKey(std::string_view runId) { return stateKey(runId) + "/announce"; }

std::string announceKey(std::string_view runId, std::int64_t number) {
  return stateKey(runId) + "/announce/" + std::to_string(number);
}

std::string phaseKey(std::string_view runId) { return stateKey(runId) + "/phase"; }

std::string heartbeatKey(std::string_view runId, std::string_view nodeId) {
  return stateKey(runId) + "/hb/" + std::string(nodeId);
}

std::string encodeAnnouncement(const Announcement& a) {
  Participant p;
  p.node = a.node;
  return json{{"format", "ctorchrun-rdzv-join"}, {"round", a.round}, {"node", encodeNode(p)}}.dump();
}

std::optional<Announcement> decodeAnnouncement(std::string_view text) {
  try {
    json j = json::parse(text.begin(), text.end());
    if (!j.is_object() || j.value("format", std::string()) != "ctorchrun-rdzv-join") return std::nullopt;
    Announcement a;
    a.round = get<std::int64_t>(j, "round", "announcement");
    const json& nj = field(j, "node", "announcement");
    if (!nj.is_object()) return std::nullopt;
    a.node.id = get<std::string>(nj, "id", "node");
    a.node.host = get<std::string>(nj, "host", "node");
    a.node.addr = get<std::string>(nj, "addr", "node");
    a.node.nproc = get<int>(nj, "nproc", "node");
    a.node.requestedRank = getOptionalInt(nj, "requested_rank", "node");
    a.node.previousRank = getOptionalInt(nj, "previous_rank", "node");
    a.node.storePort = getOptionalInt(nj, "store_port", "node");
    a.node.standbyPort = getOptionalInt(nj, "standby_port", "node", /*mayBeAbsent=*/true);
    if (auto it = nj.find("store_host"); it != nj.end() && it->is_boolean()) a.node.storeHost = it->get<bool>();
    if (a.node.id.empty() || a.node.nproc < 1 || a.round < 0) return std::nullopt;
    return a;
  } catch (const std::exception&) {
    return std::nullopt;  // not JSON, a missing field, a wrong type (RendezvousStateError)
  }
}

std::optional<State> decodeStoreValue(std::string_view value) {
  if (value == kNoStateSentinel) return std::nullopt;
  return decodeState(value);
}

} // namespace ctorch::rdzv::c10d
