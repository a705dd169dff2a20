#!/usr/bin/env bash
# CI's guard against tests that pass only on a quiet machine (issue 33): the scheduling-sensitive
# tests (the rendezvous simulation on its virtual clock) repeated with every core busy beside them.
# About 30 s. Usage: scripts/load-guard.sh [build dir] [repeats]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-${CTORCH_BUILD_DIR:-$root/build}}
repeats=${2:-5}
[ -d "$build" ] || { echo "load-guard: no build directory $build (run scripts/build.sh first)" >&2; exit 2; }
hogs=()
cleanup() { [ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq "$(nproc)"); do
  ( while :; do :; done ) &
  hogs+=($!)
done
start=$(date +%s)
cd "$build"
ctest --output-on-failure -R "rendezvous simulation" --repeat "until-fail:$repeats" --timeout 120
echo "load-guard: the rendezvous simulation passed $repeats times under $(nproc) busy loops in $(( $(date +%s) - start )) s"
