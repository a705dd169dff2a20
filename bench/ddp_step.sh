#!/usr/bin/env bash
# ctorch DDP versus Python's DDP (/usr/bin/python3), same model, same world size, side by side:
# every round runs each configuration once, so all see the same machine load; prints every run,
# then per configuration the median (over the runs) of each phase's per-run median, and the ratios.
# Models: mlp (1.2 M parameters at hidden 1024), cnn (the seeds' MNIST CNN), linear (Linear(20, 1):
# a step is almost only its one small allreduce), resnet18 (CIFAR-shaped 3x32x32; batch 32 is usual).
#
# The settings, so a ratio says what it compares (docs/performance.md, "Like for like"):
#   threads    every process gets what its launcher gives it by default: OMP_NUM_THREADS=1 when
#              several workers share the node (torchrun's and ctorchrun's rule), nothing at 1 rank.
#              ctorch then runs ctorch::configureThreads (that many intra-op threads, or CPUs / local
#              ranks; OpenBLAS held to 1 under them). Python's "threads" setting gives it the same:
#              OMP_NUM_THREADS=<ctorch's count> OPENBLAS_NUM_THREADS=1.
#   allocator  ctorch calls ctorch::tuneAllocator (glibc mallopt: mmap threshold 32 MiB, trim threshold
#              1 GiB); Python's "allocator" setting is the same two values through glibc's environment:
#              MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824.
# Configurations: cpp (the Reducer's Gloo allreduce), cpp-shm (CommHook::kSharedMemory, what
# ctorch-train uses on one node); for the cnn also cpp-torch-pool (torch's max_pool2d instead of
# ctorch::models::maxPool2x2: the same kernels as Python) and cpp-torch-pool-glibc (and glibc's
# default allocator); python-default (as a Python user runs it), python-threads (the same threads as
# ctorch), python-like (the same threads and the same allocator as ctorch: the like-for-like peer).
# Usage: bench/ddp_step.sh [world=2] [rounds=3] [steps=50] [batch=64] [hidden=1024] [model=mlp]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$root/bench/lib.sh"
world=${1:-2}; rounds=${2:-3}; steps=${3:-50}; batch=${4:-64}; hidden=${5:-1024}; model=${6:-mlp}
"$root/scripts/build.sh" --target ddp_step_bench >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
cpp=$(find "$build" -name ddp_step_bench -type f -perm -u+x | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$root/bench/results"
out=$root/bench/results/ddp_step-$model-$(date +%Y%m%d-%H%M%S).txt
source "$root/bench/python_settings.sh"
unset TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID || true
cpus=$(nproc)
launcher_omp=()  # what torchrun and ctorchrun set when several workers share the node
[ "$world" -gt 1 ] && launcher_omp=(OMP_NUM_THREADS=1)
ctorch_threads=$(( world > 1 ? 1 : cpus ))
same_threads=(OMP_NUM_THREADS=$ctorch_threads OPENBLAS_NUM_THREADS=1)

# run_job <config> <env assignments...> -- <command...>: one job of $world processes (bench_ranks: rank 0
# hosts the store); rank 0's line goes to $tmp/<config>.log.
run_job() {
  local config=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local failed=0
  bench_ranks "$world" "$tmp/rank" 900 env "${envs[@]}" "$@" "$steps" 10 "$batch" "$hidden" "$model" || failed=1
  if [ "$failed" -ne 0 ] || ! grep -q impl= "$tmp/rank0.out"; then
    echo "ddp_step.sh: $config failed:" >&2
    cat "$tmp"/rank*.out >&2
    exit 1
  fi
  echo "config=$config $(grep impl= "$tmp/rank0.out")" | tee -a "$tmp/$config.log"
}

{
  echo "ddp_step -- $(date -u +%FT%TZ) on $(hostname), $cpus CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "model=$model world=$world batch=$batch hidden=$hidden rounds=$rounds steps=$steps;" \
       "$(/usr/bin/python3 -c 'import torch; print("PyTorch", torch.__version__)')"
} | tee "$out"
for ((i = 1; i <= rounds; i++)); do
  run_job cpp "${launcher_omp[@]}" CTORCH_BENCH_HOOK=none -- "$cpp"
  run_job cpp-shm "${launcher_omp[@]}" CTORCH_BENCH_HOOK=shared-memory -- "$cpp"
  if [[ $model == cnn ]]; then
    run_job cpp-torch-pool "${launcher_omp[@]}" CTORCH_BENCH_HOOK=none CTORCH_BENCH_TORCH_POOL=1 -- "$cpp"
    run_job cpp-torch-pool-glibc "${launcher_omp[@]}" CTORCH_BENCH_HOOK=none CTORCH_BENCH_TORCH_POOL=1 \
      CTORCH_BENCH_DEFAULT_ALLOCATOR=1 -- "$cpp"
  fi
  run_job python-default "${launcher_omp[@]}" -- /usr/bin/python3 "$root/bench/ddp_step.py"
  run_job python-threads "${same_threads[@]}" -- /usr/bin/python3 "$root/bench/ddp_step.py"
  run_job python-like "${same_threads[@]}" "${same_allocator[@]}" -- /usr/bin/python3 "$root/bench/ddp_step.py"
done | tee -a "$out"
cat "$tmp"/*.log | /usr/bin/python3 "$root/bench/ddp_step_summary.py" | tee -a "$out"
echo "(saved to $out)"
