#!/usr/bin/env bash
# Configures (once) and builds the whole tree into build/ (or $CTORCH_BUILD_DIR).
# Usage: scripts/build.sh [cmake --build args...], e.g. scripts/build.sh --target ctorchrun
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_BUILD_DIR:-$root/build}
jobs=${CTORCH_JOBS:-$(nproc)}

generator=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi
# A configure that failed half-way leaves a cache but no build system: configure again then.
if [ ! -f "$build/CMakeCache.txt" ] || { [ ! -f "$build/build.ninja" ] && [ ! -f "$build/Makefile" ]; }; then
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release ${CTORCH_CMAKE_ARGS:-} >/dev/null
fi
start=$(date +%s)
cmake --build "$build" --parallel "$jobs" "$@"
echo "build: $(( $(date +%s) - start )) s ($build)"
