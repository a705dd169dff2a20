#!/usr/bin/env bash
# ctorchrun versus Debian's torchrun, side by side in one run (by hand; results go to
# docs/launcher.md):
#   1. launcher overhead: 2 workers of /bin/true, end to end (hyperfine)
#   2. crash -> replacement: a worker crashes (SIGSEGV) and the group restarts; time from the
#      crash (stamped by the worker right before it) to the replacement's first line (stamped by
#      the replacement as its first act), CLOCK_REALTIME in both
#   3. peak RSS of the launcher process itself (VmHWM) while 2 workers sleep for a second
# Both launchers run the same fake_worker (tests/launcher/fake_worker.cpp) with --no_python.
# torchrun needs "-r 1 -t 1 --log_dir" on Python 3.11, and its --standalone cannot restart here, so
# the crash measurement uses --rdzv_backend c10d on a free port (see shared/notes/test-lab.md).
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
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "## machine: $(nproc) cores, $(uname -r), $(date -u +%Y-%m-%dT%H:%MZ)"
echo "## ctorchrun $("$CT" --version | cut -d' ' -f2), torchrun from $(/usr/bin/python3 -c 'import torch; print("PyTorch", torch.__version__)')"

# ---- 1. overhead -------------------------------------------------------------------------------
hyperfine -N --warmup 3 --runs "$runs" --export-json "$tmp/overhead.json" \
  -n ctorchrun "$CT --log-level error --standalone --nproc-per-node 2 /bin/true" \
  -n torchrun "$TORCHRUN --standalone --nproc_per_node 2 --monitor_interval 0.1 -r 1 -t 1 --log_dir $tmp/tlogs --no_python /bin/true" \
  >&2

# ---- 2. crash -> replacement's first line ------------------------------------------------------
script=(stamp 'start-{restart}-{rank}' if-rank 0 if-restart-below 1 stamp crash
        if-rank 0 if-restart-below 1 signal SEGV if-restart-below 1 hang)
# gap_ms <file with STAMP lines>: start-1-0 minus crash
gap_ms() {
  awk '$1=="STAMP" && $2=="crash"{c=$3} $1=="STAMP" && $2=="start-1-0"{s=$3} END{ if (c && s) printf "%.3f\n", (s-c)/1e6; else print "nan" }' "$1"
}
: > "$tmp/crash_ctorchrun.txt"; : > "$tmp/crash_torchrun.txt"
for i in $(seq "$crash_runs"); do
  "$CT" --log-level error --standalone --nproc-per-node 2 --max-restarts 1 "$FW" "${script[@]}" \
    2>/dev/null | sed 's/^\[default[0-9]*\]://' > "$tmp/c.out"
  gap_ms "$tmp/c.out" >> "$tmp/crash_ctorchrun.txt"
  rm -rf "$tmp/tl"
  "$TORCHRUN" --nnodes 1 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint "127.0.0.1:$(free_port)" \
    --max_restarts 1 --monitor_interval 0.1 -r 1 -t 1 --log_dir "$tmp/tl" --no_python "$FW" "${script[@]}" \
    >/dev/null 2>&1 || true
  cat "$tmp"/tl/*/attempt_*/0/stdout.log > "$tmp/t.out" 2>/dev/null || true
  gap_ms "$tmp/t.out" >> "$tmp/crash_torchrun.txt"
done

# ---- 3. peak RSS of the launcher itself ---------------------------------------------------------
peak_rss_kib() {  # runs "$@" in the background and follows its VmHWM until it exits
  "$@" >/dev/null 2>&1 &
  local pid=$! hwm=0 v
  while kill -0 "$pid" 2>/dev/null; do
    v=$(awk '/^VmHWM:/{print $2}' "/proc/$pid/status" 2>/dev/null || true)
    [ -n "$v" ] && [ "$v" -gt "$hwm" ] && hwm=$v
    sleep 0.02
  done
  wait "$pid" || true
  echo "$hwm"
}
rss_ct=$(peak_rss_kib "$CT" --log-level error --standalone --nproc-per-node 2 "$FW" sleep 1000)
rss_tr=$(peak_rss_kib "$TORCHRUN" --standalone --nproc_per_node 2 --monitor_interval 0.1 -r 1 -t 1 \
  --log_dir "$tmp/rl" --no_python "$FW" sleep 1000)

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
