#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs every test with CTest.
# Extra arguments go to ctest (e.g. scripts/test.sh -R ddp, scripts/test.sh -L launcher).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_BUILD_DIR:-$root/build}
# The modern lane (scripts/modern.sh) runs this inside its own root, whose packages it installed.
[ "${CTORCH_SETUP:-}" = skip ] || "$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "$build"
start=$(date +%s)
status=0
# Three tests per core at once, each claiming the thirds of a core it was measured to keep busy
# (PROCESSORS, tests/schedule.tsv): tests that wait on deadlines and processes share a core, numeric
# ones do not (docs/testing.md). CTORCH_TEST_JOBS overrides the number of slots.
ctest --output-on-failure --parallel "${CTORCH_TEST_JOBS:-$(( 3 * $(nproc) ))}" --timeout 600 "$@" || status=$?
echo "tests (${CTORCH_LANE:-bookworm} lane): $(( $(date +%s) - start )) s"
exit $status
