#!/usr/bin/env bash
# Pipeline parallelism on this host: the measured bubble (time a stage waits in receives / its step)
# against the (S-1)/(M+S-1) model, and the heap a stage holds at most during a step above its start (activations), for
# GPipe and 1F1B at S stages and M in MICRO (default 1,2,4,8), one ctorchrun job per cell, one thread
# per rank. On a 2-core machine keep S = 2 (more ranks than cores measures the scheduler, not the bubble).
# Usage: [MICRO=1,2,4,8] bench/pipeline.sh [S=2] [layers=8] [width=256] [batch=8192] [steps=5]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stages=${1:-2}; layers=${2:-8}; width=${3:-256}; batch=${4:-8192}; steps=${5:-5}
micro=${MICRO:-1,2,4,8}
. "$root/bench/lib.sh"
bench_binaries pipeline_bench
export OMP_NUM_THREADS=1
echo "machine: $(nproc --all) cores; $(date -u +%FT%TZ); S=$stages, $layers x Linear($width, $width) + ReLU, batch $batch, SGD; median of $steps steps; load average $(cut -d" " -f1-3 /proc/loadavg)"
for m in ${micro//,/ }; do
  for schedule in gpipe 1f1b; do
    "$launcher" --standalone --nproc-per-node "$stages" --tee 3 "$bin" "$schedule" "$layers" "$width" "$batch" "$m" "$steps" 2>&1 |
      grep -o 'rank=.*' | sort
  done
done
