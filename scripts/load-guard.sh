#!/usr/bin/env bash
# CI's guard against tests that pass only on a quiet machine (issues 33 and 40), everything with
# busy loops beside it: the scheduling-sensitive tests (the rendezvous simulation on its virtual
# clock) with one busy loop per core, then in-place recovery's chaos suites with four per core —
# 2 and 3 ranks on one host, and 3 hosts in the network-namespace lab (skipped where the lab cannot
# be made): every job is kept and ends bit-identical. About 2.5 min on 2 cores.
# Usage: scripts/load-guard.sh [build dir] [repeats]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:-${CTORCH_BUILD_DIR:-$root/build}}" && pwd)
repeats=${2:-5}
[ -n "$build" ] || { echo "load-guard: no build directory (run scripts/build.sh first)" >&2; exit 2; }
hogs=()
busy() {  # busy N: N more busy loops
  for _ in $(seq "$1"); do
    ( while :; do :; done ) &
    hogs+=($!)
  done
}
cleanup() { [ ${#hogs[@]} -eq 0 ] || kill "${hogs[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
busy "$(nproc)"
start=$(date +%s)
cd "$build"
ctest --output-on-failure -R "rendezvous simulation" --repeat "until-fail:$repeats" --timeout 120
echo "load-guard: the rendezvous simulation passed $repeats times under $(nproc) busy loops in $(( $(date +%s) - start )) s"

python=/usr/bin/python3
if ! { [ -x "$python" ] && "$python" -c 'import torch' 2>/dev/null && [ -x "$build/trainer/app/ctorch-train" ]; }; then
  echo "load-guard: in-place recovery under load skipped (needs Debian's python3-torch and ctorch-train)"
  exit 0
fi
busy $(( 3 * $(nproc) ))  # four per core in all
start=$(date +%s)
chaos=("$python" "$root/scripts/chaos/chaos.py" --ctorchrun "$build/launcher/agent/ctorchrun"
       --trainer "$build/trainer/app/ctorch-train")
"${chaos[@]}" --suite inplace --only synthetic --seed 3
"${chaos[@]}" --suite nodes-inplace --seed 3
echo "load-guard: in-place recovery kept every job, bit-identical, under $(( 4 * $(nproc) )) busy loops in" \
     "$(( $(date +%s) - start )) s"
