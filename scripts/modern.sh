#!/usr/bin/env bash
# The modern lane: LibTorch/PyTorch 2.x (Debian sid: 2.14, GCC 16, CMake 4, Catch2 v3) in a root made
# with debootstrap, cached between runs. The same sources as the bookworm lane, built and tested inside.
#
#   scripts/modern.sh test [ctest args...]   build the whole project inside the root and run the suite
#   scripts/modern.sh build [cmake args...]  only build (into build-modern/)
#   scripts/modern.sh run CMD...             run a command inside the root, in this checkout
#   scripts/modern.sh root                   only make (or check) the root
#
# The root lives in $CTORCH_MODERN_ROOT (default /var/cache/ctorch/sid-root) and is remade only when
# the package list below changes. Needs root (debootstrap, chroot, mounts). The build goes to
# $CTORCH_MODERN_BUILD_DIR (default build-modern/ in this checkout); ccache lives inside the root.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=${CTORCH_MODERN_ROOT:-/var/cache/ctorch/sid-root}
suite=${CTORCH_MODERN_SUITE:-sid}
build=${CTORCH_MODERN_BUILD_DIR:-$here/build-modern}

components=${CTORCH_MODERN_COMPONENTS:-main}
# The LibTorch flavour: CPU (libtorch-dev + python3-torch, the lane CI runs) unless overridden
# (scripts/cuda-check.sh: trixie contrib's libtorch-cuda-dev).
read -r -a torch_packages <<<"${CTORCH_MODERN_TORCH_PACKAGES:-libtorch-dev libgloo-dev python3-torch}"
packages=(
  "${torch_packages[@]}"
  cmake ninja-build g++ make ccache pkg-config
  libcli11-dev libspdlog-dev libfmt-dev catch2 nlohmann-json3-dev zlib1g-dev
  libopenblas0-pthread dataset-fashion-mnist python3-matplotlib
  python3-protobuf protobuf-compiler  # tests/tensorboard/read_events.py (tests only)
  procps psmisc iproute2 util-linux ca-certificates hyperfine
)
# CTORCH_MODERN_PACKAGES: the whole list instead (scripts/gpu/selftest.sh: only what a GPU machine has).
[ -z "${CTORCH_MODERN_PACKAGES:-}" ] || read -r -a packages <<<"$CTORCH_MODERN_PACKAGES"
# What the root was made from; a change remakes it.
stamp="$suite ${packages[*]}"
[ "$components" = main ] || stamp="$stamp components=$components"

die() { echo "modern: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, chroot and bind mounts)"

mirror() {
  # The Debian mirror apt already uses (deb822 or one-line sources), so the root reaches the same registry.
  local url
  url=$(grep -hoE '^(URIs:|deb) +[a-z]+://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* \
          2>/dev/null | head -n 1 | awk '{print $2}') || true
  [ -n "$url" ] || die "no Debian mirror found in /etc/apt/sources.list{,.d}"
  echo "${url%/}"
}

# Runs "$@" inside the root with /proc, /dev, /sys and this checkout mounted, in a private mount
# namespace, so every mount disappears with the command however it ends.
inside() {
  local workdir=$1; shift
  unshare --mount --propagation private --fork -- bash -c '
    set -e
    r=$1 src=$2 wd=$3; shift 3
    mount -t proc proc "$r/proc"
    mount --rbind /dev "$r/dev"
    mount --rbind /sys "$r/sys"
    mount -t tmpfs -o size=4g tmpfs "$r/dev/shm"
    mkdir -p "$r$src"
    mount --bind "$src" "$r$src"
    cp /etc/hosts "$r/etc/hosts"
    cp /etc/resolv.conf "$r/etc/resolv.conf" 2>/dev/null || true
    exec chroot "$r" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      CI="${CI:-}" CTORCH_LANE=modern USE_LIBUV=0 CCACHE_DIR=/root/.cache/ccache \
      CTORCH_TEST_JOBS="${CTORCH_TEST_JOBS:-}" CTORCH_JOBS="${CTORCH_JOBS:-}" \
      CTORCH_CMAKE_ARGS="${CTORCH_CMAKE_ARGS:-}" \
      bash -c "cd \"\$0\" && exec \"\$@\"" "$wd" "$@"
  ' bash "$root" "$here" "$workdir" "$@"
}

make_root() {
  if [ -f "$root/.ctorch-stamp" ] && [ "$(cat "$root/.ctorch-stamp")" = "$stamp" ]; then return 0; fi
  command -v debootstrap >/dev/null || {
    echo "modern: installing debootstrap"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        debootstrap; } >/dev/null 2>&1 || die "apt-get install debootstrap failed"
  }
  local url tmp start log
  url=$(mirror)
  start=$(date +%s)
  tmp="$root.new"
  rm -rf "$tmp" "$root"
  mkdir -p "$(dirname "$root")"
  log=$(mktemp)
  echo "modern: making a Debian $suite root in $root (debootstrap from $url)"
  debootstrap --variant=minbase --components="${components// /,}" "$suite" "$tmp" "$url" >"$log" 2>&1 || {
    tail -n 20 "$log" >&2; die "debootstrap failed (log: $log)"; }
  # The mirror's sid Release file can be past its Valid-Until date: apt would refuse it.
  echo 'Acquire::Check-Valid-Until "false";' >"$tmp/etc/apt/apt.conf.d/99ctorch-valid-until"
  echo 'APT::Install-Recommends "false";' >"$tmp/etc/apt/apt.conf.d/99ctorch-no-recommends"
  if ! root=$tmp inside / bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      ${packages[*]}" >"$log" 2>&1; then
    # CTORCH_MODERN_SKIP_POSTINST: packages whose installer script needs what this machine cannot
    # reach (nvidia-cudnn downloads cuDNN from NVIDIA): their postinst is skipped, said so, and the
    # rest is configured. Only scripts/cuda-check.sh sets it; the CI lane never does.
    [ -n "${CTORCH_MODERN_SKIP_POSTINST:-}" ] || { tail -n 30 "$log" >&2; die "installing packages in the root failed (log: $log)"; }
    local p
    for p in $CTORCH_MODERN_SKIP_POSTINST; do
      echo "modern: skipping the install script of $p (it needs a download this machine cannot make)"
      [ -f "$tmp/var/lib/dpkg/info/$p.postinst" ] && printf '#!/bin/sh\nexit 0\n' >"$tmp/var/lib/dpkg/info/$p.postinst"
    done
    root=$tmp inside / bash -c "dpkg --configure -a && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        ${packages[*]}" >>"$log" 2>&1 || { tail -n 30 "$log" >&2; die "installing packages in the root failed (log: $log)"; }
  fi
  echo "$stamp" >"$tmp/.ctorch-stamp"
  mv "$tmp" "$root"
  rm -f "$log"
  echo "modern: root ready in $(( $(date +%s) - start )) s: $(root=$root inside / python3 -c \
       'import torch; print("PyTorch", torch.__version__)')"
}

# Debian's PyTorch 2.x is built without libuv, yet TCPStore defaults to use_libuv=True, and only some
# of torch.distributed's own TCPStore(...) calls pass USE_LIBUV on: the agent-store client in
# rendezvous.py, torchrun's static and c10d rendezvous stores do not, so every Python worker on an
# agent's store and torchrun itself fail ("use_libuv was requested but PyTorch was built without
# libuv support"). A packaging defect of the test root, not of our code: each TCPStore(...) call in
# those files that lacks use_libuv gets USE_LIBUV's value (Python's rule: unset or "1" = yes), and
# the root runs everything with USE_LIBUV=0. Idempotent; checked on every run.
fix_torch_client() {
  local r=$1 dir
  dir="$r/usr/lib/python3/dist-packages/torch/distributed"
  [ -d "$dir" ] || return 0
  python3 - "$dir" <<'PY'
import pathlib, sys
root = pathlib.Path(sys.argv[1])
mark = "# ctorch: libuv fix"
arg = 'use_libuv=__import__("os").environ.get("USE_LIBUV", "1") == "1",  ' + mark + "\n"
files = [root / "rendezvous.py"] + sorted((root / "elastic").rglob("*.py"))
patched = 0
for path in files:
    src = path.read_text()
    out, i = [], 0
    while True:
        j = src.find("TCPStore(", i)
        if j < 0:
            out.append(src[i:])
            break
        k, depth = j + len("TCPStore("), 1
        while k < len(src) and depth:
            depth += {"(": 1, ")": -1}.get(src[k], 0)
            k += 1
        call = src[j:k]
        line_start = src.rfind("\n", 0, j) + 1
        is_code = not src[line_start:j].lstrip().startswith(("#", ">>>")) and "\n" in call
        if is_code and "use_libuv" not in call and "is_master" in call:
            body = call[:-1].rstrip()
            if not body.endswith((",", "(")):
                body += ","
            last_indent = body[body.rfind("\n") + 1:]
            pad = " " * (len(last_indent) - len(last_indent.lstrip()))
            call = body + "\n" + pad + arg + call[len(call[:-1].rstrip()):-1].lstrip("\n") + ")"
            patched += 1
        out.append(src[i:j] + call)
        i = k
    new = "".join(out)
    if new != src:
        path.write_text(new)
if patched:
    print(f"modern: passed USE_LIBUV to {patched} TCPStore(...) calls of torch.distributed (Debian builds lack libuv)")
PY
}

cmd=${1:-test}
[ $# -gt 0 ] && shift
mkdir -p "$(dirname "$root")"
exec 9>"${root%/}.lock"
flock 9
make_root
fix_torch_client "$root"
flock -u 9
rel=${build#"$here"/}
[ "$rel" != "$build" ] || die "CTORCH_MODERN_BUILD_DIR must lie inside the checkout ($here)"
case $cmd in
  root) ;;
  run) inside "$here" "$@" ;;
  build) inside "$here" env CTORCH_BUILD_DIR="$here/$rel" bash scripts/build.sh "$@" ;;
  test) inside "$here" env CTORCH_BUILD_DIR="$here/$rel" CTORCH_SETUP=skip bash scripts/test.sh "$@" ;;
  *) die "unknown command '$cmd' (test, build, run, root)" ;;
esac
