#!/usr/bin/env bash
# Packs what a lent GPU machine lacks into one git-ignored folder at the repository root, gpu-pack/,
# which travels with the tree (`device run` carries it): the headers (and, only so that their CMake
# package files load, the shared libraries) of CLI11, spdlog + fmt (used header-only there),
# nlohmann-json, Catch2 v2, zlib and gloo (gloo's only if pip's torch lacks them), extracted from
# Debian's packages with `apt-get download` + `dpkg -x`, and the Fashion-MNIST IDX files. The GPU
# machine has a compiler, CMake, ninja and pip's PyTorch, and reaches no package registry.
#   scripts/gpu/pack.sh [DIR]      (default gpu-pack/; at most 40 MiB; quiet and quick when up to date)
# Then: scripts/gpu/run.sh RESULTS_DIR on the GPU machine, or scripts/gpu/selftest.sh here.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${1:-$here/gpu-pack}
limit=$((40 * 1024 * 1024))
packages=(libcli11-dev libspdlog-dev libspdlog1.10 libfmt-dev libfmt9 nlohmann-json3-dev catch2
          zlib1g-dev zlib1g libgloo-dev)
dataset=dataset-fashion-mnist
stamp="pack v3: ${packages[*]} $dataset"
die() { echo "pack: $*" >&2; exit 1; }

if [ -f "$out/MANIFEST" ] && [ "$(head -n 1 "$out/MANIFEST")" = "$stamp" ]; then
  echo "pack: $out is up to date ($(du -sh "$out" | cut -f1))"
  exit 0
fi
command -v apt-get >/dev/null && command -v dpkg >/dev/null || die "needs apt-get and dpkg (a Debian machine)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
want=("${packages[@]}")
[ -d /usr/share/datasets/fashion-mnist ] || want+=("$dataset")
download() { (cd "$tmp" && apt-get download -qq "${want[@]}") >"$tmp/apt.log" 2>&1; }
if ! download; then
  # A machine whose package lists were never fetched: fetch them (root), then try once more.
  if [ "$(id -u)" -eq 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; fi
  download || { cat "$tmp/apt.log" >&2; die "apt-get download ${want[*]} failed"; }
fi

new="$out.new"
rm -rf "$new"
mkdir -p "$new/deps" "$new/data/fashion-mnist"
{
  echo "$stamp"
  echo "made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
} >"$new/MANIFEST"
for deb in "$tmp"/*.deb; do
  name=$(dpkg-deb -f "$deb" Package)
  echo "$name $(dpkg-deb -f "$deb" Version)" >>"$new/MANIFEST"
  if [ "$name" = "$dataset" ]; then
    dpkg -x "$deb" "$tmp/dataset"
  else
    dpkg -x "$deb" "$new/deps"
  fi
done
src=/usr/share/datasets/fashion-mnist
[ -d "$tmp/dataset" ] && src=$tmp/dataset/usr/share/datasets/fashion-mnist
cp "$src"/*-ubyte.gz "$new/data/fashion-mnist/"
[ "$(ls "$new/data/fashion-mnist" | wc -l)" -eq 4 ] || die "expected 4 Fashion-MNIST files in $src"
# Only what a build reads: no documentation, manual pages or gloo's shared library.
# (Catch2's libCatch2WithMain.a stays: its CMake package checks that the file exists.)
rm -rf "$new/deps/usr/share/doc" "$new/deps/usr/share/man" "$new/deps/usr/share/lintian" "$new/deps/usr/share/Catch2"
find "$new/deps" -name 'libgloo*.so*' -delete
# gloo's headers apart: only a build whose torch lacks them puts them on its include path.
mkdir -p "$new/gloo-include"
mv "$new/deps/usr/include/gloo" "$new/gloo-include/gloo"
size=$(du -sb "$new" | cut -f1)
[ "$size" -le "$limit" ] || die "$new is $((size / 1024 / 1024)) MiB, over the 40 MiB the tree can carry"
echo "size $size bytes" >>"$new/MANIFEST"
rm -rf "$out"
mv "$new" "$out"
echo "pack: $out ready, $((size / 1024 / 1024)) MiB: $(sed -n '3,$p' "$out/MANIFEST" | grep -v '^size' | tr '\n' ' ')"
