#!/usr/bin/env bash
# Installs this build tree into a temporary prefix, builds tests/consumer against it with only
# -DCMAKE_PREFIX_PATH (find_package(ctorch)), and runs it: alone (no distributed variables: a world
# of 1) and as 2 processes with the torchrun variables (rank 0 hosts the store on a free port).
# Usage: run.sh <build-dir> <expected-output-regex>
set -euo pipefail
build=$1
expect=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
cmake --install "$build" --prefix "$tmp/installed" >/dev/null
# The package is relocatable: it names no path of the LibTorch it was built with (Torch comes from
# find_dependency(Torch)), and it still works after the whole prefix is moved.
if grep -nE '/[^";]*lib(c10|torch)[a-z_]*\.so' "$tmp"/installed/lib*/cmake/ctorch/ctorchTargets*.cmake; then
  echo "the installed package hard-codes LibTorch library paths (above)"; exit 1
fi
mv "$tmp/installed" "$tmp/prefix"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Paths under the fresh temporary prefix differ on every run: relative to it, ccache hits again.
export CCACHE_BASEDIR=$tmp CCACHE_NOHASHDIR=1
cmake -S "$here" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" "${launcher[@]}" >/dev/null
cmake --build "$tmp/build" --parallel 2 >/dev/null
consumer=$tmp/build/consumer

# Clean slate: the test may itself run under a launcher or Slurm.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE \
      SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_JOB_ID SLURM_STEP_NODELIST SLURM_JOB_NODELIST || true
export OMP_NUM_THREADS=1

# A world of 1: no variables at all.
out=$(timeout 120 "$consumer")
echo "$out"
echo "$out" | grep -Eq "$expect"
echo "$out" | grep -q "consumer: rank 0/1 (no launcher) ddp step averaged"

# Two ranks on 127.0.0.1, a port the OS says is free.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for rank in 0 1; do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout 120 "$consumer" >"$tmp/rank$rank.log" 2>&1 &
  pids+=($!)
done
status=0
for i in 0 1; do
  wait "${pids[$i]}" || { echo "rank $i failed:"; status=1; }
  cat "$tmp/rank$i.log"
  grep -q "consumer: rank $i/2 (torchrun environment) ddp step averaged" "$tmp/rank$i.log" || status=1
done
pids=()
exit $status
