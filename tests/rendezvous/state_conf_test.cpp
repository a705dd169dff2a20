// The rendezvous state's JSON encoding, --rdzv-conf / --rdzv-endpoint parsing and the "is this
// agent the store host" rule.
#include "ctorch_catch.hpp"

#include "ctorch/rdzv/c10d/errors.hpp"
#include "ctorch/rdzv/c10d/settings.hpp"
#include "ctorch/rdzv/c10d/state.hpp"
#include "ctorch/rdzv/c10d/store_host.hpp"

#include <nlohmann/json.hpp>

using namespace ctorch::rdzv::c10d;
using namespace std::chrono_literals;

namespace {

State sampleState() {
  State s = freshState("job-42");
  s.round = 7;
  s.complete = true;
  s.nextJoinSeq = 12;
  s.lastCallDeadline = Timestamp(1'700'000'030'000ms);
  NodeInfo a{"hostA_11_0", "hostA", "10.0.0.1", 4, 0, std::nullopt};
  NodeInfo b{"hostB_22_0", "hostB", "fe80::1", 2, std::nullopt, 1};
  a.storePort = 41234;
  a.storeHost = true;
  b.standbyPort = 40001;
  s.participants = {{a, 10, 0}, {b, 11, 1}};
  s.restarts = 2;
  s.failure = Failure{7, b.id, "rank 5 exited with code 1"};
  s.expected = {"hostC_33_0"};
  s.roundSize = 2;
  s.announced = 17;
  s.waitList = {"hostC_33_0"};
  s.redundancyList = {"hostD_44_1"};
  s.heartbeats = {{a.id, Timestamp(1'700'000'000'000ms)}, {b.id, Timestamp(1'700'000'000'500ms)},
                  {"hostC_33_0", Timestamp(1'700'000'001'000ms)}, {"hostD_44_1", Timestamp(1'700'000'002'000ms)}};
  return s;
}

} // namespace

// ---- state encoding ---------------------------------------------------------------------------------
TEST_CASE("rendezvous state: JSON round trip keeps every field", "[rendezvous]") {
  State s = sampleState();
  std::string text = encodeState(s);
  State back = decodeState(text);
  CHECK(back == s);
  CHECK(encodeState(back) == text);  // deterministic bytes: compare-and-set tokens are stable
  State fresh = freshState("x");
  CHECK(decodeState(encodeState(fresh)) == fresh);
  // Control: the comparison sees a difference.
  back.participants[1].node.nproc = 3;
  CHECK(back != s);
}

TEST_CASE("rendezvous state: the JSON layout is the documented one", "[rendezvous]") {
  auto j = nlohmann::json::parse(encodeState(sampleState()));
  CHECK(j["format"] == "ctorchrun-rdzv");
  CHECK(j["version"] == 4);
  CHECK(j["announced"] == 17);
  CHECK(j["run_id"] == "job-42");
  CHECK(j["round"] == 7);
  CHECK(j["complete"] == true);
  CHECK(j["closed"] == false);
  CHECK(j["last_call_deadline_ms"] == 1'700'000'030'000LL);
  CHECK(j["next_join_seq"] == 12);
  CHECK(j["participants"][0]["id"] == "hostA_11_0");
  CHECK(j["participants"][0]["addr"] == "10.0.0.1");
  CHECK(j["participants"][0]["nproc"] == 4);
  CHECK(j["participants"][0]["requested_rank"] == 0);
  CHECK(j["participants"][0]["previous_rank"].is_null());
  CHECK(j["participants"][1]["rank"] == 1);
  CHECK(j["participants"][1]["join_seq"] == 11);
  CHECK(j["wait_list"] == nlohmann::json::array({"hostC_33_0"}));
  CHECK(j["redundancy_list"] == nlohmann::json::array({"hostD_44_1"}));
  CHECK(j["heartbeats_ms"]["hostB_22_0"] == 1'700'000'000'500LL);
  CHECK(j["participants"][0]["store_port"] == 41234);
  CHECK(j["participants"][1]["store_port"].is_null());
  CHECK(j["participants"][0]["store_host"] == true);
  CHECK(j["participants"][0]["standby_port"].is_null());
  CHECK(j["participants"][1]["store_host"] == false);
  CHECK(j["participants"][1]["standby_port"] == 40001);
  CHECK(j["restarts"] == 2);
  CHECK(j["failure"]["round"] == 7);
  CHECK(j["failure"]["node"] == "hostB_22_0");
  CHECK(j["failure"]["reason"] == "rank 5 exited with code 1");
  CHECK(j["expected"] == nlohmann::json::array({"hostC_33_0"}));
}

TEST_CASE("rendezvous state: a version 1 state is still read", "[rendezvous]") {
  auto j = nlohmann::json::parse(encodeState(sampleState()));
  j["version"] = 1;
  for (const char* k : {"restarts", "failure", "expected", "round_size"}) j.erase(k);
  for (auto& p : j["participants"]) {
    p.erase("store_port");
    p.erase("standby_port");
    p.erase("store_host");
  }
  State back = decodeState(j.dump());
  CHECK(back.round == 7);
  CHECK(back.restarts == 0);
  CHECK_FALSE(back.failure);
  CHECK(back.expected.empty());
  CHECK_FALSE(back.participants[0].node.storePort);
  CHECK_FALSE(back.participants[0].node.storeHost);
  CHECK_FALSE(back.participants[1].node.standbyPort);
  // Control: a version 2 state without the new fields is refused.
  j["version"] = 2;
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("no 'store_port'") || Catch::Contains("no 'restarts'"));
}

TEST_CASE("rendezvous state: a version 2 state (before the scalable join) is still read", "[rendezvous]") {
  auto j = nlohmann::json::parse(encodeState(sampleState()));
  j["version"] = 2;
  j.erase("announced");
  State back = decodeState(j.dump());
  CHECK(back.announced == 0);
  CHECK(back.round == 7);
  // Control: a version 3 state without it is refused; a negative one too.
  j["version"] = 3;
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("no 'announced'"));
  j["announced"] = -1;
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("announced is negative"));
}

TEST_CASE("rendezvous state: a version 3 state (before store failover) is still read", "[rendezvous]") {
  auto j = nlohmann::json::parse(encodeState(sampleState()));
  CHECK(j["version"] == 4);
  j["version"] = 3;
  for (auto& p : j["participants"]) {
    p.erase("standby_port");
    p.erase("store_host");
  }
  State back = decodeState(j.dump());
  CHECK_FALSE(back.participants[0].node.storeHost);
  CHECK_FALSE(back.participants[1].node.standbyPort);
  CHECK(back.participants[0].node.storePort == 41234);
  // Control: a version 4 state without them is refused.
  j["version"] = 4;
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("no 'standby_port'"));
}

TEST_CASE("rendezvous announcements: round trip, keys, and garbage is skipped not fatal", "[rendezvous]") {
  Announcement a;
  a.round = 4;
  a.node = sampleState().participants[0].node;
  auto back = decodeAnnouncement(encodeAnnouncement(a));
  REQUIRE(back);
  CHECK(*back == a);
  CHECK(announceCountKey("job") == stateKey("job") + "/announce");
  CHECK(announceKey("job", 12) == stateKey("job") + "/announce/12");
  CHECK(phaseKey("job") == stateKey("job") + "/phase");
  for (const char* bad : {"", "garbage", "[1]", "{}", R"({"format":"ctorchrun-rdzv-join","round":1})",
                          R"({"format":"other","round":1,"node":{}})",
                          R"({"format":"ctorchrun-rdzv-join","round":"x","node":{}})"}) {
    INFO(bad);
    CHECK_FALSE(decodeAnnouncement(bad));
  }
  auto j = nlohmann::json::parse(encodeAnnouncement(a));
  j["node"]["nproc"] = 0;
  CHECK_FALSE(decodeAnnouncement(j.dump()));
  j = nlohmann::json::parse(encodeAnnouncement(a));
  j["node"]["id"] = "";
  CHECK_FALSE(decodeAnnouncement(j.dump()));
  j = nlohmann::json::parse(encodeAnnouncement(a));
  j["round"] = -3;
  CHECK_FALSE(decodeAnnouncement(j.dump()));
}

TEST_CASE("rendezvous state: the sentinel means no state", "[rendezvous]") {
  CHECK_FALSE(decodeStoreValue(kNoStateSentinel).has_value());
  CHECK(decodeStoreValue(encodeState(sampleState())) == sampleState());
}

TEST_CASE("rendezvous state: unusable values are refused with the reason", "[rendezvous]") {
  CHECK_THROWS_WITH(decodeState("gAR9lC4="), Catch::Contains("not JSON") && Catch::Contains("gAR9lC4="));
  CHECK_THROWS_AS(decodeState("[1,2]"), RendezvousStateError);
  CHECK_THROWS_WITH(decodeState(R"({"format":"other","version":1})"), Catch::Contains("format 'other'"));
  auto j = nlohmann::json::parse(encodeState(sampleState()));
  j["version"] = 5;
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("version 5") && Catch::Contains("newer") &&
                                               Catch::Contains("same ctorchrun version"));
  j = nlohmann::json::parse(encodeState(sampleState()));
  j.erase("round");
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("no 'round'"));
  j = nlohmann::json::parse(encodeState(sampleState()));
  j["participants"][0]["nproc"] = "four";
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("participants[0].nproc"));
  j = nlohmann::json::parse(encodeState(sampleState()));
  j["participants"][1]["id"] = "hostA_11_0";
  CHECK_THROWS_WITH(decodeState(j.dump()), Catch::Contains("participant twice"));
}

TEST_CASE("rendezvous state: node ids look like torch's node descriptors", "[rendezvous]") {
  CHECK(makeNodeId("n1", 1234, 0) == "n1_1234_0");
}

// ---- --rdzv-conf ----------------------------------------------------------------------------------------
TEST_CASE("rdzv-conf: every key is parsed and applied over the defaults", "[rendezvous]") {
  auto conf = parseRdzvConf(
      "join_timeout=900, last_call_timeout=0.5,close_timeout=10,heartbeat_timeout=2,read_timeout=20,"
      "keep_alive_interval=1.5,keep_alive_max_attempt=4,is_host=false,store_type=TCP");
  CHECK(conf.joinTimeout == 900s);
  CHECK(conf.lastCallTimeout == 500ms);
  CHECK(conf.isHost == false);
  Settings s = makeSettings("job", 2, 4, conf);
  CHECK(s.runId == "job");
  CHECK(s.minNodes == 2);
  CHECK(s.maxNodes == 4);
  CHECK(s.joinTimeout == 900s);
  CHECK(s.lastCallTimeout == 500ms);
  CHECK(s.closeTimeout == 10s);
  CHECK(s.heartbeatTimeout == 2s);
  CHECK(s.readTimeout == 20s);
  CHECK(s.keepAliveInterval == 1500ms);
  CHECK(s.keepAliveMaxAttempt == 4);
  CHECK(s.heartbeatExpiry() == 6s);

  Settings d = makeSettings("job", 1, 1, parseRdzvConf(""));
  CHECK(d.joinTimeout == 600s);
  CHECK(d.lastCallTimeout == 30s);
  CHECK_FALSE(parseRdzvConf("  ").isHost.has_value());
}

TEST_CASE("rdzv-conf: heartbeat and dashed spellings are accepted", "[rendezvous]") {
  CHECK(parseRdzvConf("heartbeat=2").keepAliveInterval == 2s);
  CHECK(parseRdzvConf("join-timeout=5").joinTimeout == 5s);
  for (const char* yes : {"1", "true", "True", "t", "yes", "Y"}) CHECK(parseRdzvConf(std::string("is_host=") + yes).isHost == true);
  for (const char* no : {"0", "false", "F", "no", "n"}) CHECK(parseRdzvConf(std::string("is_host=") + no).isHost == false);
}

TEST_CASE("rdzv-conf: bad entries fail with one line naming the key and value", "[rendezvous]") {
  CHECK_THROWS_WITH(parseRdzvConf("join_timeout=abc"), "--rdzv-conf join_timeout='abc' is not a number of seconds");
  CHECK_THROWS_WITH(parseRdzvConf("join_timeout=-3"), "--rdzv-conf join_timeout='-3' must be positive");
  CHECK_THROWS_WITH(parseRdzvConf("last_call_timeout=0"), Catch::Contains("last_call_timeout='0'"));
  CHECK_THROWS_WITH(parseRdzvConf("joint_timeout=5"),
                    Catch::StartsWith("--rdzv-conf key 'joint_timeout' is unknown (known: join_timeout"));
  CHECK_THROWS_WITH(parseRdzvConf("is_host=maybe"), Catch::Contains("is_host='maybe' is not a boolean"));
  CHECK_THROWS_WITH(parseRdzvConf("keep_alive_max_attempt=2.5"), Catch::Contains("'2.5' is not a whole number"));
  CHECK_THROWS_WITH(parseRdzvConf("keep_alive_max_attempt=0"), Catch::Contains("must be between 1"));
  CHECK_THROWS_WITH(parseRdzvConf("join_timeout"), "--rdzv-conf entry 'join_timeout' is not key=value");
  CHECK_THROWS_WITH(parseRdzvConf("join_timeout="), "--rdzv-conf join_timeout has no value");
  CHECK_THROWS_WITH(parseRdzvConf("=5"), Catch::Contains("has no key"));
  CHECK_THROWS_WITH(parseRdzvConf("heartbeat=1,keep_alive_interval=2"), Catch::Contains("given twice"));
  CHECK_THROWS_WITH(parseRdzvConf("store_type=file"), Catch::Contains("store_type='file' is not supported"));
  CHECK_THROWS_WITH(parseRdzvConf("join_timeout=5,,close_timeout=1"), Catch::Contains("entry '' is not key=value"));
  CHECK_THROWS_AS(parseRdzvConf("read_timeout=nan"), RendezvousConfigError);
  for (const char* bad : {"join_timeout=1e99", "read_timeout=0.0001"}) CHECK_THROWS_AS(parseRdzvConf(bad), RendezvousConfigError);
}

TEST_CASE("rdzv-conf: parsed once: the entries as given, and any key for a backend that reads none", "[rendezvous]") {
  const auto c = parseRdzvConf(" join-timeout = 5 ,heartbeat=2");
  CHECK(c.entries == std::vector<std::pair<std::string, std::string>>{{"join-timeout", "5"}, {"heartbeat", "2"}});
  CHECK(c.joinTimeout == 5s);
  // torchrun's static backend reads no key: only the key=value syntax is checked.
  const auto any = parseRdzvConf("timeout=3,join_timeout=abc", RdzvConfKeys::kAny);
  CHECK(any.entries.size() == 2);
  CHECK_FALSE(any.joinTimeout.has_value());
  CHECK_THROWS_WITH(parseRdzvConf("a=1,=2", RdzvConfKeys::kAny), Catch::Contains("'=2'"));
  CHECK_THROWS_WITH(parseRdzvConf("timeout", RdzvConfKeys::kAny), "--rdzv-conf entry 'timeout' is not key=value");
  CHECK_THROWS_WITH(parseRdzvConf("a=1,a=2", RdzvConfKeys::kAny), Catch::Contains("given twice"));
  // ctorchrun's heartbeat (1 s x 3) where the conf sets none; the conf's where it does.
  const Settings d = ctorchrunSettings("job", 1, 1, parseRdzvConf(""));
  CHECK(d.keepAliveInterval == kCtorchrunKeepAliveInterval);
  CHECK(d.keepAliveMaxAttempt == kCtorchrunKeepAliveMaxAttempt);
  CHECK(ctorchrunSettings("job", 1, 1, parseRdzvConf("heartbeat=2")).keepAliveInterval == 2s);
}

TEST_CASE("rdzv settings: invalid node counts and run ids are refused", "[rendezvous]") {
  CHECK_THROWS_WITH(makeSettings("", 1, 1, {}), Catch::Contains("--rdzv-id"));
  CHECK_THROWS_WITH(makeSettings("j", 0, 1, {}), Catch::Contains("minimum number of nodes (0)"));
  CHECK_THROWS_WITH(makeSettings("j", 3, 2, {}), Catch::Contains("maximum number of nodes (2)"));
  CHECK_NOTHROW(makeSettings("j", 2, 2, {}));
}

// ---- store host ------------------------------------------------------------------------------------------
TEST_CASE("store host: own address or name hosts and is_host overrides", "[rendezvous]") {
  LocalIdentity me{"n1", "n1.cluster", {"127.0.0.1", "10.9.0.1", "fe80::1"}};
  CHECK(decideStoreHost("10.9.0.1", std::nullopt, me, {}).isHost);
  CHECK_FALSE(decideStoreHost("10.9.0.2", std::nullopt, me, {}).isHost);
  CHECK(decideStoreHost("n1", std::nullopt, me, {"10.9.0.1"}).isHost);
  CHECK(decideStoreHost("N1.Cluster", std::nullopt, me, {}).isHost);
  CHECK(decideStoreHost("head", std::nullopt, me, {"10.9.0.1"}).isHost);  // an alias of this machine
  CHECK_FALSE(decideStoreHost("n2", std::nullopt, me, {"10.9.0.2"}).isHost);
  CHECK_FALSE(decideStoreHost("n2", std::nullopt, me, {}).isHost);
  CHECK(decideStoreHost("localhost", std::nullopt, me, {}).isHost);
  CHECK(decideStoreHost("127.0.0.1", std::nullopt, me, {}).isHost);
  CHECK(decideStoreHost("::1", std::nullopt, me, {}).isHost);
  CHECK(decideStoreHost("fe80:0:0::1", std::nullopt, me, {}).isHost);  // same address, other spelling
  CHECK(decideStoreHost("n1", std::nullopt, LocalIdentity{"other", "", {}}, {"127.0.1.1"}).isHost);

  auto forced = decideStoreHost("10.9.0.2", true, me, {});
  CHECK(forced.isHost);
  CHECK(forced.explicitChoice);
  auto refused = decideStoreHost("10.9.0.1", false, me, {});
  CHECK_FALSE(refused.isHost);
  CHECK_THAT(refused.reason, Catch::Contains("is_host=false"));
  CHECK_THAT(decideStoreHost("n2", std::nullopt, me, {}).reason, Catch::Contains("does not resolve"));
}

TEST_CASE("store host: a literal loopback endpoint or localhost keeps the stores on the loopback, a name does not "
          "(issue 58.4)", "[rendezvous]") {
  CHECK(loopbackEndpoint("127.0.0.1"));
  CHECK(loopbackEndpoint("127.0.1.1"));
  CHECK(loopbackEndpoint("::1"));
  CHECK(loopbackEndpoint("0:0::1"));
  CHECK(loopbackEndpoint("LocalHost"));
  CHECK_FALSE(loopbackEndpoint("10.9.0.1"));
  CHECK_FALSE(loopbackEndpoint("::"));
  CHECK_FALSE(loopbackEndpoint("0.0.0.0"));
  CHECK_FALSE(loopbackEndpoint("n1"));  // may resolve to 127.0.1.1 here, to a routable address elsewhere
  CHECK_FALSE(loopbackEndpoint("localhost.example"));
}

TEST_CASE("store host: this machine's identity includes its loopback address", "[rendezvous]") {
  auto me = discoverLocalIdentity();
  CHECK_FALSE(me.hostname.empty());
  CHECK(std::find(me.addresses.begin(), me.addresses.end(), "127.0.0.1") != me.addresses.end());
  CHECK(decideStoreHost(me.hostname, std::nullopt, me, resolveHost(me.hostname)).isHost);
  CHECK(resolveHost("localhost").size() >= 1);
  CHECK(resolveHost("no-such-host.invalid").empty());
}
