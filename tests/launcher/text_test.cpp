// Unit tests of the launcher's shared text helpers (launcher/text): trim, split, join, lower case and
// the "1.5 s" duration text that the command line, the rendezvous and their logs all use.
#include "ctorch_catch.hpp"

#include "ctorch/text/text.hpp"

using namespace ctorch::text;
using namespace std::chrono_literals;

TEST_CASE("text: trim removes blanks and tabs, or the characters asked for") {
  CHECK(trim("  a b\t") == "a b");
  CHECK(trim(" \t ").empty());
  CHECK(trim("").empty());
  CHECK(trim("\na\n") == "\na\n");  // the command line's values: blanks and tabs only
  CHECK(trim("\n a \r\n", kWhiteSpace) == "a");
}

TEST_CASE("text: split keeps empty pieces") {
  CHECK(split("a,b", ',') == std::vector<std::string>{"a", "b"});
  CHECK(split("a,,b,", ',') == std::vector<std::string>{"a", "", "b", ""});
  CHECK(split("", ',') == std::vector<std::string>{""});
  CHECK(split("/usr/bin:/bin", ':') == std::vector<std::string>{"/usr/bin", "/bin"});
}

TEST_CASE("text: join puts the separator between the pieces") {
  CHECK(join({"a", "b", "c"}, ", ") == "a, b, c");
  CHECK(join({"a"}, ", ") == "a");
  CHECK(join({}, ", ").empty());
}

TEST_CASE("text: numbers are plain decimal, nothing around them (issue 42.10)") {
  for (const char* ok : {"0", "2", "-2", "+7", "12345678"}) CHECK(isDecimalInteger(ok));
  for (const char* no : {"", " 2", "2 ", "0x10", "1e3", "2.", "+", "1_000", "٣"}) CHECK_FALSE(isDecimalInteger(no));
  for (const char* ok : {"0", "0.5", ".5", "2.", "-1.5e-3", "1E3", "+3"}) CHECK(isDecimalNumber(ok));
  for (const char* no : {"", ".", " 1", "1 ", "0x10", "inf", "nan", "1e", "1e+", "1_000", "--1", "1.2.3"})
    CHECK_FALSE(isDecimalNumber(no));
}

TEST_CASE("text: lower case and seconds") {
  CHECK(toLower("TCP Yes") == "tcp yes");
  CHECK(secondsText(1500ms) == "1.5 s");
  CHECK(secondsText(30s) == "30 s");
  CHECK(secondsText(250ms) == "0.25 s");
  CHECK(secondsText(1234ms, 3) == "1.23 s");
  CHECK(secondsText(600'000ms) == "600 s");
}
