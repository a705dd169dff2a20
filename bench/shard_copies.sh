#!/usr/bin/env bash
# What shard copies (ctorch-train --shard-copies 1: each rank's shard sent to the next rank at every
# step, for in-place recovery of a sharded run) cost a step: the same short run with 0 and 1 copies,
# interleaved, for FSDP full and ZeRO-1, under ctorchrun --recovery in-place (copies are made only there).
# Usage: bench/shard_copies.sh [rounds=3] [ranks=2] [model=resnet18] [steps per rank=12]
#   Reads each run's epoch record (metrics.jsonl: seconds, steps run, the agreement phase that holds the
#   copy) and prints per-step medians and the ratio copies/no copies. Writes bench/results/shard-copies-<date>.txt.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${1:-3}; ranks=${2:-2}; model=${3:-resnet18}; steps=${4:-12}
for v in "$rounds" "$ranks" "$steps"; do [[ $v =~ ^[1-9][0-9]*$ ]] || { echo "shard_copies.sh: '$v' is not a positive number" >&2; exit 2; }; done
ctorchrun=${CTORCHRUN:-$root/build/launcher/agent/ctorchrun}
train=${CTORCH_TRAIN:-$root/build/trainer/app/ctorch-train}
for b in "$ctorchrun" "$train"; do [ -x "$b" ] || { echo "shard_copies.sh: $b is not built (scripts/build.sh --target ctorchrun ctorch-train)" >&2; exit 2; }; done
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
batch=32
size=$((steps * batch * ranks))
shape=3,32,32; [ "$model" = linear ] && shape=""
out="$root/bench/results/shard-copies-$(date +%Y%m%d).txt"
{
  echo "# bench/shard_copies.sh $rounds $ranks $model $steps: $(date -u +%FT%TZ), $(nproc) cores, $(uname -r)"
  echo "# ctorch-train --model $model --dataset synthetic-images (shape $shape), batch $batch per rank, $ranks ranks, Adam, 1 epoch of $steps steps, ctorchrun --recovery in-place"
} | tee "$out"
declare -A per_step agree
run() {  # sharding copies round
  local d="$work/$1-$2-$3"; mkdir -p "$d"
  (cd "$d" && timeout 900 "$ctorchrun" --standalone --nproc-per-node "$ranks" --recovery in-place --max-restarts 1 \
      "$train" --model "$model" --dataset synthetic-images ${shape:+--synthetic-shape $shape} --synthetic-size "$size" \
      --batch-size $batch --epochs 1 --optimizer adam --lr 0.001 --sharding "$1" --shard-copies "$2" --save-every 0 \
      --test-limit 64 --progress none --threads 1 > log.txt 2>&1) || { echo "run $1 copies $2 failed: $d/log.txt" >&2; tail -5 "$d/log.txt" >&2; exit 1; }
  /usr/bin/python3 - "$d/metrics.jsonl" <<'PY'
import json, sys
e = [json.loads(l) for l in open(sys.argv[1]) if '"epoch"' in l]
e = [r for r in e if r.get("kind", r.get("type")) == "epoch"] or e
r = e[-1]
print(f"{r['seconds'] / r['steps_run']:.4f} {r['phase_seconds']['agreement'] / r['steps_run']:.4f}")
PY
}
for ((i = 1; i <= rounds; i++)); do
  for sharding in full optimizer; do
    for copies in 0 1; do
      read -r s a < <(run "$sharding" "$copies" "$i")
      per_step[$sharding,$copies]+="$s "; agree[$sharding,$copies]+="$a "
      echo "round $i  --sharding $sharding --shard-copies $copies: $s s/step (agreement + copies $a s/step)" | tee -a "$out"
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
for sharding in full optimizer; do
  m0=$(echo "${per_step[$sharding,0]}" | median); m1=$(echo "${per_step[$sharding,1]}" | median)
  a0=$(echo "${agree[$sharding,0]}" | median); a1=$(echo "${agree[$sharding,1]}" | median)
  echo "--sharding $sharding: median step $m0 s without copies, $m1 s with (x$(awk -v a="$m1" -v b="$m0" 'BEGIN{printf "%.3f", a/b}')); agreement phase $a0 -> $a1 s/step" | tee -a "$out"
done
grep -h "shard copies:" "$work"/*/log.txt | sed 's/^\[default0\]://' | sort -u | tee -a "$out"
