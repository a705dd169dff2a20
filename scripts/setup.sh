#!/usr/bin/env bash
# Installs the Debian (bookworm) packages this project needs, if any is missing.
# Idempotent and silent when everything is present. Used by scripts/demo.sh and scripts/test.sh.
set -euo pipefail

packages=(
  # build
  cmake g++ make ninja-build ccache pkg-config
  # libraries (find_package)
  libtorch-dev libgloo-dev libcli11-dev libspdlog-dev libfmt-dev catch2 nlohmann-json3-dev zlib1g-dev
  # fast BLAS for LibTorch's CPU kernels (Debian's default reference BLAS is ~2x slower)
  libopenblas0-pthread
  # real data for the demo and the accuracy tests
  dataset-fashion-mnist
  # the Python peer (torchrun + PyTorch DDP) the tests compare against
  python3-torch
  # scripts/plot_metrics.py (loss/accuracy curves of ctorch-train's metrics file)
  python3-matplotlib
  # tests/tensorboard/read_events.py: TensorBoard's event messages compiled with protoc and read with
  # protobuf's own parser (the tests only: the library writes event files without libprotobuf)
  python3-protobuf protobuf-compiler
  # scripts/fuzz.sh: libFuzzer (the store's request parser, the snapshot loader), run by CI
  clang libclang-rt-14-dev
  # multi-node tests: network namespaces and a real single-host Slurm cluster
  iproute2 iptables procps psmisc util-linux slurmctld slurmd slurm-client munge
  # scripts/modern.sh: the modern lane's Debian sid root (CI makes it while this lane runs)
  debootstrap
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [ "$status" = "installed" ] || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  tail -n 30 "$log" >&2
  echo "setup: apt-get failed (full log: $log)" >&2
  exit 1
fi
rm -f "$log"
echo "setup: done"
