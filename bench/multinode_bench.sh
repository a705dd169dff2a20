#!/usr/bin/env bash
# Multi-node measurements of ctorchrun (docs/launcher.md, docs/rendezvous.md):
#  - time for 2, 8 and 32 real ctorchrun agents to complete a c10d rendezvous on loopback (from
#    starting the first agent to the first line of the last worker);
#  - how long the survivors take to notice a killed node and a cut-off node, and to run their next
#    round, with 3 agents on network-namespace hosts and ctorchrun's default heartbeats (needs root).
# Usage: bench/multinode_bench.sh [reps]   (default 5; builds what it needs)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_BUILD_DIR:-$root/build}
"$root/scripts/build.sh" --target launcher_multinode_tests ctorchrun fake_worker >/dev/null
export BENCH_REPS=${1:-5}
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
"$build/tests/launcher/launcher_multinode_tests" "[.bench]" -s 2>&1 | grep '^MEASURE' || {
  echo "benchmark failed; run: $build/tests/launcher/launcher_multinode_tests '[.bench]'" >&2
  exit 1
}
