// ctorch::readLinesBack (durable_io.hpp), the read of a file the loop wrote and is about to rewrite:
// lines cut across its read pieces come out whole, a line over the limit is passed over, a file over
// the limit and anything but a regular file (a link, a FIFO, a device, a directory) are refused
// without being read; and AppendOnlyFile under SymlinkPolicy::kRefuse does not write through a link.
#include "multiproc.hpp"

#include "ctorch_catch.hpp"

#include <ctorch/durable_io.hpp>

#include <sys/stat.h>

#include <cerrno>
#include <system_error>
#include <vector>

using ctorch::test::TempDir;
namespace fs = std::filesystem;

namespace read_back_test {

std::vector<std::string> linesOf(const fs::path& path, const ctorch::ReadBackLimits& limits, bool* existed = nullptr) {
  std::vector<std::string> out;
  const bool found = ctorch::readLinesBack(path, limits, [&](std::string_view line) { out.emplace_back(line); });
  if (existed) *existed = found;
  return out;
}

std::string refusedWith(const fs::path& path, const ctorch::ReadBackLimits& limits = {}) {
  try {
    linesOf(path, limits);
  } catch (const ctorch::FileRefused& e) {
    return e.what();
  }
  return "<not refused>";
}

}  // namespace read_back_test

namespace rb = read_back_test;

TEST_CASE("read back: lines cut across read pieces come out whole, lines over the limit are passed over",
          "[snapshot][files][hostile]") {
  TempDir dir("read-back-lines");
  const fs::path path = dir / "records.jsonl";
  ctorch::ReadBackLimits limits;
  limits.maxLine = 1000;
  // Lines of every length up to the limit and past it, some longer than a read piece (64 KiB), an
  // empty one, and a last one without its newline.
  std::string text;
  std::vector<std::string> expected;
  for (int i = 0; i < 3000; ++i) {
    const std::size_t length = i % 97 == 0 ? 70000 + i : i % 89 == 0 ? 1001 : (i * 37) % 1001;
    std::string line(length, static_cast<char>('a' + i % 26));
    text += line + "\n";
    if (length <= limits.maxLine) expected.push_back(line);
  }
  text += "last";
  expected.push_back("last");
  ctorch::test::writeFile(path, text);
  bool existed = false;
  CHECK(rb::linesOf(path, limits, &existed) == expected);
  CHECK(existed);

  CHECK(rb::linesOf(dir / "missing", limits, &existed).empty());
  CHECK_FALSE(existed);

  // The size limit: at it is read, one byte over is refused before reading.
  limits.maxBytes = text.size();
  CHECK(rb::linesOf(path, limits).size() == expected.size());
  limits.maxBytes = text.size() - 1;
  CHECK(rb::refusedWith(path, limits) == path.string() + " is " + std::to_string(text.size()) +
                                            " bytes, more than the limit of " + std::to_string(text.size() - 1) +
                                            " bytes");
}

TEST_CASE("read back: a link, a FIFO, a device or a directory is refused without being read",
          "[snapshot][files][hostile]") {
  TempDir dir("read-back-refused");
  const fs::path path = dir / "metrics.jsonl";
  ctorch::test::writeFile(dir / "real.jsonl", "{\"step\": 1}\n");

  fs::create_symlink(dir / "real.jsonl", path);
  CHECK(rb::refusedWith(path) ==
        path.string() + " is a symbolic link (to '" + (dir / "real.jsonl").string() + "'), not a regular file");
  // Appending: through the link only when the caller allows it.
  try {
    ctorch::AppendOnlyFile refusing(path, ctorch::SymlinkPolicy::kRefuse);
    FAIL("opened through the link");
  } catch (const std::system_error& e) {
    CHECK(e.code().value() == ELOOP);
    CHECK_THAT(e.what(), Catch::Contains(path.string()));
  }
  CHECK(ctorch::test::readFile(dir / "real.jsonl") == "{\"step\": 1}\n");
  ctorch::AppendOnlyFile(path).append("{\"step\": 2}\n");  // kFollow, the default, as before
  CHECK(ctorch::test::readFile(dir / "real.jsonl") == "{\"step\": 1}\n{\"step\": 2}\n");
  fs::remove(path);

  fs::create_symlink("/dev/zero", path);
  CHECK(rb::refusedWith(path) == path.string() + " is a symbolic link (to '/dev/zero'), not a regular file");
  fs::remove(path);
  // The device itself, named directly (no link): opened, seen by fstat, not read.
  CHECK(rb::refusedWith("/dev/zero") == "/dev/zero is a character device, not a regular file");

  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);  // no writer: a blocking open would wait for ever
  CHECK(rb::refusedWith(path) == path.string() + " is a FIFO, not a regular file");
  fs::remove(path);

  fs::create_directories(path);
  CHECK(rb::refusedWith(path) == path.string() + " is a directory, not a regular file");
}
