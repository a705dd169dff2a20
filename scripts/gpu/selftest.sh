#!/usr/bin/env bash
# Proves the GPU kit here, before a GPU machine is lent: runs scripts/gpu/run.sh (its configure, build
# and every step, on the CPU) inside a root that holds only what the GPU machine holds -- a compiler,
# CMake, ninja, python3 with PyTorch in pip's layout -- plus gpu-pack/. No -dev package: a dependency
# the pack lacks, or a path run.sh gets wrong, fails here instead of in the GPU machine's few minutes.
#   scripts/gpu/selftest.sh            (as root; the root is made once, ~2 min, cached in
#                                       /var/cache/ctorch/gpu-selftest-root; the build takes ~6 min on 2 cores)
# The root is Debian sid (LibTorch / PyTorch 2.14, GCC 16, CMake 4) with g++, cmake, ninja-build, git
# and python3-torch. pip's layout is assembled from Debian's packages, as a wheel has it:
# /opt/torch/.venv/lib/pythonX.Y/site-packages/torch with include/ (libtorch-dev's headers, extracted,
# not installed), lib/ (the libraries), share/cmake/{Torch,Caffe2,ATen} (libtorch-dev's config with
# Debian's changes undone: the prefix three levels up, libraries in lib/, protobuf inside libtorch as
# in pip's build), and /opt/torch/.venv/bin/python3, the only python that finds it. The gloo headers
# stay out of it (pip's torch may lack them: run.sh then uses the pack's).
# Results: build-gpu-selftest/results/ (run.sh's files); exit 0 when every step passed.
#
# When it passes it records the kit's inputs in scripts/gpu/rehearsed (commit that file with them):
#   scripts/gpu/selftest.sh --if-changed   (CI) rehearses only when the inputs differ from the ones
#                                          recorded there, else says whose rehearsal they had, exit 0
# The inputs are what the kit is and what a build in pip's layout reads beyond the lanes' builds:
# scripts/gpu/, bench/gpu/, cmake/, every CMakeLists.txt and scripts/modern.sh (the root). The
# sources it compiles are built and tested in both lanes at every run, and the CUDA tests' CPU
# stand-in runs in the modern lane (tests/cuda/CMakeLists.txt): what only this rehearsal can find is
# in the inputs.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
stamp=$here/scripts/gpu/rehearsed
# A digest of the inputs as they are in the working tree (a fresh clone: as committed).
inputs_digest() {
  (cd "$here" && git ls-files -z -- scripts/gpu bench/gpu cmake scripts/modern.sh ':(glob)**/CMakeLists.txt'      ':(exclude)scripts/gpu/rehearsed' | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}
if [ "${1:-}" = "--if-changed" ]; then
  digest=$(inputs_digest)
  if [ -f "$stamp" ] && [ "$(sed -n 's/^inputs //p' "$stamp")" = "$digest" ]; then
    echo "selftest: skipped: the kit's inputs ($digest) are those of the rehearsal recorded in scripts/gpu/rehearsed ($(sed -n 's/^rehearsed //p' "$stamp"))"
    exit 0
  fi
  echo "selftest: the kit's inputs changed since the rehearsal recorded in scripts/gpu/rehearsed: rehearsing"
fi
[ "$(id -u)" -eq 0 ] || { echo "selftest: needs root (debootstrap, chroot)" >&2; exit 1; }
export CTORCH_MODERN_ROOT=${CTORCH_GPU_SELFTEST_ROOT:-/var/cache/ctorch/gpu-selftest-root}
export CTORCH_MODERN_PACKAGES="g++ cmake ninja-build git python3 python3-torch procps ca-certificates"
build=$here/build-gpu-selftest
results=$build/results

bash "$here/scripts/gpu/pack.sh"
bash "$here/scripts/modern.sh" root

# pip's layout, once per root (stamped).
if [ ! -f "$CTORCH_MODERN_ROOT/opt/torch/.ctorch-pip-layout" ]; then
  echo "selftest: assembling pip's layout of torch in the root"
  bash "$here/scripts/modern.sh" run bash -euo pipefail -c '
    pyver=$(python3 -c "import sys; print(f\"python{sys.version_info[0]}.{sys.version_info[1]}\")")
    site=/opt/torch/.venv/lib/$pyver/site-packages
    T=$site/torch
    mkdir -p "$site" /opt/torch/.venv/bin
    [ -d "$T" ] || mv /usr/lib/python3/dist-packages/torch "$T"
    tmp=$(mktemp -d)
    (cd "$tmp" && apt-get download -qq libtorch-dev && dpkg -x libtorch-dev_*.deb x)
    # Headers: real files, as in a wheel (Debian links to /usr/include, which has none here).
    for l in "$T"/include/*; do [ -L "$l" ] && rm "$l"; done
    cp -a "$tmp"/x/usr/include/. "$T/include/"
    # Libraries: torch/lib has every library of LibTorch under every name the config uses.
    for f in $(dpkg -L "$(dpkg -S /usr/lib/x86_64-linux-gnu/libc10.so.* | head -n 1 | cut -d: -f1)" | grep -E "/lib[^/]+\.so[.0-9]*$"); do
      ln -sfn "$f" "$T/lib/$(basename "$f")"
    done
    for l in "$tmp"/x/usr/lib/x86_64-linux-gnu/*.so; do ln -sfn "/usr/lib/x86_64-linux-gnu/$(readlink "$l")" "$T/lib/$(basename "$l")"; done
    for l in "$T"/lib/*.so*; do
      [ -L "$l" ] && [ ! -e "$l" ] && ln -sfn "/usr/lib/x86_64-linux-gnu/$(basename "$(readlink "$l")")" "$l"
    done
    # CMake config under share/cmake, as pip installs it.
    mkdir -p "$T/share/cmake"
    cp -a "$tmp"/x/usr/lib/x86_64-linux-gnu/cmake/{ATen,Caffe2,Torch} "$T/share/cmake/"
    python3 - "$T/share/cmake" <<PY
import pathlib, re, sys
root = pathlib.Path(sys.argv[1])
for f in [root / "Torch/TorchConfig.cmake", root / "Caffe2/Caffe2Config.cmake"]:
    s = f.read_text().replace("/../../../../\"", "/../../../\"")
    if f.name == "Caffe2Config.cmake":  # pip builds protobuf into libtorch: no protobuf package needed
        s = s.replace("if(OFF)\n  if(NOT TARGET protobuf::libprotobuf)", "if(ON)\n  if(NOT TARGET protobuf::libprotobuf)", 1)
    f.write_text(s)
for f in (root / "Caffe2").glob("Caffe2Targets*.cmake"):
    s = f.read_text().replace("\${_IMPORT_PREFIX}/x86_64-linux-gnu/", "\${_IMPORT_PREFIX}/lib/")
    f.write_text(s.replace("\${_IMPORT_PREFIX}/../include", "\${_IMPORT_PREFIX}/include"))
f = root / "ATen/ATenConfig.cmake"
f.write_text(f.read_text().replace("\"/usr/include\"", "\"" + str(root.parent.parent / "include") + "\""))
PY
    printf "#!/bin/sh\nexec env PYTHONPATH=%s\${PYTHONPATH:+:\$PYTHONPATH} /usr/bin/python3 \"\$@\"\n" "$site" >/opt/torch/.venv/bin/python3
    chmod +x /opt/torch/.venv/bin/python3
    rm -rf "$tmp"
    touch /opt/torch/.ctorch-pip-layout
  '
fi

# Nothing but the pack may provide the project's dependencies.
leaked=$(bash "$here/scripts/modern.sh" run bash -c 'dpkg-query -W -f "\${Package}\n" 2>/dev/null | grep -xE "libtorch-dev|libcli11-dev|libspdlog-dev|libfmt-dev|catch2|nlohmann-json3-dev|zlib1g-dev|libgloo-dev|libprotobuf-dev" || true')
[ -z "$leaked" ] || { echo "selftest: the root holds packages the GPU machine lacks: $leaked" >&2; exit 1; }
bash "$here/scripts/modern.sh" run bash -c 'python3 -c "import torch" 2>/dev/null && { echo "selftest: python3 outside the venv finds torch" >&2; exit 1; }; /opt/torch/.venv/bin/python3 -c "import torch, torch.utils; print(\"selftest: pip-layout torch\", torch.__version__, torch.utils.cmake_prefix_path)"'

rm -rf "$results"
status=0
bash "$here/scripts/modern.sh" run env CTORCH_GPU_BUILD="$build" CTORCH_GPU_BUDGET_S="${CTORCH_GPU_SELFTEST_BUDGET_S:-3000}" \
  CTORCH_GPU_LIMIT_SCALE=4 \
  bash scripts/gpu/run.sh "$results" || status=$?

# Every step ran and passed; at most 8 files.
files=$(find "$results" -type f | wc -l)
echo "selftest: run.sh exit $status; $files files in $results: $(ls "$results" | tr '\n' ' ')"
[ "$files" -le 8 ] || { echo "selftest: more than 8 result files" >&2; status=1; }
for s in versions configure build cuda-tests cpu-tests train-cnn bench train-resnet18; do
  grep -q "^$s: ok" "$results/summary.txt" || { echo "selftest: step $s did not pass" >&2; status=1; }
done
# The strategies ran on the CPU standing in for CUDA (not skipped), and the bench's summary has every
# implementation's figures and the ratios.
strategies=$(grep -cE 'Test +#[0-9]+: cuda_tests:cuda: .*(ZeRO-1|FSDP|parameter server|flat reduce-scatter).* Passed' \
             "$results/cuda-tests.txt" 2>/dev/null)
[ "${strategies:-0}" -ge 5 ] || { echo "selftest: $strategies of the 5+ strategy tests passed on the CPU stand-in" >&2; status=1; }
for impl in cpp-eager py-eager py-channels-last; do
  grep -qE "^bench: batch 8 $impl: median" "$results/summary.txt" || { echo "selftest: no bench figures for $impl" >&2; status=1; }
done
# torch.compile: figures, or its failure recorded with the reason (Dynamo may not support this python).
grep -qE "^bench: batch 8 py-compile: (median|failed: .+)" "$results/summary.txt" || { echo "selftest: py-compile not recorded" >&2; status=1; }
grep -qE "^bench: batch 4 ratio cpp-eager / py-eager" "$results/summary.txt" || { echo "selftest: no bench ratio" >&2; status=1; }
grep -qE "^bench: batch 8 cpp-graphs: (not-built|median)" "$results/summary.txt" || { echo "selftest: CUDA graphs not recorded" >&2; status=1; }
if [ $status -eq 0 ]; then
  { echo "inputs $(inputs_digest)"
    echo "rehearsed $(date -u +%Y-%m-%d) on $(cd "$here" && git rev-parse --short HEAD)$(cd "$here" && git diff --quiet HEAD -- scripts/gpu bench/gpu cmake scripts/modern.sh ':(glob)**/CMakeLists.txt' || echo ' with uncommitted changes to the inputs')"
  } >"$stamp"
  echo "selftest: passed (recorded in scripts/gpu/rehearsed: commit it with the inputs)"
fi
exit $status
