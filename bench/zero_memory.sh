#!/usr/bin/env bash
# Per-rank memory (parameters, gradients, optimizer state, peak RSS) and median step time of DDP with
# the whole Adam against ZeRO-1 (ctorch::ZeroRedundancyOptimizer) and FullyShardedDataParallel (fsdp:
# each Linear a unit, full sharding; fsdp-grad-op: reshardAfterForward(false)) on an MLP of
# layers x width^2 parameters (default 6 x 4096^2 = 100.7 M), at 1, 2 and 4 ranks on this host, one job
# per cell under ctorchrun. Prints every rank's line; docs/sharding.md quotes rank 0's (the largest
# share with ZeRO). peak_rss_mb is in MiB (getrusage), the other sizes in MB (10^6 bytes).
# Usage: [MODES=ddp,zero,fsdp,fsdp-grad-op] bench/zero_memory.sh [worlds=1,2,4] [layers=6] [width=4096] [steps=4]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
worlds=${1:-1,2,4}; layers=${2:-6}; width=${3:-4096}; steps=${4:-4}
modes=${MODES:-ddp,zero,fsdp,fsdp-grad-op}
. "$root/bench/lib.sh"
bench_binaries zero_memory_bench
export OMP_NUM_THREADS=1
echo "machine: $(nproc --all) cores, $(free -g | awk '/Mem:/ {print $2}') GiB; $(date -u +%FT%TZ); $layers x $width^2 parameters, Adam, batch 8; modes $modes; load average $(cut -d" " -f1-3 /proc/loadavg)"
for world in ${worlds//,/ }; do
  for mode in ${modes//,/ }; do
    "$launcher" --standalone --nproc-per-node "$world" --tee 3 "$bin" "$mode" "$layers" "$width" "$steps" 2>&1 |
      grep -o 'rank=.*' | sort
  done
done
