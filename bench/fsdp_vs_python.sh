#!/usr/bin/env bash
# ctorch's sharding (zero_memory_bench under ctorchrun) against Python's DDP, ZeRO-1 and FSDP2 (bench/fsdp_step.py
# under torchrun), the same model and settings, side by side in one run in the modern lane (PyTorch/LibTorch 2.x).
# Usage: bench/fsdp_vs_python.sh [worlds=1,2,4] [layers=6] [width=4096] [steps=4]
#   MODES      ctorch modes to run, default "ddp zero fsdp"; one the binary does not accept is skipped with
#              "ctorch <mode>: not built"
#   PY_MODES   Python modes, default "ddp zero fsdp fsdp-noreshard"
#   TIMEOUT    seconds one job may run (default 1800), then it is stopped and reported as failed
#   MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_ARENA_MAX: glibc's, passed to both sides when set.
#              FSDP's per-layer buffers come and go every step; with glibc's default (a dynamic mmap threshold)
#              freed ones stay in the heap and raise the peak RSS (docs/fsdp-python-comparison-notes.md)
# Per world and mode, Python then ctorch (so both see the same load); every rank's line, then one table of
# rank 0's figures with the ratio ctorch / Python per cell (issue 31's goal: ctorch's FSDP step <= 0.8x).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
worlds=${1:-1,2,4}; layers=${2:-6}; width=${3:-4096}; steps=${4:-4}
MODES=${MODES:-ddp zero fsdp}
PY_MODES=${PY_MODES:-ddp zero fsdp fsdp-noreshard}
TIMEOUT=${TIMEOUT:-1800}
for v in "$layers" "$width" "$steps" "$TIMEOUT"; do
  [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "fsdp_vs_python.sh: '$v' is not a positive integer" >&2; exit 2; }
done
[[ $worlds =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "fsdp_vs_python.sh: worlds '$worlds' is not a list like 1,2,4" >&2; exit 2; }

. "$root/bench/lib.sh"
# Outside the root: build there, then run this script inside.
bench_in_modern_lane zero_memory_bench "MODES PY_MODES TIMEOUT" "$root/bench/fsdp_vs_python.sh" "$worlds" "$layers" "$width" "$steps"
bench_binaries zero_memory_bench "${BUILD:-$root/build-modern}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1 USE_LIBUV=0
lines=$work/lines.txt
: >"$lines"

# The modes zero_memory_bench accepts, from its usage line ("usage: ... <ddp|zero> ..."); empty if it names none.
accepted=$("$bin" 2>&1 | grep -o '<[a-z|-]*>' | head -1 | tr -d '<>' | tr '|' ' ' || true)

# job <impl> <mode> <world> <command...>: one job; its rank lines tagged with impl, or a line saying why not.
job() {
  local impl=$1 mode=$2 world=$3; shift 3
  bench_job "$impl $mode world=$world" "$world" 'rank=[0-9]* world=.*' "$TIMEOUT" "$@" |
    sed "s/^/impl=$impl /" | tee -a "$lines"
}

echo "machine: $(nproc --all) cores, $(free -g | awk '/Mem:/ {print $2}') GiB, load $(cut -d' ' -f1-3 /proc/loadavg);" \
     "$(date -u +%FT%TZ); $(python3 -c 'import torch; print("PyTorch", torch.__version__)'), Gloo, 1 thread per rank;" \
     "$layers x $width^2 parameters, Adam lr 1e-4, batch 8, $steps steps;" \
     "glibc malloc: $(env | grep -E '^MALLOC_(MMAP_THRESHOLD_|TRIM_THRESHOLD_|ARENA_MAX)=' | paste -sd' ' - | grep . || echo defaults)"
echo "ctorch modes accepted by zero_memory_bench: ${accepted:-(its usage names none)}"
for world in ${worlds//,/ }; do
  # Each mode once, in the order Python's then ctorch's lists give it; Python first within a mode.
  # shellcheck disable=SC2086 # the lists are split into their modes on purpose
  for mode in $(printf '%s\n' $PY_MODES $MODES | awk '!seen[$0]++'); do
    if [[ " $PY_MODES " == *" $mode "* ]]; then
      job python "$mode" "$world" torchrun --standalone --nproc-per-node "$world" --tee 3 \
        "$root/bench/fsdp_step.py" "$mode" "$layers" "$width" "$steps"
    fi
    if [[ " $MODES " == *" $mode "* ]]; then
      if [ -n "$accepted" ] && [[ " $accepted " != *" $mode "* ]]; then
        echo "ctorch $mode: not built"
      else
        job ctorch "$mode" "$world" "$launcher" --standalone --nproc-per-node "$world" --tee 3 \
          "$bin" "$mode" "$layers" "$width" "$steps"
      fi
    fi
  done
done

python3 - "$lines" <<'EOF'
import sys
rows = {}
for line in open(sys.argv[1]):
    f = dict(kv.split("=", 1) for kv in line.split())
    if f["rank"] == "0":
        rows[(int(f["world"]), f["mode"], f["impl"])] = f
metrics = [("params_mb", "parameters MB"), ("grads_mb", "gradients MB"), ("optimizer_mb", "optimizer MB"),
           ("peak_rss_mb", "peak RSS MB"), ("step_ms", "step ms")]
print()
print("rank 0; each cell: Python / ctorch (ctorch / Python)")
print("| ranks | mode | " + " | ".join(m[1] for m in metrics) + " |")
print("|---:|---|" + "---:|" * len(metrics))
for world, mode in dict.fromkeys((w, m) for (w, m, _) in rows):  # in the order they ran
    py, ct = rows.get((world, mode, "python")), rows.get((world, mode, "ctorch"))
    cells = []
    for key, _ in metrics:
        p = py[key] if py else "—"
        c = ct[key] if ct else "—"
        ratio = ""
        if py and ct and float(py[key]) > 0:
            ratio = f" ({float(ct[key]) / float(py[key]):.2f})"
        cells.append(f"{p} / {c}{ratio}")
    print(f"| {world} | {mode} | " + " | ".join(cells) + " |")
EOF
