#!/usr/bin/env bash
# One optimizer step: torch::optim's against ctorch::optim's multi-tensor and fused kernels, beside
# Python's torch.optim (default, foreach, fused), over ResNet-18's parameters and the ZeRO
# comparison's 2-rank share (3 x Linear(4096, 4096)); 1 thread; in the lane this runs in.
# Usage: bench/optim/optim_step.sh [build dir=build] [steps=20]   (modern lane: scripts/modern.sh run
#        bench/optim/optim_step.sh build-modern)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${1:-build}; steps=${2:-20}
[[ $steps =~ ^[1-9][0-9]*$ ]] || { echo "optim_step.sh: steps '$steps' is not a positive integer" >&2; exit 2; }
cmake --build "$root/$build" --target optim_step_bench >/dev/null
bin=$(find "$root/$build" -name optim_step_bench -type f -perm -u+x | head -1)
echo "machine: $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ);" \
     "$(python3 -c 'import torch; print("PyTorch", torch.__version__)'); 1 thread; median of $steps steps"
for params in resnet18 mlp; do
  "$bin" "$params" "$steps"
  python3 "$root/bench/optim/optim_step.py" "$params" "$steps"
done
