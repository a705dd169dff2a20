#!/usr/bin/env bash
# DDP, FSDP full, FSDP grad-op, hybrid and hybrid-grad-op across network-namespace "hosts" (issue 44):
# step time, bytes on the wire per step and host, and peak memory per rank, for the 100.7 M-parameter
# MLP of bench/zero_memory.sh and ctorch-train's ResNet-18, at 2 and 4 hosts x 2 ranks, every host's
# link shaped to SLB_RATE (default 1gbit) with tbf on both ends of its veth (docs/sharding.md, hybrid).
#
# Usage: bench/sharding_lab.sh [hosts=2,4] [rounds=2] [results-file]   (needs root; builds what it needs)
#        bench/sharding_lab.sh --summary RESULTS-FILE   (the table again, from a file's RUN lines)
#   results-file  default bench/results/sharding-lab-<date>.txt
# Environment: SLB_MODELS ("mlp resnet18"), SLB_STRATEGIES ("none full grad-op hybrid hybrid-grad-op"),
#   SLB_RATE (1gbit), SLB_MLP_STEPS (2 timed steps), SLB_MLP_ROUNDS (1: an MLP step takes 15-30 s here),
#   SLB_RESNET_STEPS (4), SLB_RESNET_BATCH (8 per rank), SLB_RESNET_SHAPE (3,32,32), SLB_WARMUP (1 step
#   not timed: the first, which also builds the optimizer state).
#
# One run = one ctorchrun agent per host (--nnodes H --nproc-per-node 2, c10d rendezvous on host 1, a
# port of its own in host 1's namespace), every rank one intra-op thread.
#  - The MLP (6 x 4096^2, Adam, batch 8 per rank) runs as bench/zero_memory.cpp's worker (ctorch-train
#    has no MLP model): mode ddp, fsdp, fsdp-grad-op, hybrid or hybrid-grad-op, each Linear a unit. Its
#    step time is rank 0's median step after the first; its peak RSS is each rank's getrusage.
#  - ResNet-18 runs as ctorch-train --sharding <strategy> on synthetic CIFAR-shaped images (DDP with
#    --comm-hook none: the namespaces share /dev/shm, so the shared-memory hook would bypass the links).
#    Its step time is rank 0's median of the per-step differences of the metrics clock after the warm-up
#    (--log-interval 1); its peak RSS is each rank's maximum resident set from /usr/bin/time.
#  - Bytes: each host's veth counters (bridge side: rx = what the host sent, tx = what it received)
#    before and after a run. Start-up (rendezvous, the model's broadcast, the final save) is subtracted:
#    every configuration also runs once with only the warm-up steps, and bytes per step =
#    (long run - short run) / timed steps. Traffic between the two ranks of one host stays inside its
#    namespace (loopback) and is not counted: only what crosses the host's link is.
# Strategies are interleaved: every round runs each once, the order rotated per round; the table shows
# medians over rounds. The machine has 2 cores: 4-8 ranks on them make every step compute-bound, so
# the table also gives the link time of the measured bytes (bytes / rate), the network-bound view.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_BUILD_DIR:-$root/build}
hosts_list=${1:-2,4}
rounds=${2:-2}
out=${3:-$root/bench/results/sharding-lab-$(date -u +%Y%m%d-%H%M%S).txt}
models=${SLB_MODELS:-mlp resnet18}
strategies=${SLB_STRATEGIES:-none full grad-op hybrid hybrid-grad-op}
rate=${SLB_RATE:-1gbit}
warmup=${SLB_WARMUP:-1}
mlp_steps=${SLB_MLP_STEPS:-2}
mlp_rounds=${SLB_MLP_ROUNDS:-1}
resnet_steps=${SLB_RESNET_STEPS:-4}
resnet_batch=${SLB_RESNET_BATCH:-8}
resnet_shape=${SLB_RESNET_SHAPE:-3,32,32}
die() { echo "sharding_lab.sh: $*" >&2; exit 2; }
[ "$hosts_list" = --summary ] || [[ "$rounds" =~ ^[1-9][0-9]*$ ]] || die "rounds must be a positive number, not '$rounds'"
[[ "$mlp_rounds" =~ ^[1-9][0-9]*$ ]] || die "SLB_MLP_ROUNDS must be a positive number, not '$mlp_rounds'"
[ "$hosts_list" = --summary ] || for h in ${hosts_list//,/ }; do [[ "$h" =~ ^[1-9][0-9]?$ ]] || die "hosts must be numbers 1-99, not '$h'"; done
for m in $models; do [[ "$m" == mlp || "$m" == resnet18 ]] || die "SLB_MODELS takes mlp and resnet18, not '$m'"; done
for s in $strategies; do
  [[ " none full grad-op hybrid hybrid-grad-op " == *" $s "* ]] || die "unknown strategy '$s'"
done
case $rate in
  *gbit) rate_bits=$(( ${rate%gbit} * 1000000000 )) ;;
  *mbit) rate_bits=$(( ${rate%mbit} * 1000000 )) ;;
  *) die "SLB_RATE must be <N>gbit or <N>mbit, not '$rate'" ;;
esac
# The table from RUN lines (a results file will do: bench/sharding_lab.sh --summary FILE).
summary() {
  SLB_RATE_BITS=$rate_bits SLB_MLP_STEPS=$mlp_steps SLB_RESNET_STEPS=$resnet_steps SLB_STRATEGIES="$strategies" \
    /usr/bin/python3 - "$1" <<'PY'
import os, re, statistics, sys
rate = int(os.environ["SLB_RATE_BITS"])
timed = {"mlp": int(os.environ["SLB_MLP_STEPS"]), "resnet18": int(os.environ["SLB_RESNET_STEPS"])}
order = os.environ["SLB_STRATEGIES"].split()
runs = {}
for line in open(sys.argv[1]):
    kv = dict(re.findall(r"(\w+)=(\S+)", line))
    if not line.startswith("RUN "):
        continue
    key = (int(kv["hosts"]), kv["model"], kv["strategy"])
    runs.setdefault(key, {"short": [], "long": []})[kv["kind"]].append(kv)
vec = lambda s: [int(x) for x in s.split(",")]
print("SUMMARY hosts model strategy step_ms(median) step_ms(runs) sent_MB/step/host recv_MB/step/host link_ms/step peak_RSS_MiB/rank(max) state_MB/rank(rank0) step/DDP step/full link/DDP link/full")
res = {}
for key in sorted(runs, key=lambda k: (k[0], k[1] != "mlp", order.index(k[2]))):
    r = runs[key]
    if not r["long"] or not r["short"]:
        continue
    ms = [float(k["ms"]) for k in r["long"]]
    short = r["short"][0]
    n = timed[key[1]]
    # Per host, the mean over the hosts: the c10d rendezvous numbers the nodes in the order they join,
    # so which host holds rank 0 (and sends the start-up broadcast) changes from run to run; the step's
    # collectives are rings (and the replicas' allreduce) in which every host sends and receives alike.
    total = lambda runs, f: statistics.median([sum(vec(k[f])) for k in runs])
    sent = (total(r["long"], "sent") - total([short], "sent")) / n / key[0]
    recv = (total(r["long"], "recv") - total([short], "recv")) / n / key[0]
    link_ms = max(sent, recv) * 8 / rate * 1000
    rss = max(max(vec2) for vec2 in ([float(x) for x in k["peak_rss_mib"].split(",")] for k in r["long"]))
    res[key] = dict(ms=statistics.median(ms), runs="/".join("%.0f" % m for m in ms), sent=sent, recv=recv,
                    link=link_ms, rss=rss, state=r["long"][0]["state_mb"])
for key, v in res.items():
    ddp, full = res.get((key[0], key[1], "none")), res.get((key[0], key[1], "full"))
    f = lambda a, b: "%.2f" % (a / b) if b else "-"
    print("SUMMARY %d %s %s %.0f %s %.1f %.1f %.0f %.0f %s %s %s %s %s" % (
        *key, v["ms"], v["runs"], v["sent"] / 1e6, v["recv"] / 1e6,
        v["link"], v["rss"], v["state"],
        f(v["ms"], ddp and ddp["ms"]), f(v["ms"], full and full["ms"]),
        f(v["link"], ddp and ddp["link"]), f(v["link"], full and full["link"])))
PY
}
if [ "$hosts_list" = --summary ]; then
  [ -f "$rounds" ] || die "--summary needs a results file, not '$rounds'"
  summary "$rounds"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, tc)"

CTORCH_BUILD_DIR=$build "$root/scripts/build.sh" --target ctorchrun ctorch-train zero_memory_bench >/dev/null 2>&1 ||
  die "build failed: scripts/build.sh --target ctorchrun ctorch-train zero_memory_bench"
ctorchrun=$build/launcher/agent/ctorchrun
train=$build/trainer/app/ctorch-train
mlp_bin=$(find "$build" -name zero_memory_bench -type f -perm -u+x | head -1)
lab=$root/scripts/lab/netns.sh
for f in "$ctorchrun" "$train" "$mlp_bin" /usr/bin/time; do [ -x "$f" ] || die "no $f"; done
why=$("$lab" check 2>&1) || die "no network-namespace lab here: $why"

work=$(mktemp -d /tmp/ctorch-shardlab.XXXXXX)
: >"$work/runs"
printf '#!/bin/sh\n# rss_wrap.sh DIR PROGRAM ARGS...: runs PROGRAM, its peak RSS (KiB) into DIR/rss.$RANK\nd=$1; shift\nexec /usr/bin/time -f %%M -o "$d/rss.$RANK" "$@"\n' >"$work/rss_wrap.sh"
chmod +x "$work/rss_wrap.sh"
lab_prefix=""
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  # `down` kills what is left in the namespaces and removes them with their veths (and qdiscs).
  [ -z "$lab_prefix" ] || "$lab" down "$lab_prefix" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

mkdir -p "$(dirname "$out")"
exec > >(tee "$out") 2>&1

lab_up() {  # H: a lab of H hosts, every link shaped both ways
  local n=$1 h burst lab_out
  lab_out=$("$lab" up "$n" --owner $$)
  lab_prefix=$(sed -n 's/^LAB_PREFIX=//p' <<<"$lab_out")
  lab_subnet=$(sed -n 's/^LAB_SUBNET=//p' <<<"$lab_out")
  lab_hosts=$n
  # A burst of ~4 ms at the rate (at least 64 kB, one GSO segment), as bench/parameter_server.sh.
  burst=$(( rate_bits / 8 / 250 )); [ $burst -ge 65536 ] || burst=65536
  for h in $(seq 1 "$n"); do
    tc qdisc replace dev "$lab_prefix-v$h" root tbf rate "$rate" burst "$burst" latency 50ms
    nsenter --net="/run/netns/$lab_prefix-h$h" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
  done
}
lab_down() { [ -z "$lab_prefix" ] || "$lab" down "$lab_prefix" >/dev/null; lab_prefix=""; }

check_rate() {  # 100 MB over TCP from host 1 to host 2, through both shaped ends
  nsenter --net="/run/netns/$lab_prefix-h2" timeout 60 /usr/bin/python3 -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5001)); s.listen(1)
c, _ = s.accept(); n = 0; t = time.time()
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print("lab: tbf %s on both ends of every link: measured %.0f Mbit/s (%d MB over TCP, host 1 -> host 2)" % (sys.argv[1], n * 8 / 1e6 / (time.time() - t), n >> 20))
' "$rate" &
  local listener=$!
  # The sender tries until the listener is up (no guess at how long it takes to start).
  nsenter --net="/run/netns/$lab_prefix-h1" timeout 60 /usr/bin/python3 -c '
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((sys.argv[1], 5001)); break
    except ConnectionRefusedError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
b = bytes(1 << 20)
for _ in range(100): s.sendall(b)
s.close()' "$lab_subnet.2" || echo "lab: bandwidth check failed"
  wait $listener || true
}

counters() {  # "sent received" bytes of every host, one host per line (the bridge side of its veth)
  local h d
  for h in $(seq 1 "$lab_hosts"); do
    d=/sys/class/net/$lab_prefix-v$h/statistics
    echo "$(cat "$d/rx_bytes") $(cat "$d/tx_bytes")"
  done
}

# The worker command of MODEL STRATEGY STEPS DIR, into the array `cmd`.
worker_cmd() {
  local model=$1 strategy=$2 steps=$3 d=$4
  if [ "$model" = mlp ]; then
    local mode
    case $strategy in
      none) mode=ddp ;; full) mode=fsdp ;; grad-op) mode=fsdp-grad-op ;; *) mode=$strategy ;;
    esac
    cmd=("$mlp_bin" "$mode" 6 4096 "$steps")
  else
    local hook=(); [ "$strategy" != none ] || hook=(--comm-hook none)
    # Each rank's peak RSS (KiB) from /usr/bin/time into DIR/rss.<rank>.
    cmd=("$work/rss_wrap.sh" "$d" "$train" --model resnet18 --dataset synthetic-images
         --synthetic-shape "$resnet_shape" --synthetic-size $(( resnet_batch * lab_hosts * 2 * (steps + 2) ))
         --batch-size "$resnet_batch" --max-steps "$steps" --epochs 1 --log-interval 1 --test-limit 16
         --optimizer adam --lr 0.001 --threads 1 --seed 1 --progress none --resume never --timeout 300 --sharding "$strategy" "${hook[@]}"
         --model-dir "$d" --snapshot-path "$d/snapshot.pt")
  fi
}

# run H MODEL STRATEGY KIND(short|long) ROUND: one job; appends its RUN line (or prints FAIL).
run_seq=0
failures=0
run() {
  local H=$1 model=$2 strategy=$3 kind=$4 round=$5
  local timed=$mlp_steps; [ "$model" = mlp ] || timed=$resnet_steps
  local steps=$warmup; [ "$kind" = short ] || steps=$((warmup + timed))
  local d=$work/run$run_seq; run_seq=$((run_seq + 1)); mkdir -p "$d"
  # Host 1's namespace holds only this bench's jobs: a port of its own per run (as parameter_server.sh),
  # never one a finished run may still hold.
  local port=$((20000 + run_seq))
  local -a cmd; worker_cmd "$model" "$strategy" "$steps" "$d"
  counters >"$d/before"
  local h status=0 t0; t0=$(date +%s%N)
  pids=()
  for h in $(seq 1 "$H"); do
    timeout 900 "$lab" exec "$lab_prefix" "$h" env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 \
      "$ctorchrun" --nnodes "$H" --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "$lab_subnet.1:$port" \
      --rdzv-id "slb$run_seq" --max-restarts 0 --tee 3 --log-dir "$d/agent$h" "${cmd[@]}" >"$d/log$h" 2>&1 &
    pids+=($!)
  done
  for h in "${pids[@]}"; do wait "$h" || status=$?; done
  pids=()
  local wall; wall=$(( ($(date +%s%N) - t0) / 1000000 ))
  counters >"$d/after"
  cat "$d"/log[0-9]* >"$d/log"
  local line=""
  if [ $status -eq 0 ]; then
    line=$(/usr/bin/python3 - "$d" "$model" "$warmup" <<'PY' 2>>"$d/log"
import glob, json, os, re, statistics, sys
d, model, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = [list(map(int, l.split())) for l in open(d + "/before")]
after = [list(map(int, l.split())) for l in open(d + "/after")]
sent = ",".join(str(a[0] - b[0]) for a, b in zip(after, before))
recv = ",".join(str(a[1] - b[1]) for a, b in zip(after, before))
log = open(d + "/log", errors="replace").read()
if model == "mlp":
    ranks = {int(m.group(1)): m for m in re.finditer(
        r"rank=(\d+) world=\d+ mode=\S+ params_mb=([\d.]+) grads_mb=([\d.]+) optimizer_mb=([\d.]+) peak_rss_mb=([\d.]+) step_ms=(\d+)", log)}
    ms = float(ranks[0].group(6))
    rss = [float(ranks[r].group(5)) for r in sorted(ranks)]
    state = sum(float(ranks[0].group(i)) for i in (2, 3, 4))
else:
    recs = [json.loads(l) for l in open(d + "/metrics.jsonl") if l.strip()]
    t = {r["step"]: r["time"] for r in recs if r.get("kind") == "train"}
    steps = sorted(s for s in t if s > warmup)
    diffs = [1000.0 * (t[s] - t[s - 1]) for s in steps if s - 1 in t]
    ms = statistics.median(diffs) if diffs else float("nan")
    rss = [int(open(f).read().split()[-1]) / 1024.0 for f in sorted(glob.glob(d + "/rss.*"), key=lambda f: int(f.rsplit(".", 1)[1]))]
    state = float("nan")
print("ms=%.0f peak_rss_mib=%s state_mb=%.1f sent=%s recv=%s" % (ms, ",".join("%.0f" % r for r in rss), state, sent, recv))
PY
) || line=""
  fi
  if [ -n "$line" ]; then
    echo "RUN hosts=$H model=$model strategy=$strategy kind=$kind round=$round wall_ms=$wall $line" | tee -a "$work/runs"
  else
    echo "FAIL hosts=$H model=$model strategy=$strategy kind=$kind round=$round status=$status"
    failures=$((failures + 1))
    grep -v '^\s*$' "$d/log" | tail -8 | sed 's/^/  | /'
  fi
  rm -rf "$d"
}

echo "# DDP / FSDP / hybrid sharding across network-namespace hosts (bench/sharding_lab.sh)"
echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'); LibTorch $(dpkg-query -W -f='${Version}' libtorch-dev 2>/dev/null || echo '?')"
echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(free -g | awk '/Mem:/ {print $2}') GiB; shared with other engineers' builds"
echo "loadavg before: $(cat /proc/loadavg)"
echo "hosts: $hosts_list, 2 ranks each, 1 intra-op thread per rank; rounds: mlp $mlp_rounds, resnet18 $rounds (strategies interleaved, order rotated)"
echo "mlp: bench/zero_memory.cpp's worker, 6 x 4096^2 = 100.7 M parameters, Adam, batch 8 per rank; $warmup warm-up + $mlp_steps timed steps (step time: rank 0's upper median of the timed steps)"
echo "resnet18: ctorch-train --model resnet18 (11.17 M parameters), synthetic images $resnet_shape, batch $resnet_batch per rank, --optimizer adam; $warmup warm-up + $resnet_steps timed steps"
echo "bytes per step = (run with warm-up + timed steps - run with the warm-up only) / timed steps, per host, from its veth"

start=$(date +%s)
read -r -a order <<<"$strategies"
for H in ${hosts_list//,/ }; do
  lab_up "$H"
  check_rate
  for model in $models; do
    for s in "${order[@]}"; do run "$H" "$model" "$s" short 0; done
    n_rounds=$rounds; [ "$model" != mlp ] || n_rounds=$mlp_rounds
    for round in $(seq 1 "$n_rounds"); do
      local_order=("${order[@]:$(( (round - 1) % ${#order[@]} ))}" "${order[@]:0:$(( (round - 1) % ${#order[@]} ))}")
      for s in "${local_order[@]}"; do run "$H" "$model" "$s" long "$round"; done
    done
  done
  lab_down
done
echo "loadavg after: $(cat /proc/loadavg); $(( $(date +%s) - start )) s of runs"

echo
summary "$work/runs"
[ "$failures" -eq 0 ] || { echo "sharding_lab.sh: $failures run(s) failed (FAIL lines above)" >&2; exit 1; }
