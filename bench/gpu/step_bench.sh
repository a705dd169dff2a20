#!/usr/bin/env bash
# ctorch's DDP against PyTorch's, side by side in one run: bench/gpu/step_bench (C++) and
# bench/gpu/step_bench.py (Python), alternating, ROUNDS rounds each, one process each (world 1: NCCL on
# a GPU, Gloo on the CPU), the same model, batch, precision and data already on the device. Prints every
# round's line, then the medians and their ratio.
#   bench/gpu/step_bench.sh [ROUNDS] [extra flags for both: --model M --batch B --steps N --precision P]
# CTORCH_BUILD_DIR: where gpu_step_bench was built (default build/); PYTHON: the python with torch.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${CTORCH_BUILD_DIR:-$here/build}
rounds=${1:-3}
shift || true
bin=$build/bench/gpu/gpu_step_bench
python=${PYTHON:-python3}
[ -x "$bin" ] || { echo "step_bench: $bin not built (cmake --build $build --target gpu_step_bench)" >&2; exit 1; }
free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
run_one() {  # impl, then the command
  local impl=$1; shift
  env RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) \
      USE_LIBUV=${USE_LIBUV:-1} "$@" 2>&1 | tee /dev/stderr | grep "^impl=$impl " | sed -E 's/.*samples_per_s=([0-9.]+).*/\1/'
}
cpp=() py=()
for ((r = 1; r <= rounds; r++)); do
  v=$(run_one cpp "$bin" "$@"); [ -n "$v" ] && cpp+=("$v")
  v=$(run_one python "$python" "$here/bench/gpu/step_bench.py" "$@"); [ -n "$v" ] && py+=("$v")
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {if (NR) print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
mc=$(median "${cpp[@]}"); mp=$(median "${py[@]}")
echo "step_bench: samples/s per round: ctorch ${cpp[*]:-none}; python ${py[*]:-none}"
if [ -n "$mc" ] && [ -n "$mp" ]; then
  echo "step_bench: median ctorch $mc samples/s, python $mp samples/s, ratio $(awk -v a="$mc" -v b="$mp" 'BEGIN{printf "%.3f", a/b}') (ctorch / python; >1 is faster)"
else
  echo "step_bench: a side did not run (see the lines above)"
  exit 1
fi
