#!/usr/bin/env bash
# How long the c10d rendezvous takes as the job grows: 32 to 1,000 agents (threads, each with its
# own connection, running ctorchrun's rendezvous executor) against ctorchrun's store server over
# loopback, min = max = N. Results go to stdout and bench/results/rendezvous-<date>.txt.
# Usage: bench/rendezvous.sh [N ...]   (default 32 64 128 256 512 1000; RDZV_CAS_ONLY=1: the join by
# compare-and-set on the whole state, as torch does, for comparison)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/build.sh" --target rdzv_scale_bench >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
bench=$(find "$build" -name rdzv_scale_bench -type f -perm -u+x | head -1)
mkdir -p "$root/bench/results"
out=$root/bench/results/rendezvous-$(date +%Y%m%d-%H%M%S).txt
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(32 64 128 256 512 1000)
{
  echo "c10d rendezvous at scale -- $(date -u +%FT%TZ) on $(hostname), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$bench" "${sizes[@]}"
} | tee "$out"
