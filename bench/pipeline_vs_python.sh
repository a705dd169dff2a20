#!/usr/bin/env bash
# ctorch's pipeline (pipeline_bench under ctorchrun) against Python's torch.distributed.pipelining
# (bench/pipeline_step.py under torchrun): the same MLP, partition, batch and schedule, side by side in one
# run in the modern lane (PyTorch/LibTorch 2.x), one thread per rank. Per cell Python first, then ctorch;
# ctorch without its memory sampling thread (it slows the step); then a table of rank 0's median whole step with the ratio ctorch / Python (issue 45's goal: <= 0.8).
# Usage: [MICRO=4,8] [SCHEDULES="gpipe 1f1b"] bench/pipeline_vs_python.sh [S=2] [layers=8] [width=256] [batch=8192] [steps=5]
#   MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_ARENA_MAX: glibc's, passed to both sides when set.
#   They matter here more than anything else: with glibc's dynamic thresholds the ~1 MB activations a
#   step frees and takes again go back to the kernel and come back as fresh pages (2-4x the step).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
stages=${1:-2}; layers=${2:-8}; width=${3:-256}; batch=${4:-8192}; steps=${5:-5}
MICRO=${MICRO:-4,8}
SCHEDULES=${SCHEDULES:-gpipe 1f1b}
for v in "$stages" "$layers" "$width" "$batch" "$steps"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "pipeline_vs_python.sh: '$v' is not a positive integer" >&2; exit 2; }
done
[[ $MICRO =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "pipeline_vs_python.sh: MICRO '$MICRO' is not a list like 4,8" >&2; exit 2; }

. "$root/bench/lib.sh"
bench_in_modern_lane pipeline_bench "MICRO SCHEDULES" "$root/bench/pipeline_vs_python.sh" "$stages" "$layers" "$width" "$batch" "$steps"
bench_binaries pipeline_bench "${BUILD:-$root/build-modern}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 USE_LIBUV=0
lines=$work/lines.txt
: >"$lines"

job() {  # job <label> <command...>: its rank lines (kept for the table), or why not
  local label=$1; shift
  bench_job "$label" "$stages" 'rank=[0-9]* impl=.*' 600 "$@" | tee -a "$lines"
}

echo "machine: $(nproc --all) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ);" \
     "$(python3 -c 'import torch; print("PyTorch", torch.__version__)'), Gloo, 1 thread per rank;" \
     "S=$stages, $layers x Linear($width, $width) + ReLU + Linear($width, 10), batch $batch, SGD, median of $steps steps;" \
     "glibc malloc: $(env | grep -E '^MALLOC_(MMAP_THRESHOLD_|TRIM_THRESHOLD_|ARENA_MAX)=' | paste -sd' ' - | grep . || echo defaults)"
for m in ${MICRO//,/ }; do
  for schedule in $SCHEDULES; do
    job "python-$schedule-$m" torchrun --standalone --nproc-per-node "$stages" --tee 3 \
      "$root/bench/pipeline_step.py" "$schedule" "$layers" "$width" "$batch" "$m" "$steps"
    job "ctorch-$schedule-$m" "$launcher" --standalone --nproc-per-node "$stages" --tee 3 \
      "$bin" "$schedule" "$layers" "$width" "$batch" "$m" "$steps" nomemory
  done
done

python3 - "$lines" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    f = dict(kv.split("=", 1) for kv in line.split())
    if f["rank"] == "0":
        rows[(f["schedule"], int(f["M"]), f["impl"])] = float(f["step_ms"])
print()
print("rank 0's median whole step, ms: Python / ctorch (ctorch / Python)")
print("| schedule | M | step |")
print("|---|---:|---:|")
for schedule, m in dict.fromkeys((s, m) for (s, m, _) in rows):
    py, ct = rows.get((schedule, m, "python")), rows.get((schedule, m, "ctorch"))
    ratio = f" ({ct / py:.2f})" if py and ct else ""
    print(f"| {schedule} | {m} | {py or '—'} / {ct or '—'}{ratio} |")
PY
