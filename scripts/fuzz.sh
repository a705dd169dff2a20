#!/usr/bin/env bash
# Fuzzes the store's request parser and engine (launcher/store/fuzz) with libFuzzer + ASan/UBSan for
# a bounded time, outside the normal build. Skips (exit 0, saying why) without clang's libFuzzer.
# Usage: scripts/fuzz.sh [seconds=60]   (CTORCH_FUZZ_DIR: build/work folder, default build-fuzz/)
# Needs: apt-get install -y clang libclang-rt-14-dev   (Debian bookworm: clang 14)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
out=${CTORCH_FUZZ_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-$(command -v clang++ || command -v clang++-14 || true)}
if [ -z "$cxx" ]; then
  echo "fuzz: skipped: clang++ not found (apt-get install -y clang libclang-rt-14-dev)"
  exit 0
fi
mkdir -p "$out"
probe="$out/probe.cpp"
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe"
if ! "$cxx" -fsanitize=fuzzer "$probe" -o "$out/probe" 2>/dev/null; then
  echo "fuzz: skipped: $cxx cannot link -fsanitize=fuzzer (apt-get install -y libclang-rt-14-dev)"
  exit 0
fi
src=$root/launcher/store
"$cxx" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$src/include" "$src/fuzz/store_request_fuzz.cpp" "$src/src/tcp_store_protocol.cpp" \
  "$src/src/store_engine.cpp" -o "$out/store_request_fuzz"
mkdir -p "$out/corpus"
# The seeds stay in the repo; what the fuzzer finds goes to the work folder.
"$out/store_request_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
  -print_final_stats=1 "$out/corpus" "$src/fuzz/corpus" 2>&1 | tee "$out/fuzz.log" | tail -n 30
echo "fuzz: store_request_fuzz ran ${seconds} s without a finding (corpus: $out/corpus)"
