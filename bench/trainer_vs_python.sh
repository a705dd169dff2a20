#!/usr/bin/env bash
# ctorch-train against the Python peer (Debian's PyTorch 1.13: torchrun + DistributedDataParallel +
# DistributedSampler + DataLoader, bench/trainer/python_peer.py), side by side in one run on the same
# machine: the seeds' MNIST CNN on Fashion-MNIST, batch 64 per rank, SGD lr 0.05 momentum 0.9, Gloo,
# the system's BLAS for both (OpenBLAS when installed), each launcher's own OMP_NUM_THREADS rule
# (1 per worker when 2 share the node, unset for 1).
#
#   bench/trainer_vs_python.sh speed [epochs=1] [rounds=2] [train-limit=0]
#   bench/trainer_vs_python.sh accuracy [epochs=3] [seeds=1]
#   bench/trainer_vs_python.sh all          (speed 1 2, then accuracy 3 1)
#   BENCH_MODEL=resnet18 bench/trainer_vs_python.sh speed 1 2 384
#                  ResNet-18 on CIFAR-shaped synthetic images (3x32x32, train-limit of them, default
#                  51,200), batch BENCH_BATCH (32) per rank, instead of the CNN on Fashion-MNIST; the
#                  Python peer's data are preloaded random tensors (no per-sample row).
#
# speed: time per epoch (training steps only) and samples/s at 1 and 2 ranks (train-limit > 0: that
#   many samples of the training set, for shorter runs); rounds alternate C++ and Python so both see
#   the same machine load; each row reports its best round and the median of the rounds, and the
#   ratios are given for both. Also measured in every round: both implementations at the same thread
#   count (Python at OMP_NUM_THREADS=2, and with OPENBLAS_NUM_THREADS=1 as ctorch sets it), the
#   ceiling's unit (ctorch-train --threads 1 at 1 rank: the ceiling is twice it) and two independent
#   1-rank, 1-thread runs at the same time (what two processes that never meet reach on this machine),
#   and Python like for like at 1 and 2 ranks: ctorch-train's threads (OMP_NUM_THREADS=2 at 1 rank,
#   torchrun's 1 at 2; OPENBLAS_NUM_THREADS=1) and its allocator (what ctorch::tuneAllocator sets with
#   mallopt, through glibc's MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824) --
#   the ratio the README leads with; Python's default rows are beside it, labelled.
# accuracy: test accuracy after each epoch, ctorch-train and the Python peer with 2 ranks x 64, for
#   seeds 1..S (--seed on both sides: the same sampler order; weights and dropout drawn by each
#   side's own generator calls), the mean over the seeds, and ctorch-train with 1 rank x 128 (the
#   same global batch) for seed 1.
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
. "$root/scripts/lib/ports.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
results=$root/bench/results
mkdir -p "$results"
out=$results/trainer_vs_python${BENCH_MODEL:+-$BENCH_MODEL}-$(date +%Y%m%d-%H%M%S).txt
source "$root/bench/python_settings.sh"
unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID || true
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
  with_fresh_port py_run "$dir" "$world" "$epochs" "$@" || { cat "$dir/log.txt" >&2; exit 1; }
  grep -o '{"impl": "python".*}' "$dir/log.txt" | "$python" -c '
import json, sys
label = sys.argv[1]
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps({"label": label, "world": r["world"], "epoch": r["epoch"], "seconds": r["train_seconds"],
                      "samples_per_s": r["samples_per_s"], "accuracy": r["test_accuracy"]}))' "$label" >>"$records"
}

# py_run PORT DIR WORLD EPOCHS ARGS...: torchrun with its static rendezvous, the store its own on PORT (a
# port below the ephemeral range) and its workers the store's clients, as ctorchrun's are. Not torchrun
# 1.13's --standalone: that is c10d on the fixed localhost:29400, and there it gives its workers a
# MASTER_PORT found by binding port 0 and closing. 98 when the port was taken.
py_run() {
  local port=$1 dir=$2 world=$3 epochs=$4; shift 4
  rm -rf "$dir/logs"
  (cd "$dir" && /usr/bin/torchrun --nnodes 1 --nproc_per_node "$world" --master_addr 127.0.0.1 --master_port "$port" \
     -r 1 -t 1 --log_dir "$dir/logs" "$peer" --epochs "$epochs" "$@" >log.txt 2>&1) && return 0
  ! port_taken "$dir/log.txt" || return 98
  return 1
}

{
  echo "ctorch-train vs Python peer -- $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "BLAS: $(readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3); $("$python" -c 'import torch; print("PyTorch", torch.__version__)')"
} | tee "$out"

if [ "$mode" = speed ] || [ "$mode" = all ]; then
  epochs=${2:-1}
  rounds=${3:-2}
  limit=${4:-0}
  [ "$mode" = all ] && epochs=1 && rounds=2 && limit=0
  short=()
  [ "$limit" -gt 0 ] && short=(--train-limit "$limit" --test-limit 1000)
  if [ "${BENCH_MODEL:-mnist-cnn}" = resnet18 ]; then
    # ctorch-train's arguments go after short (the peer's --data is chosen per row below).
    short+=(--model resnet18 --batch-size "${BENCH_BATCH:-32}")
    cppmodel=(--dataset synthetic-images --synthetic-shape 3,32,32 --synthetic-size "$([ "$limit" -gt 0 ] && echo "$limit" || echo 51200)")
    pydata() { echo synthetic; }
  else
    cppmodel=()
    pydata() { echo "$1"; }
  fi
  for ((i = 1; i <= rounds; i++)); do
    for world in 1 2; do
      cpp "ctorch-train" $world $epochs "${short[@]}" "${cppmodel[@]}"
      # The gradients through Gloo's allreduce, as Python's DDP moves them (the default is shared memory).
      [ "$world" -gt 1 ] && cpp "ctorch-train --comm-hook none" $world $epochs --comm-hook none "${short[@]}" "${cppmodel[@]}"
      [ "${BENCH_MODEL:-mnist-cnn}" = resnet18 ] || py "python per-sample" $world $epochs --data per-sample "${short[@]}"
      py "python preloaded" $world $epochs --data "$(pydata preloaded)" "${short[@]}"
    done
    # At 1 rank ctorch-train runs CPUs / local ranks threads (2 here) with OpenBLAS at one under them;
    # torch's own default is the physical cores it detects. Python at the same count, with OpenBLAS
    # as torch leaves it and as ctorch sets it (which Python can only do before torch loads).
    OMP_NUM_THREADS=2 py "python preloaded, 2 threads" 1 $epochs --data "$(pydata preloaded)" "${short[@]}"
    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 py "python preloaded, 2 thr, BLAS 1" 1 $epochs --data "$(pydata preloaded)" "${short[@]}"
    # Like for like: the same threads as ctorch-train (at 2 ranks torchrun's OMP_NUM_THREADS=1 already
    # is) and the same allocator settings as its ctorch::tuneAllocator, through glibc's environment.
    for world in 1 2; do
      (
        export OPENBLAS_NUM_THREADS=1 "${same_allocator[@]}"
        [ "$world" -gt 1 ] || export OMP_NUM_THREADS=2
        py "python preloaded, like for like" $world $epochs --data "$(pydata preloaded)" "${short[@]}"
      ) || exit 1
    done
    # The ceiling's unit, and two such processes side by side that never meet.
    cpp "ctorch-train --threads 1" 1 $epochs --threads 1 "${short[@]}" "${cppmodel[@]}"
    cpp "independent --threads 1 (a)" 1 $epochs --threads 1 "${short[@]}" "${cppmodel[@]}" &
    cpp "independent --threads 1 (b)" 1 $epochs --threads 1 "${short[@]}" "${cppmodel[@]}"
    wait
  done
fi
if [ "$mode" = accuracy ] || [ "$mode" = all ]; then
  epochs=${2:-3}
  seeds=${3:-1}
  [ "$mode" = all ] && epochs=3 && seeds=1
  for ((seed = 1; seed <= seeds; seed++)); do
    cpp "accuracy: ctorch-train 2 x 64" 2 $epochs --seed $seed
    py "accuracy: python 2 x 64" 2 $epochs --data preloaded --seed $seed
  done
  cpp "accuracy: ctorch-train 1 x 128, seed 1" 1 $epochs --batch-size 128 --seed 1
fi

"$python" - "$records" <<'EOF' | tee -a "$out"
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
speed = {}
for r in rows:
    if not r["label"].startswith("accuracy"):
        speed.setdefault((r["label"], r["world"]), []).append(r)
if speed:
    print(f"\nspeed: training steps of one epoch, batch {os.environ.get('BENCH_BATCH') or (32 if os.environ.get('BENCH_MODEL') == 'resnet18' else 64)} per rank; best (median) of the rounds")
    print(f"{'implementation':34} {'ranks':>5} {'s/epoch':>16} {'samples/s':>18} {'acc. epoch 1':>13}")
    best, med = {}, {}
    for (label, world), rs in speed.items():
        s = min(r["seconds"] for r in rs)
        best[(label, world)] = max(r["samples_per_s"] for r in rs)
        med[(label, world)] = statistics.median(r["samples_per_s"] for r in rs)
        acc = [r["accuracy"] for r in rs if r["epoch"] == 1 and r["accuracy"] is not None]
        print(f"{label:34} {world:>5} {s:7.1f} ({statistics.median(r['seconds'] for r in rs):6.1f}) "
              f"{best[(label, world)]:8.0f} ({med[(label, world)]:7.0f}) "
              f"{(100 * statistics.median(acc)) if acc else float('nan'):12.2f}%")
    print("\nratios: best (median) samples/s (> 1: ctorch-train faster)")
    like = "python preloaded, like for like"
    pairs = [(("ctorch-train", 1), (like, 1)), (("ctorch-train", 2), (like, 2)),
             (("ctorch-train --comm-hook none", 2), (like, 2)),
             (("ctorch-train", 1), ("python preloaded, 2 thr, BLAS 1", 1)),
             (("ctorch-train", 1), ("python preloaded, 2 threads", 1)),
             (("ctorch-train", 1), ("python per-sample", 1)), (("ctorch-train", 1), ("python preloaded", 1)),
             (("ctorch-train", 2), ("python per-sample", 2)), (("ctorch-train", 2), ("python preloaded", 2))]
    print("  (first like for like: Python with the same threads and allocator settings as ctorch-train; then the same\n"
          "   threads on glibc's defaults; then Python as its users run it by default, per-sample and preloaded)")
    for a, b in pairs:
        if a in best and b in best:
            print(f"  {a[0]:29} {a[1]} rank{'s' if a[1] > 1 else ' '} / {b[0]:32} "
                  f"{best[a] / best[b]:5.2f} ({med[a] / med[b]:5.2f})")
    unit = ("ctorch-train --threads 1", 1)
    if unit in best:
        print(f"\nceiling: 2 x ctorch-train --threads 1 at 1 rank = {2 * best[unit]:.0f} ({2 * med[unit]:.0f}) samples/s")
        for label in ("ctorch-train", "ctorch-train --comm-hook none", "python preloaded", like):
            if (label, 2) in best:
                print(f"  {label + ' 2 ranks':36} {best[(label, 2)] / (2 * best[unit]):5.2f} "
                      f"({med[(label, 2)] / (2 * med[unit]):5.2f}) of it")
        pair = [speed.get((f"independent --threads 1 ({x})", 1)) for x in "ab"]
        if all(pair):
            sums = [a["samples_per_s"] + b["samples_per_s"] for a, b in zip(*pair)]
            slower = [2 * min(a["samples_per_s"], b["samples_per_s"]) for a, b in zip(*pair)]
            print(f"  {'two independent 1-thread processes':36} {max(sums) / (2 * best[unit]):5.2f} "
                  f"({statistics.median(sums) / (2 * med[unit]):5.2f}) of it (the pair's sum in each round)")
            # Ranks that meet every step go at the slower one's pace: a bound for any synchronous DDP here.
            print(f"  {'  ... paced by the slower of the two':36} {max(slower) / (2 * best[unit]):5.2f} "
                  f"({statistics.median(slower) / (2 * med[unit]):5.2f}) of it (2 x the slower of the pair)")
            print("  pairs (samples/s): " + ", ".join(f"{a['samples_per_s']:.0f}+{b['samples_per_s']:.0f}"
                                                   for a, b in zip(*pair)))
acc = {}
for r in rows:
    if r["label"].startswith("accuracy"):
        acc.setdefault(r["label"], []).append(r)
if acc:
    print("\naccuracy: test accuracy (10,000 images) after each epoch, one line per seed")
    final = {}
    for label, rs in acc.items():
        epochs = max(r["epoch"] for r in rs)
        runs = [rs[i:i + epochs] for i in range(0, len(rs), epochs)]
        for run in runs:
            print(f"  {label[10:]:38} " + "  ".join(f"epoch {r['epoch']}: {100 * r['accuracy']:.2f}%" for r in run)
                  + f"   ({statistics.median(r['seconds'] for r in run):.1f} s/epoch)")
        final[label] = [100 * run[-1]["accuracy"] for run in runs]
    c, p = final.get("accuracy: ctorch-train 2 x 64"), final.get("accuracy: python 2 x 64")
    if c and p:
        print(f"  final accuracy, mean over {len(c)} seed(s): ctorch-train {statistics.mean(c):.2f}% "
              f"({min(c):.2f}-{max(c):.2f}), python {statistics.mean(p):.2f}% ({min(p):.2f}-{max(p):.2f}); "
              f"difference {statistics.mean(c) - statistics.mean(p):+.2f} points")
EOF
echo "(saved to $out)"
