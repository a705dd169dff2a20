// Test main shared by every test binary: runs a registered worker when started as
// `<binary> --ctorch-worker NAME ...` (multi-process tests), else the Catch2 session.
#define CATCH_CONFIG_RUNNER  // v2: this file supplies main()
#include "ctorch_catch.hpp"

#include "multiproc.hpp"

int main(int argc, char** argv) {
  if (auto rc = ctorch::test::maybeRunWorker(argc, argv)) return *rc;
  return Catch::Session().run(argc, argv);
}
