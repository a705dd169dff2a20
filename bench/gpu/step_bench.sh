#!/usr/bin/env bash
# ctorch's DDP against PyTorch's, side by side in one run, one process at a time on one device
# (world 1: NCCL on a GPU, Gloo on the CPU), the same model, precision and data already on the device:
#   py-eager, py-channels-last, py-compile       bench/gpu/step_bench.py (torch.compile, default mode)
#   cpp-eager, cpp-mt-cl                         bench/gpu/gpu_step_bench (torch::optim; ctorch::optim
#                                                + channels-last)
#   cpp-graphs, cpp-graphs-mt-cl                 gpu_step_bench --cuda-graphs (the same two, each step
#                                                a replayed CUDA graph), when its --help lists the flag;
#                                                else recorded "not built"
# For each batch size (largest first), ROUNDS rounds of STEPS steps per implementation, in two passes:
# C++, Python, [CUDA graphs], then again; inside a process the variants alternate round by round.
# Every line as it comes, then the summary (bench/gpu/step_bench.py --report): per implementation the
# median samples/s, min-max, the step time, the achieved TFLOP/s and its share of the bf16 peak, and
# the ratios ctorch / Python of the medians.
#   bench/gpu/step_bench.sh [--rounds 5] [--steps 200] [--warmup 15] [--batches "256 32"]
#       [--precision bf16] [--model resnet18] [--budget-s 300] [--compile-backend inductor]
#       [--cpp-variants eager,mt-cl] [--py-variants eager,channels-last,compile] [--peak-tflops 989]
# CTORCH_BUILD_DIR: where gpu_step_bench was built (default build/); PYTHON: the python with torch.
# Exit 0 when every implementation that is built gave at least one round at every batch size.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${CTORCH_BUILD_DIR:-$here/build}
bin=$build/bench/gpu/gpu_step_bench
python=${PYTHON:-python3}
rounds=5 steps=200 warmup=15 batches="256 32" precision=bf16 model=resnet18 budget=300 backend=inductor
cpp_variants=eager,mt-cl py_variants=eager,channels-last,compile peak=989
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2 ;; --steps) steps=$2 ;; --warmup) warmup=$2 ;; --batches) batches=$2 ;;
    --precision) precision=$2 ;; --model) model=$2 ;; --budget-s) budget=$2 ;; --compile-backend) backend=$2 ;;
    --cpp-variants) cpp_variants=$2 ;; --py-variants) py_variants=$2 ;; --peak-tflops) peak=$2 ;;
    *) echo "step_bench: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift 2
done
[ -x "$bin" ] || { echo "step_bench: $bin not built (cmake --build $build --target gpu_step_bench)" >&2; exit 1; }
start=$(date +%s)
lines=$(mktemp)
trap 'rm -f "$lines"' EXIT
left() { echo $(( budget - ($(date +%s) - start) )); }
graphs=0
"$bin" --help 2>&1 | grep -q -- '--cuda-graphs' && graphs=1
echo "step_bench: $model, $precision, batches $batches, $rounds rounds of $steps steps (+$warmup warm-up) per implementation;" \
     "CUDA graphs: $([ $graphs -eq 1 ] && echo built || echo 'not built'); budget ${budget}s"
# run_one NAME BATCH -- COMMAND...: one process, time-boxed by the budget; its impl= lines kept. A world of
# 1 needs no store: no MASTER_ADDR/MASTER_PORT (ctorch then uses a HashStore, step_bench.py too).
run_one() {
  local name=$1 batch=$2; shift 3
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 20 ]; then
    echo "impl=$name batch=$batch status=not-run reason=out of time (${remaining}s of ${budget}s left)" | tee -a "$lines"
    return
  fi
  local t0; t0=$(date +%s)
  env -u MASTER_ADDR -u MASTER_PORT -u TORCHELASTIC_USE_AGENT_STORE RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 \
      USE_LIBUV=${USE_LIBUV:-1} timeout --kill-after=5 $((remaining - 5)) "$@" 2>&1 | tee -a "$lines"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || echo "impl=$name batch=$batch status=failed reason=exit $rc after $(( $(date +%s) - t0 ))s" | tee -a "$lines"
}
for batch in $batches; do
  for pass in 1 2; do
    n=$(( pass == 1 ? (rounds + 1) / 2 : rounds / 2 ))
    first=$(( pass == 1 ? 1 : (rounds + 1) / 2 + 1 ))
    [ "$n" -gt 0 ] || continue
    common=(--model "$model" --batch "$batch" --steps "$steps" --warmup "$warmup" --precision "$precision"
            --rounds "$n" --first-round "$first")
    run_one cpp "$batch" -- "$bin" "${common[@]}" --variants "$cpp_variants"
    run_one py "$batch" -- "$python" "$here/bench/gpu/step_bench.py" "${common[@]}" --variants "$py_variants" \
      --compile-backend "$backend"
    if [ $graphs -eq 1 ]; then
      run_one cpp-graphs "$batch" -- "$bin" "${common[@]}" --variants "$cpp_variants" --cuda-graphs
    elif [ $pass -eq 1 ]; then
      echo "impl=cpp-graphs batch=$batch status=not-built reason=gpu_step_bench --help lists no --cuda-graphs" | tee -a "$lines"
    fi
  done
done
grep '^impl=' "$lines" | grep -v 'status=' | sed 's/^/step_bench: round: /' | sort -t= -k2,2 -s
"$python" "$here/bench/gpu/step_bench.py" --report "$lines" --model "$model" --peak-tflops "$peak"
# Every implementation that is built (and not recorded as failing to compile) gave a round at every batch.
missing=0
for batch in $batches; do
  for impl in $(grep -oE '^impl=[^ ]+' "$lines" | sort -u | cut -d= -f2); do
    grep -qE "^impl=$impl .*batch=$batch .*status=(not-built|failed reason=[A-Za-z]*(Error|Exception))" "$lines" && continue
    grep -qE "^impl=$impl .*batch=$batch .*samples_per_s=" "$lines" || { echo "step_bench: no round of $impl at batch $batch"; missing=1; }
  done
done
echo "step_bench: took $(( $(date +%s) - start ))s of ${budget}s"
exit $missing
