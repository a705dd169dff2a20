#!/usr/bin/env bash
# Step time of ctorch-train's parameter server (--sync parameter-server) against allreduce (issue 32.5),
# side by side in one run: small and large model, 2 and 4 workers, on one host and on network-namespace
# hosts with a tc bandwidth limit on every host's link (docs/parameter-server.md, "Measured").
#
# Usage: bench/parameter_server.sh [reps] [results-file]   (needs root for the lab; builds what it needs)
#   reps          repetitions of every configuration (default 3); the table shows the median
#   results-file  default bench/results/parameter-server-<date>.txt
# Environment: PSB_PLACES ("host lab-1gbit lab-100mbit": one host, and the lab with that tbf rate on
#   every host's link), PSB_MODELS ("small large"), PSB_WORKERS ("2 4"), PSB_SERVERS ("1 2"),
#   PSB_SKIP ("lab-100mbit:large"; empty: none): place:model pairs not run (there a parameter-server
#   step of the large model takes ~30 s).
#
# One run = one ctorch-train job. Its step time comes from rank 0's metrics file: the training clock at
# the last logged step minus the clock at the first logged step (the warm-up: the first --log-interval
# steps are not counted), divided by the steps between them. The configurations are interleaved (every
# configuration once per repetition) so that the load of other work on the machine falls on all alike.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${CTORCH_BUILD_DIR:-$root/build}
reps=${1:-3}
out=${2:-$root/bench/results/parameter-server-$(date +%Y%m%d-%H%M%S).txt}
places=${PSB_PLACES:-host lab-1gbit lab-100mbit}
skip=${PSB_SKIP-lab-100mbit:large}
models=${PSB_MODELS:-small large}
workers_list=${PSB_WORKERS:-2 4}
servers_list=${PSB_SERVERS:-1 2}
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || { echo "parameter_server.sh: reps must be a positive number, not '$reps'" >&2; exit 2; }
for v in $workers_list $servers_list; do
  [[ "$v" =~ ^[1-9][0-9]?$ ]] || { echo "parameter_server.sh: PSB_WORKERS and PSB_SERVERS take numbers 1-99, not '$v'" >&2; exit 2; }
done
for m in $models; do
  [[ "$m" == small || "$m" == large ]] || { echo "parameter_server.sh: PSB_MODELS takes small and large, not '$m'" >&2; exit 2; }
done
for p in $places; do
  [[ "$p" == host || "$p" =~ ^lab-[1-9][0-9]*[mg]bit$ ]] || { echo "parameter_server.sh: PSB_PLACES takes host and lab-<N>mbit|gbit, not '$p'" >&2; exit 2; }
done

CTORCH_BUILD_DIR=$build "$root/scripts/build.sh" --target ctorchrun ctorch-train >/dev/null
ctorchrun=$build/launcher/agent/ctorchrun
train=$build/trainer/app/ctorch-train
lab=$root/scripts/lab/netns.sh
if [ ! -x "$ctorchrun" ] || [ ! -x "$train" ]; then echo "parameter_server.sh: no $ctorchrun or $train" >&2; exit 1; fi

work=$(mktemp -d /tmp/ctorch-psbench.XXXXXX)
: >"$work/runs"  # the RUN lines, for the table at the end
lab_prefix=""
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -z "$lab_prefix" ] || "$lab" down "$lab_prefix" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

mkdir -p "$(dirname "$out")"
exec > >(tee "$out") 2>&1

# The two models. small: the CIFAR tutorial CNN on 48x48 images (169,526 parameters, 0.68 MB);
# large: ResNet-18 (11,173,962 parameters, 44.7 MB) on 8x8 images, so that its compute stays small
# enough for this machine while its gradients are as large as on CIFAR.
model_args() {
  case $1 in
    small) echo "--model simple-cnn --synthetic-shape 3,48,48 --synthetic-size 4096 --batch-size 16 --max-steps 50 --log-interval 10" ;;
    large) echo "--model resnet18 --synthetic-shape 3,8,8 --synthetic-size 1024 --batch-size 8 --max-steps 12 --log-interval 4" ;;
  esac
}

# Milliseconds per step from a metrics file: (time at the last record - time at the first) / steps.
step_ms() {
  python3 - "$1" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
recs = [r for r in recs if r.get("kind") == "train"]
a, b = recs[0], recs[-1]
print("%.1f" % (1000.0 * (b["time"] - a["time"]) / (b["step"] - a["step"])))
PY
}

# run PLACE MODEL WORKERS CONFIG REP: one job; prints its RUN line (or FAIL with the log's tail).
run_seq=0
failures=0
run() {
  local place=$1 model=$2 w=$3 config=$4 rep=$5
  local d=$work/run$run_seq; run_seq=$((run_seq + 1)); mkdir -p "$d"
  local -a args
  # shellcheck disable=SC2207
  args=($(model_args "$model") --dataset synthetic-images --test-limit 16 --epochs 1 --threads 1 --seed 1
        --progress none --resume never --timeout 120 --model-dir "$d" --snapshot-path "$d/snapshot.pt")
  local n=$w
  case $config in
    allreduce-shm) ;;                                   # DDP's default on one host: a shared segment
    allreduce) args+=(--comm-hook none) ;;              # DDP through Gloo's allreduce over TCP
    ps*) n=$((w + ${config#ps})); args+=(--sync parameter-server --ps-servers "${config#ps}") ;;
  esac
  local status=0
  if [ "$place" = host ]; then
    timeout 600 "$ctorchrun" --standalone --nproc-per-node "$n" "$train" "${args[@]}" >"$d/log" 2>&1 &
    pids=($!); wait "${pids[0]}" || status=$?
  else
    local h port=$((20000 + run_seq))
    pids=()
    for h in $(seq 1 "$n"); do
      timeout 600 "$lab" exec "$lab_prefix" "$h" env GLOO_SOCKET_IFNAME=eth0 "$ctorchrun" --nnodes "$n" \
        --node-rank $((h - 1)) --nproc-per-node 1 --master-addr "$lab_subnet.1" --master-port "$port" \
        --rdzv-id "psb$run_seq" "$train" "${args[@]}" >"$d/log$h" 2>&1 &
      pids+=($!)
    done
    for h in "${pids[@]}"; do wait "$h" || status=$?; done
    cat "$d"/log[0-9]* >"$d/log"
  fi
  pids=()
  local ms=""
  if [ $status -eq 0 ]; then ms=$(step_ms "$d/metrics.jsonl" 2>/dev/null) || true; fi
  if [ -n "$ms" ]; then
    echo "RUN place=$place model=$model workers=$w config=$config rep=$rep ms_per_step=$ms" | tee -a "$work/runs"
  else
    echo "FAIL place=$place model=$model workers=$w config=$config rep=$rep status=$status"
    failures=$((failures + 1))
    tail -5 "$d/log" | sed 's/^/  | /'
  fi
  rm -rf "$d"
}

configs_for() {  # PLACE
  local c=""
  [ "$1" = host ] && c="allreduce-shm"
  c+=" allreduce"
  local s; for s in $servers_list; do c+=" ps$s"; done
  echo "$c"
}

echo "# parameter server vs allreduce, ctorch-train step time (bench/parameter_server.sh)"
echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); commit $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "machine: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), $(free -g | awk '/Mem:/ {print $2}') GiB"
echo "loadavg before: $(cat /proc/loadavg)"
echo "The machine is shared (others build on the same cores during the run): every configuration runs once"
echo "per repetition, interleaved, so background load falls on all of them alike; the table shows medians."
echo "Every rank uses 1 intra-op thread; 4 workers + servers on $(nproc) cores are oversubscribed."
echo "configs: allreduce-shm = DDP's default on one host (gradients averaged in a shared-memory segment);"
echo "  allreduce = DDP with --comm-hook none (Gloo's allreduce over TCP); psK = --sync parameter-server"
echo "  --ps-servers K (W workers + K server ranks). Step time excludes the first --log-interval steps."
for m in $models; do echo "model $m: $(model_args "$m")"; done

# The tbf rate of every lab link, both directions (the bridge side shapes what a host receives, its
# eth0 what it sends), with a burst of ~4 ms at that rate (at least 64 kB, one GSO segment).
lab_hosts=0
lab_rate=""
set_rate() {
  local rate=$1 bits burst h
  [ "$rate" != "$lab_rate" ] || return 0
  case $rate in
    *gbit) bits=$(( ${rate%gbit} * 1000000000 )) ;;
    *mbit) bits=$(( ${rate%mbit} * 1000000 )) ;;
    *) echo "parameter_server.sh: lab rate must be <N>gbit or <N>mbit, not '$rate'" >&2; exit 2 ;;
  esac
  burst=$(( bits / 8 / 250 )); [ $burst -ge 65536 ] || burst=65536
  for h in $(seq 1 "$lab_hosts"); do
    tc qdisc replace dev "$lab_prefix-v$h" root tbf rate "$rate" burst "$burst" latency 50ms
    nsenter --net="/run/netns/$lab_prefix-h$h" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
  done
  lab_rate=$rate
}

# What a limit gives: 50 MB over TCP from host 1 to host 2.
check_rate() {
  nsenter --net="/run/netns/$lab_prefix-h2" timeout 60 python3 -c '
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 5001)); s.listen(1)
c, _ = s.accept(); n = 0; t = time.time()
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
print("lab: tbf rate %s on every link, both ways: measured %.0f Mbit/s (50 MB over TCP)" % (sys.argv[1], n * 8 / 1e6 / (time.time() - t)))
' "$lab_rate" &
  local listener=$!
  # The sender tries until the listener is up (no guess at how long it takes to start).
  nsenter --net="/run/netns/$lab_prefix-h1" timeout 60 python3 -c '
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        s = socket.create_connection((sys.argv[1], 5001)); break
    except ConnectionRefusedError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
b = bytes(1 << 20)
for _ in range(50): s.sendall(b)
s.close()' "$lab_subnet.2" || echo "lab: bandwidth check failed"
  wait $listener || true
}

if [[ " $places " == *" lab-"* ]]; then
  if ! why=$("$lab" check 2>&1); then
    echo "lab: not available ($why): measuring on one host only"
    places=host
  else
    max_w=0; for w in $workers_list; do if [ "$w" -gt "$max_w" ]; then max_w=$w; fi; done
    max_s=0; for s in $servers_list; do if [ "$s" -gt "$max_s" ]; then max_s=$s; fi; done
    lab_hosts=$((max_w + max_s))
    lab_out=$("$lab" up "$lab_hosts" --owner $$)
    lab_prefix=$(sed -n 's/^LAB_PREFIX=//p' <<<"$lab_out")
    lab_subnet=$(sed -n 's/^LAB_SUBNET=//p' <<<"$lab_out")
    for place in $places; do
      [[ "$place" != lab-* ]] || { set_rate "${place#lab-}"; check_rate; }
    done
    echo "lab: $lab_hosts namespace hosts on one bridge, one rank per host (ctorchrun --nnodes N --node-rank i,"
    echo "  static rendezvous); the server(s) are the last host(s). allreduce uses --comm-hook none there: the"
    echo "  namespaces share /dev/shm, so DDP's shared-memory path would bypass the links."
  fi
fi
[ -z "$skip" ] || echo "not run: $skip"

start=$(date +%s)
for rep in $(seq 1 "$reps"); do
  for place in $places; do
    [[ "$place" != lab-* ]] || set_rate "${place#lab-}"
    for model in $models; do
      [[ " $skip " != *" $place:$model "* ]] || continue
      for w in $workers_list; do
        for config in $(configs_for "$place"); do
          run "$place" "$model" "$w" "$config" "$rep"
        done
      done
    done
  done
done
echo "loadavg after: $(cat /proc/loadavg); $(( $(date +%s) - start )) s of runs"

# The table: median ms/step per configuration, and the parameter server against Gloo allreduce.
echo
PSB_ORDER="$places" python3 - "$work/runs" <<'PY'
import os, re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"RUN place=(\S+) model=(\S+) workers=(\d+) config=(\S+) rep=\d+ ms_per_step=([\d.]+)", line)
    if m:
        runs.setdefault(m.groups()[:4], []).append(float(m.group(5)))
med = {k: statistics.median(v) for k, v in runs.items()}
print("SUMMARY place model workers config median_ms_per_step runs ratio_to_allreduce")
order = os.environ["PSB_ORDER"].split()
for k in sorted(med, key=lambda k: (order.index(k[0]) if k[0] in order else 99, k[1] != "small", int(k[2]), k[3])):
    base = med.get(k[:3] + ("allreduce",))
    ratio = "%.2f" % (med[k] / base) if base else "-"
    print("SUMMARY %s %s %s %s %.1f %s %s" % (*k, med[k], "/".join("%.0f" % v for v in runs[k]), ratio))
PY
[ "$failures" -eq 0 ] || { echo "parameter_server.sh: $failures run(s) failed (FAIL lines above)" >&2; exit 1; }
