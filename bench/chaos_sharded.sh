#!/usr/bin/env bash
# In-place recovery of sharded runs (shard copies) against the group restart it replaces: the chaos
# harness's long suite, SIGKILL and SIGSEGV of a random worker, 15 faults per row (3 per run, 5 runs on
# the synthetic and Fashion-MNIST workloads), FSDP full and ZeRO-1, 2 and 3 ranks; every run checked
# bit-identical to an uninterrupted one. One row per (sharding, ranks, recovery), in one sitting.
# Usage: bench/chaos_sharded.sh [faults=15] [seed=5]    Writes bench/results/chaos-sharded-inplace-<date>.txt.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
faults=${1:-15}; seed=${2:-5}
[[ $faults =~ ^[1-9][0-9]*$ && $seed =~ ^[0-9]+$ ]] || { echo "chaos_sharded.sh: faults and seed are numbers" >&2; exit 2; }
out="$root/bench/results/chaos-sharded-inplace-$(date +%Y%m%d).txt"
echo "# bench/chaos_sharded.sh $faults $seed: $(date -u +%FT%TZ), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$out"
for sharding in full optimizer; do
  for world in 2 3; do
    for recovery in in-place restart; do
      args="--sharding $sharding"; [ "$recovery" = in-place ] && args+=" --shard-copies 1"
      echo "## --sharding $sharding, $world ranks, --recovery $recovery ($args)" | tee -a "$out"
      /usr/bin/python3 "$root/scripts/chaos/chaos.py" --suite long --kinds worker-kill,worker-segv --faults "$faults" \
          --per-run 3 --world "$world" --seed "$seed" --recovery "$recovery" --trainer-args "$args" 2>&1 |
        grep -E "PASS|FAIL|faults injected|n=|healed|reloaded|problem|passed" | tee -a "$out" || true
    done
  done
done
