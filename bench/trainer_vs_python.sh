#!/usr/bin/env bash
# ctorch-train against the Python peer (Debian's PyTorch 1.13: torchrun + DistributedDataParallel +
# DistributedSampler + DataLoader, bench/trainer/python_peer.py), side by side in one run on the same
# machine: the seeds' MNIST CNN on Fashion-MNIST, batch 64 per rank, SGD lr 0.05 momentum 0.9, Gloo,
# the system's BLAS for both (OpenBLAS when installed), each launcher's own OMP_NUM_THREADS rule
# (1 per worker when 2 share the node, unset for 1).
#
#   bench/trainer_vs_python.sh [speed|accuracy|all] [epochs] [rounds]
#
# speed (default epochs 1, rounds 2): time per epoch (training steps only) and samples/s at 1 and 2
#   ranks; rounds alternate C++ and Python so both see the same machine load; the best round of each
#   row is reported (the least disturbed one on a shared machine) together with the median.
# accuracy (default epochs 3): test accuracy after each epoch, ctorch-train with 2 ranks x 64 and
#   with 1 rank x 128 (the same global batch), and the Python peer with 2 ranks x 64.
# Results go to stdout and bench/results/trainer_vs_python-<date>.txt.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=${1:-all}
python=/usr/bin/python3
"$root/scripts/build.sh" --target ctorchrun ctorch-train >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
ctorchrun=$build/launcher/agent/ctorchrun
train=$build/trainer/app/ctorch-train
peer=$root/bench/trainer/python_peer.py
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results=$root/bench/results
mkdir -p "$results"
out=$results/trainer_vs_python-$(date +%Y%m%d-%H%M%S).txt
unset OMP_NUM_THREADS RANK WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID || true
records=$work/records.jsonl
: >"$records"

# cpp <label> <world> <epochs> [ctorch-train args...]: one ctorch-train run; its epoch/eval records.
cpp() {
  local label=$1 world=$2 epochs=$3; shift 3
  local dir=$work/run-$RANDOM
  mkdir -p "$dir"
  (cd "$dir" && "$ctorchrun" --log-level error --standalone --nproc-per-node "$world" "$train" --epochs "$epochs" \
     --log-interval 1000 --progress none "$@" >log.txt 2>&1) || { cat "$dir/log.txt" >&2; exit 1; }
  "$python" - "$dir/metrics.jsonl" "$label" "$world" >>"$records" <<'EOF'
import json, sys
path, label, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
accuracy = {}
lines = [json.loads(l) for l in open(path)]
for r in lines:
    if r["kind"] == "eval":
        accuracy[int(r["epoch"])] = r["accuracy"]
for r in lines:
    if r["kind"] == "epoch":
        print(json.dumps({"label": label, "world": world, "epoch": r["epoch"], "seconds": r["seconds"],
                          "samples_per_s": r["samples_per_s"], "accuracy": accuracy.get(r["epoch"])}))
EOF
}

# py <label> <world> <epochs> [python_peer args...]: one torchrun run of the Python peer.
py() {
  local label=$1 world=$2 epochs=$3; shift 3
  local dir=$work/py-$RANDOM
  mkdir -p "$dir"
  (cd "$dir" && /usr/bin/torchrun --standalone --nproc_per_node "$world" -r 1 -t 1 --log_dir "$dir/logs" \
     "$peer" --epochs "$epochs" "$@" >log.txt 2>&1) || { cat "$dir/log.txt" >&2; exit 1; }
  grep -o '{"impl": "python".*}' "$dir/log.txt" | "$python" -c '
import json, sys
label = sys.argv[1]
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"label": label, "world": r["world"], "epoch": r["epoch"], "seconds": r["train_seconds"],
                      "samples_per_s": r["samples_per_s"], "accuracy": r["test_accuracy"]}))' "$label" >>"$records"
}

{
  echo "ctorch-train vs Python peer -- $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "BLAS: $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3); $("$python" -c 'import torch; print("PyTorch", torch.__version__)')"
} | tee "$out"

if [ "$mode" = speed ] || [ "$mode" = all ]; then
  epochs=${2:-1}
  rounds=${3:-2}
  [ "$mode" = all ] && epochs=1 && rounds=2
  for ((i = 1; i <= rounds; i++)); do
    for world in 1 2; do
      cpp "ctorch-train" $world $epochs
      # The gradients through Gloo's allreduce, as Python's DDP moves them (the default is shared memory).
      [ "$world" -gt 1 ] && cpp "ctorch-train --comm-hook none" $world $epochs --comm-hook none
      py "python per-sample" $world $epochs --data per-sample
      py "python preloaded" $world $epochs --data preloaded
    done
    # Where the 1-rank difference comes from: ctorch-train uses CPUs / local ranks threads (2 here),
    # LibTorch's own default is the physical cores it detects (1 here).
    cpp "ctorch-train --threads 1" 1 $epochs --threads 1
    OMP_NUM_THREADS=2 py "python per-sample, 2 threads" 1 $epochs --data per-sample
    # ctorch::configureThreads keeps OpenBLAS to one thread under LibTorch's pool; what Python gets
    # from the same setting (which it can only make through the environment, before torch loads).
    OPENBLAS_NUM_THREADS=1 py "python preloaded, OpenBLAS 1" 1 $epochs --data preloaded
  done
fi
if [ "$mode" = accuracy ] || [ "$mode" = all ]; then
  epochs=${2:-3}
  [ "$mode" = all ] && epochs=3
  cpp "accuracy: ctorch-train 2 x 64" 2 $epochs
  cpp "accuracy: ctorch-train 1 x 128" 1 $epochs --batch-size 128
  py "accuracy: python 2 x 64" 2 $epochs --data preloaded
fi

"$python" - "$records" <<'EOF' | tee -a "$out"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
speed = {}
for r in rows:
    if not r["label"].startswith("accuracy"):
        speed.setdefault((r["label"], r["world"]), []).append(r)
if speed:
    print("\nspeed: training steps of one epoch (60,000 samples), batch 64 per rank; best (median) of the rounds")
    print(f"{'implementation':34} {'ranks':>5} {'s/epoch':>16} {'samples/s':>18} {'acc. epoch 1':>13}")
    best = {}
    for (label, world), rs in speed.items():
        s = min(r["seconds"] for r in rs)
        rate = max(r["samples_per_s"] for r in rs)
        best[(label, world)] = rate
        acc = [r["accuracy"] for r in rs if r["epoch"] == 1 and r["accuracy"] is not None]
        print(f"{label:34} {world:>5} {s:7.1f} ({statistics.median(r['seconds'] for r in rs):6.1f}) "
              f"{rate:8.0f} ({statistics.median(r['samples_per_s'] for r in rs):7.0f}) "
              f"{(100 * statistics.median(acc)) if acc else float('nan'):12.2f}%")
    print("\nratios (best samples/s): ctorch-train / python")
    for world in (1, 2):
        c = best.get(("ctorch-train", world))
        for peer in ("python per-sample", "python preloaded"):
            p = best.get((peer, world))
            if c and p:
                print(f"  {world} rank{'s' if world > 1 else ' '}: vs {peer:18} {c / p:5.2f}x")
acc = {}
for r in rows:
    if r["label"].startswith("accuracy"):
        acc.setdefault(r["label"], []).append(r)
if acc:
    print("\naccuracy: test accuracy (10,000 images) after each epoch")
    for label, rs in acc.items():
        print(f"  {label[10:]:26} " + "  ".join(f"epoch {r['epoch']}: {100 * r['accuracy']:.2f}%" for r in rs)
              + f"   ({statistics.median(r['seconds'] for r in rs):.1f} s/epoch)")
EOF
echo "(saved to $out)"
