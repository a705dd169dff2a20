#!/usr/bin/env bash
# Synchronous against asynchronous parameter-server training on real Fashion-MNIST, 2 workers and 1 server
# on this machine (issue 32.3): test accuracy after each of 3 epochs for synchronous mode and asynchronous
# mode at staleness 0, 4 and unbounded; then the time of one epoch with worker 1 slowed by 40 ms a step
# (a slower machine) and without, synchronous against asynchronous. Prints everything; results go to bench/results/.
# Usage: bench/ps_async_accuracy.sh [build-dir]   (the bookworm lane's build by default)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
CTORCH_BUILD_DIR=$build scripts/build.sh --target ps_async_accuracy_bench ctorchrun >/dev/null
bench=$build/bench/ps_async_accuracy_bench
launcher=$build/launcher/agent/ctorchrun
run() { "$launcher" --standalone --nproc-per-node 3 "$bench" "$@" 2>&1 | grep -E '^\[default[0-9]\]:(sync|async|server)' || true; }
echo "# $(date -u +%F\ %T) $(nproc) cores, load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "## 3 epochs, all 60,000 training images, batch 64 per worker, SGD lr 0.05 momentum 0.9, mnist-cnn"
run --mode sync --epochs 3
for s in 0 4 1000; do run --mode async --staleness "$s" --epochs 3; done
echo "## 1 epoch of 6,000 images, with and without worker 1 sleeping 40 ms before each push; 3 repeats, interleaved"
for rep in 1 2 3; do
  run --mode sync --epochs 1 --limit 6000 --slow-ms 40
  run --mode async --staleness 4 --epochs 1 --limit 6000 --slow-ms 40
  run --mode async --staleness 1000 --epochs 1 --limit 6000 --slow-ms 40
  run --mode sync --epochs 1 --limit 6000
  run --mode async --staleness 4 --epochs 1 --limit 6000
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
