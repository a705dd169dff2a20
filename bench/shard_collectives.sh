#!/usr/bin/env bash
# Ring reduceScatter / allGather (ctorch::, flat_collectives.hpp) against an allreduce of the whole
# buffer then a chunk, and c10d's list allgather, on Gloo over 127.0.0.1: `rounds` jobs per world size,
# each printing the median of `reps` runs per size; prints every job's lines and the median over rounds.
# Usage: bench/shard_collectives.sh [worlds=2,4] [rounds=3] [reps=5] [sizes_mb=1,16,64] [segment_bytes=1048576]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$root/bench/lib.sh"
worlds=${1:-2,4}; rounds=${2:-3}; reps=${3:-5}; sizes=${4:-1,16,64}; segment=${5:-1048576}
"$root/scripts/build.sh" --target shard_collectives_bench >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
bin=$(find "$build" -name shard_collectives_bench -type f -perm -u+x | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID || true

for world in ${worlds//,/ }; do
  for ((i = 1; i <= rounds; i++)); do
    bench_ranks "$world" "$tmp/rank" 600 "$bin" "$sizes" "$reps" "$segment" ||
      { echo "shard_collectives.sh: world $world failed:" >&2; cat "$tmp"/rank*.out >&2; exit 1; }
    grep median_ms= "$tmp/rank0.out" | tee -a "$tmp/all.log"
  done
done
echo "median over $rounds rounds (each the median of $reps runs), ring segments of $segment bytes, OMP_NUM_THREADS=$OMP_NUM_THREADS," \
  "$(getconf _NPROCESSORS_ONLN) cores, load average $(cut -d' ' -f1-3 /proc/loadavg):"
sed -E 's/ median_ms=.*//' "$tmp/all.log" | awk '!seen[$0]++' | while read -r key; do
  grep -F "$key median_ms=" "$tmp/all.log" | sed -E 's/.*median_ms=//' | sort -g |
    awk -v k="$key" '{v[NR]=$1} END {printf "%s median_ms=%s\n", k, v[int((NR+1)/2)]}'
done
