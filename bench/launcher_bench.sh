#!/usr/bin/env bash
# ctorchrun versus Debian's torchrun, side by side in one run (by hand; results go to
# docs/launcher.md):
#   1. launcher overhead: 2 workers of /bin/true, end to end (hyperfine)
#   2. crash -> replacement: a worker crashes (SIGSEGV) and the group restarts; time from the
#      crash (stamped by the worker right before it) to the replacement's first line (stamped by
#      the replacement as its first act), CLOCK_REALTIME in both
#   3. peak RSS of the launcher process itself (VmHWM) while 2 workers sleep for a second
# Both launchers run the same fake_worker (tests/launcher/fake_worker.cpp) with --no_python.
# torchrun needs "-r 1 -t 1 --log_dir" on Python 3.11. Its --standalone (1.13) is the c10d rendezvous on
# localhost:29400, a fixed port two runs would share, and it cannot restart here: torchrun gets the same
# c10d rendezvous, hosted by itself, on 127.0.0.1 and a port below the ephemeral range
# (scripts/lib/ports.sh), with is_host=true so that a taken port is an error ("Address already in use"),
# not a silent client of whatever holds it; that measurement then runs again on a fresh port.
#
# Usage: bench/launcher_bench.sh [runs]   (default 20 hyperfine runs, 10 crash runs each)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_BUILD_DIR:-$root/build}
runs=${1:-20}
crash_runs=${CRASH_RUNS:-10}

if ! command -v hyperfine >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "bench: installing hyperfine" >&2
  $SUDO apt-get install -y -qq --no-install-recommends hyperfine >/dev/null
fi
TORCHRUN=${TORCHRUN:-/usr/bin/torchrun}
[ -x "$TORCHRUN" ] || { echo "bench: $TORCHRUN not found (apt-get install python3-torch)" >&2; exit 1; }

"$root/scripts/build.sh" --target ctorchrun fake_worker >/dev/null
CT="$build/launcher/agent/ctorchrun"
FW="$build/tests/launcher/fake_worker"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
. "$root/scripts/lib/ports.sh"
# tr_rdzv PORT: sets `rdzv` to torchrun's arguments for a one-node c10d rendezvous it hosts on PORT.
tr_rdzv() { rdzv=(--nnodes 1 --rdzv_backend c10d --rdzv_endpoint "127.0.0.1:$1" --rdzv_conf is_host=true); }

echo "## machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "## ctorchrun $("$CT" --version | cut -d' ' -f2), torchrun from $(/usr/bin/python3 -c 'import torch; print("PyTorch", torch.__version__)')"

# ---- 1. overhead -------------------------------------------------------------------------------
overhead() {  # PORT: both launchers under hyperfine; 98 when torchrun's port was taken
  local rdzv; tr_rdzv "$1"
  hyperfine -N --warmup 3 --runs "$runs" --export-json "$tmp/overhead.json" --show-output \
    -n ctorchrun "$CT --log-level error --standalone --nproc-per-node 2 /bin/true" \
    -n torchrun "$TORCHRUN ${rdzv[*]} --nproc_per_node 2 --monitor_interval 0.1 -r 1 -t 1 --log_dir $tmp/tlogs --no_python /bin/true" \
    >"$tmp/overhead.log" 2>&1 && return 0
  port_taken "$tmp/overhead.log" && return 98
  tail -n 30 "$tmp/overhead.log" >&2
  return 1
}
with_fresh_port overhead

# ---- 2. crash -> replacement's first line ------------------------------------------------------
script=(stamp 'start-{restart}-{rank}' if-rank 0 if-restart-below 1 stamp crash
        if-rank 0 if-restart-below 1 signal SEGV if-restart-below 1 hang)
# gap_ms <file with STAMP lines>: start-1-0 minus crash
gap_ms() {
  awk '$1=="STAMP" && $2=="crash"{c=$3} $1=="STAMP" && $2=="start-1-0"{s=$3} END{ if (c && s) printf "%.3f\n", (s-c)/1e6; else print "nan" }' "$1"
}
crash_torchrun() {  # PORT: one torchrun crash run, the workers' lines in $tmp/t.out; 98 when its port was taken
  local rdzv; tr_rdzv "$1"
  rm -rf "$tmp/tl"
  "$TORCHRUN" "${rdzv[@]}" --nproc_per_node 2 --max_restarts 1 --monitor_interval 0.1 -r 1 -t 1 \
    --log_dir "$tmp/tl" --no_python "$FW" "${script[@]}" >"$tmp/t.log" 2>&1 || true
  ! port_taken "$tmp/t.log" || return 98
  cat "$tmp"/tl/*/attempt_*/0/stdout.log > "$tmp/t.out" 2>/dev/null || true
}
: > "$tmp/crash_ctorchrun.txt"; : > "$tmp/crash_torchrun.txt"
for i in $(seq "$crash_runs"); do
  "$CT" --log-level error --standalone --nproc-per-node 2 --max-restarts 1 "$FW" "${script[@]}" \
    2>/dev/null | sed 's/^\[default[0-9]*\]://' > "$tmp/c.out"
  gap_ms "$tmp/c.out" >> "$tmp/crash_ctorchrun.txt"
  with_fresh_port crash_torchrun
  gap_ms "$tmp/t.out" >> "$tmp/crash_torchrun.txt"
done

# ---- 3. peak RSS of the launcher itself ---------------------------------------------------------
peak_rss_kib() {  # LOG COMMAND...: runs COMMAND in the background (output to LOG), follows its VmHWM until it exits
  local log=$1; shift
  "$@" >"$log" 2>&1 &
  local pid=$! hwm=0 v
  while kill -0 "$pid" 2>/dev/null; do
    v=$(awk '/^VmHWM:/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [ -n "$v" ] && [ "$v" -gt "$hwm" ] && hwm=$v
    sleep 0.02
  done
  wait "$pid" || true
  echo "$hwm"
}
rss_ct=$(peak_rss_kib /dev/null "$CT" --log-level error --standalone --nproc-per-node 2 "$FW" sleep 1000)
rss_torchrun() {  # PORT: sets rss_tr; 98 when torchrun's port was taken
  local rdzv; tr_rdzv "$1"
  rss_tr=$(peak_rss_kib "$tmp/rss.log" "$TORCHRUN" "${rdzv[@]}" --nproc_per_node 2 --monitor_interval 0.1 -r 1 -t 1 \
    --log_dir "$tmp/rl" --no_python "$FW" sleep 1000)
  ! port_taken "$tmp/rss.log" || return 98
}
with_fresh_port rss_torchrun

python3 - "$tmp" "$rss_ct" "$rss_tr" <<'EOF'
import json, math, statistics, sys
tmp, rss_ct, rss_tr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# In the order hyperfine ran them (newer hyperfine puts the command, not the -n name, in "command").
ct, tr = json.load(open(f"{tmp}/overhead.json"))["results"][:2]
def crash(name):
    v = [float(x) for x in open(f"{tmp}/crash_{name}.txt") if x.strip() != "nan"]
    return v
cc, tc = crash("ctorchrun"), crash("torchrun")
print()
print("| measurement | ctorchrun | torchrun | ratio | target |")
print("|---|---|---|---|---|")
ratio = ct["mean"] / tr["mean"]
print(f"| overhead, 2 x /bin/true (mean ± sd of {len(ct['times'])}) | {ct['mean']*1e3:.1f} ± {ct['stddev']*1e3:.1f} ms "
      f"| {tr['mean']*1e3:.0f} ± {tr['stddev']*1e3:.0f} ms | {ratio:.4f} (1/{1/ratio:.0f}) | ≤ 1/3: {'met' if ratio <= 1/3 else 'MISSED'} |")
if cc and tc:
    r = statistics.median(cc) / statistics.median(tc)
    print(f"| crash → replacement's first line (median of {len(cc)}/{len(tc)}; min–max) | {statistics.median(cc):.1f} ms "
          f"({min(cc):.1f}–{max(cc):.1f}) | {statistics.median(tc):.0f} ms ({min(tc):.0f}–{max(tc):.0f}) "
          f"| {r:.4f} (1/{1/r:.0f}) | ≤ 1/10: {'met' if r <= 0.1 else 'MISSED'} |")
else:
    print(f"| crash → replacement | {cc} | {tc} | - | measurement failed |")
print(f"| peak RSS of the launcher process (VmHWM) | {rss_ct/1024:.1f} MiB | {rss_tr/1024:.0f} MiB | {rss_ct/max(rss_tr,1):.3f} | - |")
EOF
