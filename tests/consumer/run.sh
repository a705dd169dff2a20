#!/usr/bin/env bash
# Installs this build tree into a temporary prefix, builds tests/consumer against it with
# find_package(ctorch), and runs the result. Usage: run.sh <build-dir> <expected-output-regex>
set -euo pipefail
build=$1
expect=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$here" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" "${launcher[@]}" >/dev/null
cmake --build "$tmp/build" --parallel 2 >/dev/null
out=$("$tmp/build/consumer")
echo "$out"
echo "$out" | grep -Eq "$expect"
