#include "ctorch_catch.hpp"

#include "ctorch/contract/hostlist.hpp"

using ctorch::contract::expandHostlist;
using ctorch::contract::firstHost;
using V = std::vector<std::string>;

// Expected expansions are those of `scontrol show hostnames` (slurm 22.05), see shared notes.
TEST_CASE("hostlist: ranges with zero padding and single values") {
  CHECK(expandHostlist("node[01-04,07]") == V{"node01", "node02", "node03", "node04", "node07"});
  CHECK(expandHostlist("node[098-101]") == V{"node098", "node099", "node100", "node101"});
  CHECK(expandHostlist("n[8-10]") == V{"n8", "n9", "n10"});
}

TEST_CASE("hostlist: several bracket groups form the cartesian product") {
  CHECK(expandHostlist("rack[1-2]-node[01-02]") ==
        V{"rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"});
}

TEST_CASE("hostlist: comma lists mix plain names and ranges") {
  CHECK(expandHostlist("n1,gpu[1-3],x") == V{"n1", "gpu1", "gpu2", "gpu3", "x"});
  CHECK(expandHostlist("head") == V{"head"});
  CHECK(expandHostlist("a-1.example.org,b") == V{"a-1.example.org", "b"});
  CHECK(firstHost("node[07,01-02]") == "node07");
}

TEST_CASE("hostlist: malformed expressions name the expression") {
  for (const char* bad : {"", "node[01-04", "node01]", "node[]", "node[4-1]", "node[a-b]", "a,,b",
                          "node[1-[2]]"}) {
    INFO(bad);
    try {
      expandHostlist(bad);
      FAIL("accepted a malformed hostlist");
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains("'" + std::string(bad) + "'"));
    }
  }
}
