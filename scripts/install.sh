#!/usr/bin/env bash
# The install-only path: builds what a user installs — the ctorch library and its CMake package
# (find_package(ctorch), ctorch::ctorch), ctorchrun and ctorch-train — without the test suite, into
# build-install/ (or $CTORCH_INSTALL_BUILD_DIR), then installs it under PREFIX (default /usr/local).
# Installs its apt packages first, as scripts/build.sh's callers do.
#   scripts/install.sh [PREFIX]             e.g. scripts/install.sh /opt/ctorch
#   scripts/install.sh --list-targets       configure only, and print what would be built
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_INSTALL_BUILD_DIR:-$root/build-install}
list=0
prefix=/usr/local
case "${1:-}" in
  --list-targets) list=1 ;;
  -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "install: unknown option '$1' (PREFIX or --list-targets)" >&2; exit 2 ;;
  "") ;;
  *) prefix=$1 ;;
esac
[ "${CTORCH_SETUP:-}" = skip ] || "$root/scripts/setup.sh"
generator=()
command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ] && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCTORCH_BUILD_TESTS=OFF \
  ${CTORCH_CMAKE_ARGS:-} >/dev/null
if [ "$list" = 1 ]; then
  # The programs and libraries this configuration defines, one per line (the benchmarks among them
  # are built only when asked for by name).
  [ -f "$build/build.ninja" ] || { echo "install: --list-targets needs the Ninja generator" >&2; exit 2; }
  ninja -C "$build" -t targets all | sed -n 's/^\([^:]*\): CXX_\(EXECUTABLE\|STATIC_LIBRARY\|SHARED_LIBRARY\)_LINKER.*/\1/p' | sort
  exit 0
fi
start=$(date +%s)
cmake --build "$build" --parallel "${CTORCH_JOBS:-$(nproc)}"
echo "install: built in $(( $(date +%s) - start )) s ($build)"
cmake --install "$build" --prefix "$prefix" >/dev/null
echo "install: ctorchrun, ctorch-train and the ctorch package are in $prefix" \
     "(find_package(ctorch) with -DCMAKE_PREFIX_PATH=$prefix)"
