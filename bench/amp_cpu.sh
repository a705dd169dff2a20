#!/usr/bin/env bash
# bfloat16 autocast on the CPU (ctorch-train --amp --amp-dtype bfloat16) against float32, side by
# side in one run: the seeds' MNIST CNN on Fashion-MNIST, 2 ranks x 64 under ctorchrun, SGD lr 0.05
# momentum 0.9, the same seed; rounds alternate the two so both see the same machine. Reports the
# test accuracy after each epoch and the training samples/s of each epoch (median over the rounds).
#
#   bench/amp_cpu.sh [epochs=2] [rounds=2] [model=mnist-cnn]
#
# Results go to stdout and bench/results/amp_cpu-<date>.txt.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
epochs=${1:-2}
rounds=${2:-2}
model=${3:-mnist-cnn}
"$root/scripts/build.sh" --target ctorchrun ctorch-train >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$root/bench/results"
out=$root/bench/results/amp_cpu-$(date +%Y%m%d-%H%M%S).txt
unset OMP_NUM_THREADS RANK WORLD_SIZE MASTER_ADDR MASTER_PORT || true
{
  echo "# bench/amp_cpu.sh $epochs $rounds $model — $(date -Is), $(nproc) cores, $(uname -m)"
  echo "# $("$build/trainer/app/ctorch-train" --version 2>&1 | head -1)"
  for round in $(seq "$rounds"); do
    for mode in fp32 bf16; do
      dir=$work/$mode-$round
      extra=()
      [ "$mode" = bf16 ] && extra=(--amp --amp-dtype bfloat16)
      "$build/launcher/agent/ctorchrun" --standalone --nproc-per-node 2 --log-level warn \
        "$build/trainer/app/ctorch-train" --model "$model" --epochs "$epochs" --batch-size 64 --lr 0.05 \
        --momentum 0.9 --seed 1 --progress none --resume never --snapshot-path "$dir/snapshot.pt" \
        --save-every 0 "${extra[@]}" >/dev/null
      /usr/bin/python3 - "$dir/metrics.jsonl" "$mode" "$round" <<'PY'
import json, sys
path, mode, rnd = sys.argv[1:]
rs = [json.loads(l) for l in open(path)]
for r in rs:
    if r["kind"] == "epoch":
        acc = next((e["accuracy"] for e in rs if e["kind"] == "eval" and e["epoch"] == r["epoch"]), None)
        print(json.dumps({"mode": mode, "round": int(rnd), "epoch": r["epoch"],
                          "samples_per_s": round(r["samples_per_s"], 1), "loss": r["loss"], "accuracy": acc}))
PY
    done
  done
} | tee "$work/rows.txt"
/usr/bin/python3 - "$work/rows.txt" <<'PY' | tee -a "$work/rows.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("| epoch | fp32 samples/s | bf16 samples/s | bf16 / fp32 | fp32 accuracy | bf16 accuracy |")
print("|---|---|---|---|---|---|")
for ep in sorted({r["epoch"] for r in rows}):
    f = [r for r in rows if r["epoch"] == ep and r["mode"] == "fp32"]
    b = [r for r in rows if r["epoch"] == ep and r["mode"] == "bf16"]
    fs, bs = statistics.median(r["samples_per_s"] for r in f), statistics.median(r["samples_per_s"] for r in b)
    print(f"| {ep} | {fs:.0f} | {bs:.0f} | {bs / fs:.2f} | {100 * f[0]['accuracy']:.2f} % | {100 * b[0]['accuracy']:.2f} % |")
PY
cp "$work/rows.txt" "$out"
echo "written: $out"
