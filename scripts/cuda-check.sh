#!/usr/bin/env bash
# Compile-only check of the CUDA / NCCL paths (ProcessGroupNCCL, CUDA devices, autocast, the
# AMP scaler) against Debian trixie contrib's libtorch-cuda-dev (LibTorch 2.6 with CUDA and NCCL),
# for machines without a GPU: makes (once, cached) a trixie root with main contrib non-free, then
# compiles the library and the trainer's core there (static libraries: nothing is linked against
# CUDA), and the object files of the GPU tests (tests/cuda) and the GPU benchmark (bench/gpu),
# unlinked: nothing CUDA can run without a GPU.
# Run by hand, as root: too large for CI (the CUDA LibTorch and its toolkit are several GB).
#   scripts/cuda-check.sh            # root in /var/cache/ctorch/trixie-cuda-root, build in build-cuda/
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export CTORCH_MODERN_SUITE=trixie
export CTORCH_MODERN_COMPONENTS="main contrib non-free non-free-firmware"
export CTORCH_MODERN_TORCH_PACKAGES="libtorch-cuda-dev libgloo-cuda-dev nvidia-cuda-toolkit libnccl-dev"
# nvidia-cudnn's installer downloads cuDNN from NVIDIA, which this machine cannot reach: without it
# there is no libcudnn, so the check compiles (static libraries) and links nothing against CUDA.
export CTORCH_MODERN_SKIP_POSTINST="nvidia-cudnn"
export CTORCH_MODERN_ROOT=${CTORCH_CUDA_ROOT:-/var/cache/ctorch/trixie-cuda-root}
export CTORCH_MODERN_BUILD_DIR=$here/build-cuda
export CTORCH_CMAKE_ARGS="${CTORCH_CMAKE_ARGS:-}"
bash "$here/scripts/modern.sh" run bash -c 'dpkg-query -W -f "\${Package} \${Version}\n" libtorch-cuda-dev 2>/dev/null | sed "s/^/cuda-check: /"'
bash "$here/scripts/modern.sh" build --target ctorch ctorch_train_core ctorch_models ctorch_data
# The GPU tests' and benchmark's translation units, compiled but not linked (no libcudnn here).
# Each object's own compile command: building the object targets through ninja would first link
# the programs they are ordered after (ctorch-train), which needs the missing libcudnn.
bash "$here/scripts/modern.sh" run bash -c 'cd build-cuda && objs=$(ninja -t targets all | grep -oE "^(tests/cuda/CMakeFiles/cuda_tests|bench/gpu/CMakeFiles/gpu_step_bench)\.dir/[^:]+\.o") && for o in $objs; do ninja -t commands "$o" | tail -1 | sh -e || exit 1; done && echo "cuda-check: compiled $(echo $objs | wc -w) object files of tests/cuda and bench/gpu"'
bash "$here/scripts/modern.sh" run bash -c 'grep -c USE_C10D_NCCL build-cuda/compile_commands.json | sed "s/^/cuda-check: translation units compiled with USE_C10D_NCCL: /"'
echo "cuda-check: the CUDA / NCCL paths compiled against trixie's libtorch-cuda-dev"
