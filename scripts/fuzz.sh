#!/usr/bin/env bash
# Fuzzes, each for a bounded time and outside the normal build, with clang's libFuzzer:
#  1. the store's request parser and engine (launcher/store/fuzz), with ASan/UBSan;
#  2. the snapshot loader, ctorch::decodeSnapshot on arbitrary bytes (trainer/fuzz), linked with
#     LibTorch; seeded with a small valid snapshot the target writes itself.
#  3. the zip layer's agreement (trainer/fuzz/zip_agreement_fuzz.cpp): every archive ctorch's check
#     accepts, LibTorch's reader lists as the same records; seeded the same way.
#  4. the pickle layer (trainer/fuzz/pickle_layer_fuzz.cpp): pickles built from the input out of what
#     a snapshot's pickle is made of (type tags, tensor references, memo, containers, globals), in a
#     genuine snapshot and alone; seeded by the target itself with programs.
# Skips (exit 0, saying why) without clang's libFuzzer; skips targets 2 to 4 (exit 0) without LibTorch.
# Usage: scripts/fuzz.sh [seconds per target=60] [targets=store,snapshot,zip,pickle]
#        (CTORCH_FUZZ_DIR: build/work folder, default build-fuzz/)
# Needs: apt-get install -y clang libclang-rt-14-dev   (Debian bookworm: clang 14)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
targets=${2:-store,snapshot,zip,pickle}
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
fuzz_store() {
  local src=$root/launcher/store
  "$cxx" -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$src/include" "$src/fuzz/store_request_fuzz.cpp" "$src/src/tcp_store_protocol.cpp" \
    "$src/src/store_engine.cpp" -o "$out/store_request_fuzz"
  mkdir -p "$out/corpus"
  # The seeds stay in the repo; what the fuzzer finds goes to the work folder.
  "$out/store_request_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 "$out/corpus" "$src/fuzz/corpus" 2>&1 | tee "$out/fuzz.log" | tail -n 30
  echo "fuzz: store_request_fuzz ran ${seconds} s without a finding (corpus: $out/corpus)"
}

torch_include=${CTORCH_TORCH_INCLUDE:-/usr/include}
torch_lib=${CTORCH_TORCH_LIB:-/usr/lib/x86_64-linux-gnu}
# The definitions LibTorch's CMake config gives every consumer (compat.hpp includes c10d headers).
torch_defines="-DUSE_DISTRIBUTED -DUSE_C10D_GLOO -DUSE_RPC -DUSE_TENSORPIPE -D_GLIBCXX_USE_CXX11_ABI=1 -DCTORCH_VERSION=\"fuzz\""
# LibTorch itself is not instrumented; ASan still sees every heap buffer (it intercepts malloc), so
# a read past a record's storage in our code is reported. CTORCH_FUZZ_SANITIZE=fuzzer drops ASan.
sanitize=${CTORCH_FUZZ_SANITIZE:-fuzzer,address}

# Whether LibTorch's headers and libraries are there (says why not).
have_torch() {
  if [ ! -f "$torch_include/torch/csrc/api/include/torch/torch.h" ] || [ ! -e "$torch_lib/libtorch_cpu.so" ]; then
    echo "fuzz: $1 skipped: no LibTorch headers/libraries under $torch_include, $torch_lib"
    echo "      (set CTORCH_TORCH_INCLUDE and CTORCH_TORCH_LIB)"
    return 1
  fi
}

# Compiles the snapshot library's sources the targets link (once; again when a source or header
# changed) and sets objs.
snapshot_objects() {
  local t=$root/trainer failed=0
  objs=()
  mkdir -p "$out/snapshot-obj"
  for f in snapshot/format snapshot/decode snapshot/digest snapshot/zip_check snapshot/pickle_scan snapshot/capture_restore \
           snapshot/optimizer_state core/state_dict \
           sampler/distributed_sampler core/version core/errors; do
    # Rebuilt when its source or any of the library's headers changed since (a changed declaration
    # would otherwise link against a stale object).
    local o=$out/snapshot-obj/${f//\//_}.o
    if [ ! "$o" -nt "$t/src/$f.cpp" ] ||
       [ -n "$(find "$t/include" "$t/src" -name '*.hpp' -newer "$o" -print -quit)" ]; then
      # One compile per core at once (each is a LibTorch-sized translation unit).
      while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do wait -n || true; done
      rm -f "$o"
      "$cxx" -std=c++17 -O1 -g -fsanitize="$sanitize" -c $torch_defines -I"$t/include" -I"$t/src" -I"$t/shim" -I"$torch_include" \
        -I"$torch_include/torch/csrc/api/include" "$t/src/$f.cpp" -o "$o" &
    fi
    objs+=("$o")
  done
  wait
  # A compile that failed left no object (removed before it started; the compiler's error is above).
  for o in "${objs[@]}"; do [ -f "$o" ] || failed=1; done
  [ "$failed" -eq 0 ] || { echo "fuzz: compiling the snapshot library's sources failed (above)" >&2; exit 1; }
}

# Links trainer/fuzz/$1.cpp with objs (snapshot_objects) and LibTorch into $out/$1.
link_torch_target() {
  local t=$root/trainer
  "$cxx" -std=c++17 -O1 -g -fsanitize="$sanitize" $torch_defines -I"$t/include" -I"$t/src" -I"$t/shim" -I"$torch_include" \
    -I"$torch_include/torch/csrc/api/include" "$t/fuzz/$1.cpp" "${objs[@]}" \
    -L"$torch_lib" -Wl,-rpath,"$torch_lib" -ltorch -ltorch_cpu -lc10 -lz -o "$out/$1"
}

# Runs $out/$1 for $seconds on the corpus $out/$2-corpus, seeded in $out/$2-seed by the target itself
# (CTORCH_FUZZ_SEED_DIR); findings go to $3<kind>-<hash>. Leaks are not findings here: LibTorch
# keeps allocations alive on purpose.
run_torch_target() {
  local name=$1 tag=$2 artifacts=$3
  mkdir -p "$out/$tag-corpus" "$out/$tag-seed"
  CTORCH_FUZZ_SEED_DIR="$out/$tag-seed" ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
    "$out/$name" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
    -malloc_limit_mb=2048 -max_len=65536 -print_final_stats=1 -artifact_prefix="$artifacts" "$out/$tag-corpus" "$out/$tag-seed" \
    2>&1 | tee "$out/$tag-fuzz.log" | tail -n 30
  echo "fuzz: $name ran ${seconds} s without a finding (corpus: $out/$tag-corpus)"
}

fuzz_snapshot() {
  have_torch snapshot_decode_fuzz || return 0
  snapshot_objects
  link_torch_target snapshot_decode_fuzz
  # The seed (a valid ~3 kB snapshot) is written by the target itself, so it always matches the format.
  run_torch_target snapshot_decode_fuzz snapshot "$out/"
}

fuzz_zip() {
  have_torch zip_agreement_fuzz || return 0
  snapshot_objects
  # Its own copy of the zip check, without the CRC-32 comparison (FUZZING_BUILD_MODE_...): mutated
  # headers and data then get past it and reach the comparison with LibTorch's reader, which does
  # not check CRC-32s either.
  local t=$root/trainer o=$out/snapshot-obj/snapshot_zip_check_nocrc.o
  "$cxx" -std=c++17 -O1 -g -fsanitize="$sanitize" -DFUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION -c -I"$t/src" \
    "$t/src/snapshot/zip_check.cpp" -o "$o"
  objs=("${objs[@]/%snapshot_zip_check.o/snapshot_zip_check_nocrc.o}")
  link_torch_target zip_agreement_fuzz
  # The seed (a valid snapshot) is written by the target itself, so it always matches the format.
  run_torch_target zip_agreement_fuzz zip "$out/zip-"
}

fuzz_pickle() {
  have_torch pickle_layer_fuzz || return 0
  snapshot_objects
  link_torch_target pickle_layer_fuzz
  # The seeds (programs for the target's pickle builder) are written by the target itself.
  run_torch_target pickle_layer_fuzz pickle "$out/pickle-"
}

IFS=, read -r -a wanted <<<"$targets"
for target in "${wanted[@]}"; do
  case $target in
    store) fuzz_store ;;
    snapshot) fuzz_snapshot ;;
    zip) fuzz_zip ;;
    pickle) fuzz_pickle ;;
    *) echo "fuzz: unknown target '$target' (store, snapshot, zip, pickle)" >&2; exit 2 ;;
  esac
done
