#!/usr/bin/env bash
# FSDP mixed precision's gather against the float32 one: ctorch's ring allGather of the same elements in
# float32 and cast to bfloat16 (bench/shard_collectives.cpp), over 127.0.0.1 and across network-namespace
# hosts whose links are shaped to RATE (tbf on both ends of each veth; one rank per host), so that the wire,
# not memcpy, bounds it. Usage (root for the hosts): bench/gather_dtype.sh [hosts=2] [sizes_mb=16,64] [reps=5]
# Env: RATE (default 1gbit). Writes bench/results/gather-dtype-<date>.txt.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$root/bench/lib.sh"
hosts=${1:-2}; sizes=${2:-16,64}; reps=${3:-5}; rate=${RATE:-1gbit}
[[ $hosts =~ ^[2-8]$ && $reps =~ ^[1-9][0-9]*$ && $sizes =~ ^[0-9,]+$ ]] || { echo "gather_dtype.sh: hosts 2-8, reps > 0, sizes a list of MB" >&2; exit 2; }
"$root/scripts/build.sh" --target shard_collectives_bench >/dev/null
build=${CTORCH_BUILD_DIR:-$root/build}
bin=$(find "$build" -name shard_collectives_bench -type f -perm -u+x | head -1)
lab=$root/scripts/lab/netns.sh
out="$root/bench/results/gather-dtype-$(date +%Y%m%d).txt"
tmp=$(mktemp -d); prefix=""; [ -z "${KEEP_TMP:-}" ] || tmp=$KEEP_TMP
cleanup() { [ -z "$prefix" ] || "$lab" down "$prefix" >/dev/null 2>&1 || true; rm -rf "$tmp"; }
trap cleanup EXIT
export OMP_NUM_THREADS=1  # (after nproc --all above is read: nproc honours it)
unset TORCHELASTIC_USE_AGENT_STORE SLURM_PROCID || true
exec > >(tee "$out") 2>&1
echo "# bench/gather_dtype.sh $hosts $sizes $reps (RATE=$rate): $(date -u +%FT%TZ), $(nproc --all) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
summary() {  # what: the fp32 and bf16 gathers of each size, and their ratio
  awk -v what="$1" '/method=ring_all_gather /{split($1,a,"=");split($4,m,"="); f[a[2]]=m[2]} /method=ring_all_gather_bf16_cast /{split($1,a,"=");split($4,m,"="); b[a[2]]=m[2]}
    END {for (s in f) printf "%s: %s MB of float32 parameters gathered: float32 %.1f ms, bfloat16 (cast included) %.1f ms, ratio %.2f\n", what, s, f[s], b[s], b[s]/f[s]}' "$2" | sort -t: -k2 -n
}
# 1) loopback, every rank on this machine
bench_ranks "$hosts" "$tmp/lo" 600 "$bin" "$sizes" "$reps" ||
  { echo "gather_dtype.sh: the loopback job failed:"; cat "$tmp"/lo*.out; exit 1; }
summary "127.0.0.1, $hosts ranks" "$tmp/lo0.out"
# 2) one rank per namespace host, links shaped to $rate (a fixed port: nothing else lives in these namespaces)
if [ "$(id -u)" -ne 0 ] || ! why=$("$lab" check 2>&1); then echo "no namespace hosts here (${why:-needs root}): loopback only"; exit 0; fi
lab_out=$("$lab" up "$hosts" --owner $$)
prefix=$(sed -n 's/^LAB_PREFIX=//p' <<<"$lab_out")
rate_bits=$(python3 -c "import sys; r=sys.argv[1].lower(); m={'k':1e3,'m':1e6,'g':1e9}; print(int(float(r.rstrip('bit').rstrip('kmg') or 0)*m.get(r.rstrip('bit')[-1],1)))" "$rate")
burst=$(( rate_bits / 8 / 250 )); [ $burst -ge 65536 ] || burst=65536
for h in $(seq 1 "$hosts"); do
  tc qdisc replace dev "$prefix-v$h" root tbf rate "$rate" burst "$burst" latency 50ms
  nsenter --net="/run/netns/$prefix-h$h" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
done
addr1=$("$lab" addr "$prefix" 1)
pids=()
for ((r = 0; r < hosts; r++)); do
  nsenter --net="/run/netns/$prefix-h$((r + 1))" env GLOO_SOCKET_IFNAME=eth0 RANK=$r LOCAL_RANK=0 WORLD_SIZE=$hosts LOCAL_WORLD_SIZE=1 \
    MASTER_ADDR="$addr1" MASTER_PORT=29531 timeout 900 "$bin" "$sizes" "$reps" >"$tmp/ns$r.out" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
summary "$hosts namespace hosts, $rate links" "$tmp/ns0.out"
