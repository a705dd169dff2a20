#!/usr/bin/env bash
# ctorch DDP versus Python's DDP (torch 1.13, /usr/bin/python3), same model, same world size, side by
# side: rounds alternate ctorch (the Reducer's Gloo allreduce), ctorch with CommHook::kSharedMemory
# and Python so all see the same machine load; prints every run, the median of the per-run medians,
# and the ratios. Models: mlp (1.2 M parameters at hidden 1024), cnn (the seeds' MNIST CNN), linear
# (Linear(20, 1): a step is almost only its one small allreduce). For the cnn, a fourth run per round:
# ctorch with torch's max_pool2d and glibc's default allocator, i.e. DDP alone.
# Usage: bench/ddp_step.sh [world=2] [rounds=3] [steps=50] [batch=64] [hidden=1024] [model=mlp]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
world=${1:-2}; rounds=${2:-3}; steps=${3:-50}; batch=${4:-64}; hidden=${5:-1024}; model=${6:-mlp}
"$root/scripts/build.sh" --target ddp_step_bench >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
cpp=$(find "$build" -name ddp_step_bench -type f -perm -u+x | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID || true

# Runs one job of $world processes: run_job <log> <command...>; rank 0's line goes to <log>.
run_job() {
  local log=$1; shift
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local pids=()
  for ((r = 0; r < world; r++)); do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=$world LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout 600 "$@" "$steps" 10 "$batch" "$hidden" "$model" >"$tmp/rank$r.out" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  grep impl= "$tmp/rank0.out" | tee -a "$log"
}

for ((i = 1; i <= rounds; i++)); do
  CTORCH_BENCH_HOOK=none run_job "$tmp/cpp.log" "$cpp"
  CTORCH_BENCH_HOOK=shared-memory run_job "$tmp/shm.log" "$cpp"
  if [[ $model == cnn ]]; then  # DDP alone: the pooling kernel and the allocator as Python has them
    CTORCH_BENCH_HOOK=shared-memory CTORCH_BENCH_TORCH_POOL=1 CTORCH_BENCH_DEFAULT_ALLOCATOR=1 \
      run_job "$tmp/plain.log" "$cpp"
  fi
  run_job "$tmp/py.log" /usr/bin/python3 "$root/bench/ddp_step.py"
done
median() { sed -E 's/.*median_ms=([0-9.]+).*/\1/' "$1" | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
c=$(median "$tmp/cpp.log"); s=$(median "$tmp/shm.log"); p=$(median "$tmp/py.log")
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.3f", a / b}'; }
echo "model=$model world=$world batch=$batch hidden=$hidden OMP_NUM_THREADS=$OMP_NUM_THREADS rounds=$rounds steps=$steps"
echo "median of per-run median step time: ctorch ${c} ms, ctorch shared-memory ${s} ms, python ${p} ms;" \
  "ctorch/python $(ratio "$c" "$p"), ctorch shared-memory/python $(ratio "$s" "$p")"
if [[ -s $tmp/plain.log ]]; then
  q=$(median "$tmp/plain.log")
  echo "ctorch shared-memory with torch's max_pool2d and glibc's default allocator (DDP alone): ${q} ms," \
    "/python $(ratio "$q" "$p")"
fi
