#!/usr/bin/env bash
# The one command for a lent GPU machine (../shared/notes/gpu-device.md: an H100 or H200, 16 cores,
# CUDA with nvcc, CMake, ninja, pip's PyTorch in a python3; no network). Run from the repository
# root with gpu-pack/ beside it (scripts/gpu/pack.sh made it here):
#   bash scripts/gpu/run.sh RESULTS_DIR
# Configures against the machine's PyTorch (torch.utils.cmake_prefix_path), builds what the GPU
# checks need with every core, then runs them, each step with its own time limit inside one budget
# (CTORCH_GPU_BUDGET_S, default 530 s from the start: one device call of at most 9 minutes), keeping
# what each step wrote when a later one fails or runs out of time. RESULTS_DIR gets at most 8 files:
#   run.log           everything, in order            summary.txt    one line per step, the figures
#   versions.txt      GPU, driver, torch, CUDA, NCCL, cuDNN, compiler, CMake
#   cuda-tests.txt    ctest -L cuda (DDP, ZeRO-1, FSDP, the parameter server and the flat collectives on
#                     NCCL / Gloo with CUDA tensors, AMP, snapshots, --nproc-per-node gpu, kills)
#   train-cnn.txt     ctorch-train: the seeds' CNN on Fashion-MNIST, 3 epochs (goal: >= 90 % test accuracy)
#   train-resnet18.txt ctorch-train: ResNet-18 on CIFAR-shaped synthetic data in bfloat16
#   bench-resnet18.txt ResNet-18 bf16, batch 256 and 32, world 1: Python eager / channels-last / torch.compile
#                     against ctorch eager / multi-tensor SGD + channels-last / CUDA graphs, 5 interleaved
#                     rounds of 200 steps each: medians, min-max, ratios, TFLOP/s (bench/gpu/step_bench.sh)
# Without a GPU (scripts/gpu/selftest.sh) the same steps run on the CPU, shortened: the CUDA tests run
# their harness on the CPU (CTORCH_CUDA_TESTS_ON_CPU=1) and the CPU tests of mixed precision run too.
# Environment: PYTHON (the python3 with torch), CTORCH_GPU_PACK (default gpu-pack/), CTORCH_GPU_BUILD
# (default build-gpu/), CTORCH_GPU_BUDGET_S, CTORCH_GPU_LIMIT_SCALE (every step's limit times N),
# CTORCH_GPU_STEPS (comma list; default all), CTORCH_GPU_TARGETS (what to build; default what every step needs).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:?usage: scripts/gpu/run.sh RESULTS_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
pack=${CTORCH_GPU_PACK:-$here/gpu-pack}
build=${CTORCH_GPU_BUILD:-$here/build-gpu}
work=$build/gpu-work
budget=${CTORCH_GPU_BUDGET_S:-530}
scale=${CTORCH_GPU_LIMIT_SCALE:-1}   # every step's limit times this (the selftest's 2 cores build slower)
# The bench before the two training runs (which the first GPU machine proved): they run if time is left.
steps=${CTORCH_GPU_STEPS:-versions,configure,build,cuda-tests,cpu-tests,bench,train-cnn,train-resnet18}
start=$(date +%s)
summary=$out/summary.txt
: >"$summary"
exec > >(tee -a "$out/run.log") 2>&1

say() { echo "[gpu-kit $(( $(date +%s) - start ))s] $*"; }
note() { echo "$*" >>"$summary"; say "$*"; }
wanted() { [[ ",$steps," == *",$1,"* ]]; }
left() { echo $(( budget - ($(date +%s) - start) )); }
failed_build=0

# step NAME LIMIT_S FILE -- COMMAND...: runs COMMAND with min(LIMIT, time left) seconds, output to FILE
# (and the log); records status and duration in summary.txt. A step that cannot start in time is
# recorded as such.
step() {
  local name=$1 limit=$(( $2 * scale )) file=$3; shift 4
  wanted "$name" || return 0
  local remaining; remaining=$(left)
  if [ "$remaining" -lt 20 ]; then note "$name: not run (out of time: ${remaining}s of ${budget}s left)"; return 1; fi
  [ "$limit" -gt "$remaining" ] && limit=$((remaining - 5))
  say "== $name (limit ${limit}s) =="
  local t0 rc; t0=$(date +%s)
  # A shell function runs in a child bash (timeout runs programs): functions and variables are exported.
  local cmd=("$@")
  if declare -F "$1" >/dev/null; then cmd=(bash -c '"$@"' _ "$@"); fi
  if [ -n "$file" ]; then
    timeout --kill-after=10 "$limit" "${cmd[@]}" 2>&1 | tee "$file"; rc=${PIPESTATUS[0]}
  else
    timeout --kill-after=10 "$limit" "${cmd[@]}"; rc=$?
  fi
  local took=$(( $(date +%s) - t0 ))
  case $rc in
    0) note "$name: ok in ${took}s" ;;
    124|137) note "$name: TIMED OUT after ${took}s (limit ${limit}s)" ;;
    *) note "$name: FAILED (exit $rc) after ${took}s" ;;
  esac
  return $rc
}

# ---- the machine's PyTorch ---------------------------------------------------------------------------
python=""
for p in ${PYTHON:-} /opt/torch/.venv/bin/python3 python3 /usr/bin/python3; do
  command -v "$p" >/dev/null 2>&1 || continue
  if "$p" -c 'import torch' >/dev/null 2>&1; then python=$(command -v "$p"); break; fi
done
[ -n "$python" ] || { note "no python3 that imports torch (tried \$PYTHON, /opt/torch/.venv/bin/python3, python3)"; exit 1; }
eval "$("$python" - <<'PY'
import os, shlex, torch, torch.utils
d = os.path.dirname(os.path.abspath(torch.__file__))
def nccl():
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        return ""
cudnn = ""
try:
    cudnn = str(torch.backends.cudnn.version() or "")
except Exception:
    pass
for k, v in [("TORCH_DIR", d), ("TORCH_CMAKE", torch.utils.cmake_prefix_path), ("TORCH_VERSION", torch.__version__),
             ("TORCH_CUDA", torch.version.cuda or ""), ("TORCH_ABI", str(int(torch._C._GLIBCXX_USE_CXX11_ABI))),
             ("TORCH_NCCL", nccl()), ("TORCH_CUDNN", cudnn),
             ("GPUS", str(torch.cuda.device_count() if torch.cuda.is_available() else 0))]:
    print(f"{k}={shlex.quote(v)}")
PY
)"
site=$(dirname "$TORCH_DIR")
export here out pack build work python site TORCH_DIR TORCH_CMAKE TORCH_VERSION TORCH_CUDA TORCH_ABI TORCH_NCCL \
       TORCH_CUDNN GPUS
say "python $python: torch $TORCH_VERSION (CUDA ${TORCH_CUDA:-none}, NCCL ${TORCH_NCCL:-none}), $GPUS GPU(s), ABI $TORCH_ABI"

# ---- versions ------------------------------------------------------------------------------------------
versions() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$here" log -1 --format='%h %s' 2>/dev/null || echo unknown)"
  echo "python: $python ($("$python" --version 2>&1))"
  echo "torch: $TORCH_VERSION at $TORCH_DIR; CUDA ${TORCH_CUDA:-none}; NCCL ${TORCH_NCCL:-none}; cuDNN ${TORCH_CUDNN:-none}; C++11 ABI $TORCH_ABI"
  echo "GPUs seen by torch: $GPUS"
  "$python" -c 'import torch
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")' 2>&1
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; nvidia-smi topo -m 2>&1 | head -20; else echo "nvidia-smi: not found"; fi
  echo "nvcc: $( (command -v nvcc || ls /usr/local/cuda/bin/nvcc) 2>/dev/null | head -n 1)"
  (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | tail -n 2
  echo "c++: $(c++ --version 2>&1 | head -n 1)"
  echo "cmake: $(cmake --version 2>&1 | head -n 1)"
  echo "ninja: $(ninja --version 2>&1)"
  echo "cpus: $(nproc); memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}')"
  echo "os: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
  echo "nvidia wheels: $(ls "$site/nvidia" 2>/dev/null | tr '\n' ' ')"
  echo "torch/include: $(ls "$TORCH_DIR/include" 2>/dev/null | tr '\n' ' ')"
  echo "torch cmake: $(ls "$TORCH_CMAKE" 2>/dev/null | tr '\n' ' ')"
  echo "pack: $(head -n 2 "$pack/MANIFEST" 2>/dev/null | tail -n 1)"
}
export -f versions
step versions 30 "$out/versions.txt" -- versions

# ---- configure ------------------------------------------------------------------------------------------
deps=$pack/deps/usr
[ -d "$deps" ] || { note "configure: $pack is missing (run scripts/gpu/pack.sh where apt works, carry gpu-pack)"; exit 1; }
cmake_args=(-S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=$TORCH_CMAKE;$deps"
  "-DCLI11_DIR=$deps/share/cmake/CLI11" "-Dnlohmann_json_DIR=$deps/share/cmake/nlohmann_json"
  "-Dfmt_DIR=$deps/lib/x86_64-linux-gnu/cmake/fmt" "-Dspdlog_DIR=$deps/lib/x86_64-linux-gnu/cmake/spdlog"
  "-DCatch2_DIR=$deps/lib/cmake/Catch2" -DCTORCH_SPDLOG_HEADER_ONLY=ON
  # pip's torch says which C++ ABI it was built with; every target must agree (not only LibTorch's).
  "-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=$TORCH_ABI"
  # Binaries find torch/lib and the nvidia wheels' libraries without LD_LIBRARY_PATH.
  -DCMAKE_SKIP_BUILD_RPATH=OFF)
rpath="$TORCH_DIR/lib"
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && rpath="$rpath;$d"; done
cmake_args+=("-DCMAKE_BUILD_RPATH=$rpath")
# zlib: headers from the pack, the machine's own libz.so.1 (the pack's libz.so is a link into /lib).
zlib=""
for f in /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 /usr/lib64/libz.so.1 /usr/lib/libz.so.1 \
         "$deps/../lib/x86_64-linux-gnu/libz.so.1"; do
  [ -e "$f" ] && { zlib=$f; break; }
done
cmake_args+=("-DZLIB_INCLUDE_DIR=$deps/include" "-DZLIB_LIBRARY=${zlib:-$pack/deps/lib/x86_64-linux-gnu/libz.so.1}")
# gloo: c10d's ProcessGroupGloo.hpp includes <gloo/...>; pip's torch ships them in torch/include when
# it installs gloo, else Debian's (same API) from the pack.
if [ ! -f "$TORCH_DIR/include/gloo/algorithm.h" ]; then
  cmake_args+=("-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=$TORCH_ABI -isystem $pack/gloo-include")
  say "torch/include has no gloo headers: using the pack's ($pack/gloo-include/gloo)"
fi
if [ -n "$TORCH_CUDA" ]; then
  # Caffe2's CUDA config (checked here against torch 2.14's with CUDA 13): FindCUDA finds nvcc on PATH
  # (or CUDA_TOOLKIT_ROOT_DIR), then enable_language(CUDA) and FindCUDAToolkit; TORCH_CUDA_ARCH_LIST
  # set keeps it from probing the GPUs with a try_run (which fails with CMake 3.25's CUDA dialects);
  # sm_90 is the H100's and H200's. NVTX 3 comes with the toolkit (CUDA::nvtx3); cuDNN and NCCL
  # from pip's nvidia wheels.
  nvcc=$(command -v nvcc || true)
  for c in /usr/local/cuda/bin/nvcc "$site/nvidia/cuda_nvcc/bin/nvcc"; do [ -z "$nvcc" ] && [ -x "$c" ] && nvcc=$c; done
  if [ -n "$nvcc" ]; then
    cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
    export PATH="$(dirname "$nvcc"):$PATH" CUDA_HOME=${CUDA_HOME:-$cuda_root} CUDACXX=$nvcc
    cmake_args+=("-DCUDAToolkit_ROOT=$cuda_root" "-DCUDA_TOOLKIT_ROOT_DIR=$cuda_root" "-DCMAKE_CUDA_COMPILER=$nvcc")
  else
    say "no nvcc found: Caffe2's config may fail to find the CUDA toolkit"
  fi
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
  if [ -d "$site/nvidia/cudnn" ]; then
    export CUDNN_ROOT_DIR=$site/nvidia/cudnn
    cudnn_lib=$(ls "$site"/nvidia/cudnn/lib/libcudnn.so* 2>/dev/null | head -n 1)
    cmake_args+=("-DCUDNN_INCLUDE_DIR=$site/nvidia/cudnn/include")
    [ -n "$cudnn_lib" ] && cmake_args+=("-DCUDNN_LIBRARY=$cudnn_lib")
  fi
  [ -f "$site/nvidia/nccl/include/nccl.h" ] && cmake_args+=("-DCTORCH_NCCL_INCLUDE_DIR=$site/nvidia/nccl/include")
fi
step configure 150 "" -- cmake "${cmake_args[@]}" || { note "configure failed: see run.log (CMake's error above)"; failed_build=1; }

# ---- build -------------------------------------------------------------------------------------------------
default_targets="ctorchrun ctorch-train cuda_tests gpu_step_bench"
[ "$GPUS" -gt 0 ] || default_targets="$default_targets amp_tests"  # the cpu-tests step, without a GPU only
read -r -a targets <<<"${CTORCH_GPU_TARGETS:-$default_targets}"
if [ $failed_build -eq 0 ]; then
  step build 300 "" -- cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}" || failed_build=1
fi
if [ $failed_build -ne 0 ]; then
  note "stopped: nothing to run without a build"
  cat "$summary"
  exit 1
fi
ctorchrun=$build/launcher/agent/ctorchrun
train=$build/trainer/app/ctorch-train
export ctorchrun train
mkdir -p "$work"

# ---- the checks -------------------------------------------------------------------------------------------
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} USE_LIBUV=${USE_LIBUV:-1}
# pip's torch exports its own copies of some std::filesystem functions (pytorch/pytorch#133437), which
# take the place of libstdc++'s in a program linked with it: recorded, the ones the test binary uses.
interposed() {
  local exports
  exports=$(for l in "$TORCH_DIR"/lib/libtorch*.so "$TORCH_DIR"/lib/libc10.so; do
              [ -e "$l" ] && nm -D --defined-only "$l" 2>/dev/null; done | awk '{print $NF}' | sed 's/@.*//' | grep filesystem | sort -u)
  echo "std::filesystem symbols torch's libraries define: $(echo "$exports" | grep -c . )"
  for b in "$build/tests/cuda/cuda_tests" "$train"; do
    [ -x "$b" ] || continue
    local used; used=$(nm -D --undefined-only "$b" 2>/dev/null | awk '{print $NF}' | sed 's/@.*//' | grep filesystem | sort -u)
    echo "$(basename "$b") imports $(echo "$used" | grep -c .) std::filesystem symbols; torch defines these of them:"
    comm -12 <(echo "$used") <(echo "$exports") | c++filt | sed 's/^/    /'
  done
}
# -L takes a regular expression: anchored, so that other labels with "cuda" in them (cuda_graph: CPU
# tests of the graph decision, not built here) stay out.
cuda_tests() {
  command -v nm >/dev/null && interposed
  if [ "$GPUS" -gt 0 ]; then
    ctest --test-dir "$build" -L '^cuda$' --output-on-failure --timeout 170 -V
  else  # no GPU: the harness on the CPU in place of CUDA
    CTORCH_CUDA_TESTS_ON_CPU=1 ctest --test-dir "$build" -L '^cuda$' --output-on-failure --timeout 170 -V
  fi
}
export -f interposed cuda_tests
step cuda-tests 190 "$out/cuda-tests.txt" -- cuda_tests
ok=$(grep -cE 'Test +#[0-9]+: .* Passed' "$out/cuda-tests.txt" 2>/dev/null); skipped=$(grep -c 'Skipped' "$out/cuda-tests.txt" 2>/dev/null)
[ -f "$out/cuda-tests.txt" ] && note "cuda-tests: $(grep -E '% tests passed' "$out/cuda-tests.txt" | tail -n 1) ($ok passed, $skipped skipped lines)"
grep -h 'RECORDED:' "$out/cuda-tests.txt" 2>/dev/null | sed 's/^/  /' | sort -u >>"$summary"

cpu_tests() { ctest --test-dir "$build" -L amp --output-on-failure --timeout 60; }
export -f cpu_tests
[ "$GPUS" -gt 0 ] || step cpu-tests 60 "" -- cpu_tests

# ResNet-18 bfloat16 side by side, world 1, data on the device: Python eager, channels-last and
# torch.compile against ctorch eager, multi-tensor SGD + channels-last and CUDA graphs (where built), at
# batch 256 and 32, 5 rounds of 200 steps each, interleaved (bench/gpu/step_bench.sh). Estimated from
# the first GPU machine (a step at batch 256 ~16 ms): ~110 s of measured steps, ~60 s of process
# starts and warm-ups, ~60-150 s for torch.compile (a cold compile per batch size, then its cache):
# about what is left after the build and the CUDA tests. Whatever is left of the budget is its time
# box; a process that cannot start in time is recorded "not-run", and what was measured is kept.
bench() {
  local left_s=$bench_budget
  if [ "$GPUS" -gt 0 ]; then
    PYTHON=$python CTORCH_BUILD_DIR=$build bash "$here/bench/gpu/step_bench.sh" --model resnet18 --precision bf16 \
      --batches "256 32" --rounds 5 --steps 200 --warmup 10 --budget-s "$left_s"
  else  # the CPU rehearsal: tiny, and torch.compile traced by its "eager" backend (no C++ codegen)
    PYTHON=$python CTORCH_BUILD_DIR=$build bash "$here/bench/gpu/step_bench.sh" --model resnet18 --precision bf16 \
      --batches "8 4" --rounds 2 --steps 2 --warmup 1 --compile-backend eager --budget-s "$left_s"
  fi
}
export -f bench
bench_budget=$(( $(left) - 20 ))
[ "$bench_budget" -gt $((330 * scale)) ] && bench_budget=$((330 * scale))
export bench_budget
step bench 330 "$out/bench-resnet18.txt" -- bench
grep -h '^step_bench: ' "$out/bench-resnet18.txt" 2>/dev/null | grep -v '^step_bench: round: ' | sed 's/^step_bench: /bench: /' >>"$summary"

# The seeds' CNN on Fashion-MNIST, one worker per GPU (on the CPU: one short epoch).
train_cnn() {
  rm -rf "$work/cnn"
  mkdir -p "$work/cnn"
  local extra=(--epochs 3)
  [ "$GPUS" -gt 0 ] || extra=(--epochs 1 --train-limit 2048 --test-limit 1000)
  (cd "$work/cnn" && "$ctorchrun" --standalone --nproc-per-node "$([ "$GPUS" -gt 0 ] && echo gpu || echo 1)" \
     "$train" --data-dir "$pack/data/fashion-mnist" --snapshot-path "$work/cnn/snapshot.pt" "${extra[@]}")
}
export -f train_cnn
step train-cnn 100 "$out/train-cnn.txt" -- train_cnn
acc=$(grep -oE 'test accuracy [0-9.]+%' "$out/train-cnn.txt" 2>/dev/null | tail -n 1)
[ -n "$acc" ] && note "train-cnn: final $acc (goal on a GPU, 3 epochs: >= 90 %); $(grep -oE 'epoch [0-9]+/[0-9]+ done: [^(]*' "$out/train-cnn.txt" | tail -n 1)"

# ResNet-18 on CIFAR-shaped synthetic images in bfloat16 through the trainer.
train_resnet() {
  rm -rf "$work/resnet"
  mkdir -p "$work/resnet"
  local size=51200 batch=256
  [ "$GPUS" -gt 0 ] || { size=256; batch=32; }
  (cd "$work/resnet" && "$ctorchrun" --standalone --nproc-per-node "$([ "$GPUS" -gt 0 ] && echo gpu || echo 1)" \
     "$train" --model resnet18 --dataset synthetic-images --synthetic-shape 3,32,32 --synthetic-size "$size" \
     --batch-size "$batch" --epochs 1 --test-limit 1024 --amp --amp-dtype bfloat16 --lr 0.05 \
     --snapshot-path "$work/resnet/snapshot.pt")
}
export -f train_resnet
step train-resnet18 90 "$out/train-resnet18.txt" -- train_resnet
line=$(grep -oE 'epoch 1/1 done: [^(]*' "$out/train-resnet18.txt" 2>/dev/null | tail -n 1)
[ -n "$line" ] && note "train-resnet18: $line"

note "total: $(( $(date +%s) - start ))s of ${budget}s"
echo "===== summary ====="
cat "$summary"
