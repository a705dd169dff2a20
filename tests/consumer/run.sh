#!/usr/bin/env bash
# Installs this build tree into a temporary prefix, builds tests/consumer (a user's resilient training
# program) against it with only -DCMAKE_PREFIX_PATH (find_package(ctorch)), and runs it: alone (no
# distributed variables: a world of 1) and as 2 processes with the torchrun variables (rank 0 hosts
# the store on a fixed port, run again on another when it was taken): uninterrupted; stopped by
# SIGTERM mid-training (every rank exits 75) then resumed by the same command, which must end with
# the same model.pt, byte for byte; and once more after the end (nothing left to do, model.pt
# unchanged).
# Usage: run.sh <build-dir> <expected-output-regex> [--keep-binary PATH]
#   --keep-binary: leaves the consumer at PATH when every check passed (the chaos tests run it; it
#   links ctorch statically, so it needs only LibTorch where it is copied to).
set -euo pipefail
build=$1
expect=$2
keep=
if [ "${3:-}" = --keep-binary ]; then
  keep=${4:?--keep-binary needs a path}
  rm -f "$keep"
fi
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../../scripts/lib/ports.sh
. "$here/../../scripts/lib/ports.sh"
tmp=$(mktemp -d)
pids=()
cleanup() {
  # Each pid is a `timeout`, whose child is the consumer.
  for pid in "${pids[@]}"; do pkill -KILL -P "$pid" 2>/dev/null || true; kill -KILL "$pid" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

cmake --install "$build" --prefix "$tmp/installed" >/dev/null
# The package is relocatable: it names no path of the LibTorch it was built with (Torch comes from
# find_dependency(Torch)), and it still works after the whole prefix is moved.
if grep -nE '/[^";]*lib(c10|torch)[a-z_]*\.so' "$tmp"/installed/lib*/cmake/ctorch/ctorchTargets*.cmake; then
  fail "the installed package hard-codes LibTorch library paths (above)"
fi
# The public API only, by construction: exactly trainer/include/ctorch/ is installed, and every
# header an installed one includes is installed too (nothing of trainer/src/, the library's rooms).
src_api=$(cd "$here/../../trainer/include/ctorch" && ls *.hpp)
installed_api=$(cd "$tmp/installed/include/ctorch" && ls *.hpp)
if [ "$src_api" != "$installed_api" ]; then
  diff <(echo "$src_api") <(echo "$installed_api")
  fail "the installed ctorch/*.hpp differ from trainer/include/ctorch/ (above)"
fi
missing=0
while IFS= read -r inc; do
  [ -f "$tmp/installed/include/$inc" ] || { echo "not installed: $inc"; missing=1; }
done < <(grep -rhoE '#include [<"]ctorch/[A-Za-z0-9_/]+\.hpp[>"]' "$tmp/installed/include" |
         sed -E 's/#include [<"]//; s/[>"]$//' | sort -u)
if [ $missing = 1 ] || grep -rnE '#include "(core|comm|ddp|sampler|amp|fsdp|zero|parameter_server|snapshot|resilience|tensorboard)/' \
    "$tmp/installed/include"; then
  fail "an installed header includes one that is not installed (above)"
fi
mv "$tmp/installed" "$tmp/prefix"
# What a user reads comes with the package (issue 42.5, 42.6): the license, README and docs, the
# metrics plotter as a program, and ctorch-train's --help naming the docs where they now are.
docdir=$(cd "$tmp/prefix" && ls -d share/doc/ctorch 2>/dev/null) || fail "no share/doc/ctorch in the installed prefix"
for f in LICENSE README.md docs/trainer.md docs/snapshot.md; do
  [ -f "$tmp/prefix/$docdir/$f" ] || fail "not installed: $docdir/$f"
done
grep -q "BSD 3-Clause" "$tmp/prefix/$docdir/LICENSE" || fail "the installed LICENSE is not the BSD 3-Clause license"
[ -x "$tmp/prefix/bin/ctorch-plot-metrics" ] || fail "ctorch-plot-metrics is not installed as a program"
"$tmp/prefix/bin/ctorch-plot-metrics" --help >/dev/null || fail "ctorch-plot-metrics --help failed"
[ -x "$tmp/prefix/bin/ctorch-snapshot" ] || fail "ctorch-snapshot is not installed"
"$tmp/prefix/bin/ctorch-snapshot" --help >/dev/null || fail "ctorch-snapshot --help failed"
help=$("$tmp/prefix/bin/ctorch-train" --help) || fail "the installed ctorch-train --help failed"
grep -qF "Documentation: $tmp/prefix/$docdir/docs/trainer.md." <<<"$help" ||
  fail "the installed ctorch-train --help does not name $tmp/prefix/$docdir/docs/trainer.md: $(tail -1 <<<"$help")"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# Paths under the fresh temporary prefix differ on every run: relative to it, ccache hits again.
export CCACHE_BASEDIR=$tmp CCACHE_NOHASHDIR=1
start=$(date +%s)
cmake -S "$here" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" "${launcher[@]}" >/dev/null
cmake --build "$tmp/build" --parallel 2 >/dev/null
consumer=$tmp/build/consumer
echo "consumer: configured and built against the moved prefix in $(( $(date +%s) - start )) s"

# Clean slate: the test may itself run under a launcher or Slurm.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE \
      TORCHELASTIC_ERROR_FILE TORCHELASTIC_RESTART_COUNT SLURM_PROCID SLURM_NTASKS SLURM_LOCALID \
      SLURM_JOB_ID SLURM_STEP_NODELIST SLURM_JOB_NODELIST || true
export OMP_NUM_THREADS=1

# A bad flag: one line, exit 2.
rc=0
err=$("$consumer" --epochs 2 --bogus 1 2>&1 >/dev/null) || rc=$?
[ "$rc" -eq 2 ] && [ "$(echo "$err" | wc -l)" -eq 1 ] && echo "$err" | grep -q "unknown flag '--bogus'" ||
  fail "a bad flag gave exit $rc and: $err"

# A world of 1: no variables at all.
mkdir "$tmp/alone"
out=$(cd "$tmp/alone" && timeout 120 "$consumer" --epochs 1 --out alone.pt --tensorboard-dir tb 2>&1)
echo "$out" | tail -n 3
echo "$out" | grep -Eq "$expect" || fail "no line matches '$expect'"
echo "$out" | grep -q "1 rank(s), no launcher" || fail "not a world of 1 without a launcher"
echo "$out" | grep -Eq '^epoch 1/1 step 64/64 loss [0-9.]+$' || fail "no last step line"
[ -s "$tmp/alone/alone.pt" ] && [ -s "$tmp/alone/snapshot.pt" ] || fail "alone: no alone.pt or snapshot.pt"
# ctorch::SummaryWriter from the installed package: one event file (tests/tensorboard reads such
# files with protobuf's own parser).
events=("$tmp/alone/tb"/events.out.tfevents.*)
[ ${#events[@]} -eq 1 ] && [ -s "${events[0]}" ] || fail "alone: no TensorBoard event file in $tmp/alone/tb"

# Two ranks on 127.0.0.1: rank 0 hosts the store on a fixed port (fixed_port_candidate), told to both.
# start_rank DIR PORT RANK FLAGS...: one rank in DIR, its log in DIR/rank<RANK>.log.
start_rank() {
  local dir=$1 port=$2 rank=$3
  shift 3
  (cd "$dir" && RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
     exec timeout 120 "$consumer" "$@" >"rank$rank.log" 2>&1) &
  pids[$rank]=$!
}
# Stops whatever is left of the ranks started (after a port was taken).
stop_ranks() {
  local pid
  for pid in "${pids[@]}"; do pkill -KILL -P "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  pids=()
}
# Waits for both ranks: returns 98 when rank 0 did not exit $1 and its log says its port was taken
# (rank 1, waiting for a store that is not there, is stopped), fails unless each exited $1 otherwise.
wait_two() {
  local want=$1 dir=$2 i rc
  for i in 0 1; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    if [ "$rc" -ne "$want" ]; then
      if [ "$i" -eq 0 ] && port_taken "$dir/rank0.log"; then
        stop_ranks
        return 98
      fi
      echo "rank $i exited $rc, expected $want:"
      tail -n 20 "$dir/rank$i.log"
      fail "$(basename "$dir")"
    fi
  done
  pids=()
}
# run_two WANT DIR FLAGS...: both ranks in DIR with FLAGS, each to exit WANT; again on a fresh port
# while rank 0's port was taken.
two_on_port() {
  local port=$1 want=$2 dir=$3
  shift 3
  pids=()
  start_rank "$dir" "$port" 0 "$@"
  start_rank "$dir" "$port" 1 "$@"
  wait_two "$want" "$dir"
}
run_two() {
  with_fresh_port two_on_port "$@" || fail "$(basename "$2"): exit $? (98: rank 0's port was taken 8 times in a row)"
}
# Global step of rank 0's last progress line in $1.
last_step() {
  sed -nE 's#^epoch ([0-9]+)/[0-9]+ step ([0-9]+)/([0-9]+) .*#\1 \2 \3#p' "$1" 2>/dev/null | tail -n 1 |
    awk '{ print ($1 - 1) * $3 + $2 }'
}
flags=(--epochs 3 --save-every-steps 4)

# Uninterrupted.
mkdir "$tmp/whole"
t=$(date +%s.%N)
run_two 0 "$tmp/whole" "${flags[@]}"
echo "2 ranks, uninterrupted: $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t }") s"
grep -q "2 rank(s), torchrun environment" "$tmp/whole/rank0.log" || fail "not 2 ranks from the torchrun variables"
grep -Eq '^epoch 3/3 step 32/32 loss' "$tmp/whole/rank0.log" || fail "uninterrupted: no last step line"
[ -s "$tmp/whole/model.pt" ] && [ -s "$tmp/whole/snapshot.pt" ] || fail "uninterrupted: no model.pt or snapshot.pt"

# Stopped mid-epoch 2 by a SIGTERM to rank 1 alone (it raises one itself after global step 42: the
# stop lands mid-run however loaded the machine): both ranks agree, save and exit 75.
mkdir "$tmp/stopped"
run_two 75 "$tmp/stopped" "${flags[@]}" --sigterm-after-step 42 --sigterm-rank 1
at=$(last_step "$tmp/stopped/rank0.log")
[ "$at" -gt 42 ] && [ "$at" -lt 64 ] || fail "stopped at global step $at, not soon after the SIGTERM at step 42"
[ -s "$tmp/stopped/snapshot.pt" ] || fail "stopped: no snapshot.pt"
[ ! -e "$tmp/stopped/model.pt" ] || fail "stopped: model.pt written by a run that did not finish"
mv "$tmp/stopped/rank0.log" "$tmp/stopped/stop0.log"
# The same command again: continues after step $at, ends with the same bytes.
run_two 0 "$tmp/stopped" "${flags[@]}"
first=$(sed -nE 's#^epoch ([0-9]+)/[0-9]+ step ([0-9]+)/([0-9]+) .*#\1 \2 \3#p' "$tmp/stopped/rank0.log" | head -n 1 |
        awk '{ print ($1 - 1) * $3 + $2 }')
[ "$first" -eq $((at + 1)) ] || fail "stopped at global step $at, the next run began at $first"
# The loop's own tracked value (best_loss) came back as the stopped run left it.
best=$(sed -nE 's#^epoch [0-9]+/[0-9]+ done: .* best ([0-9.]+)$#\1#p' "$tmp/stopped/stop0.log" | tail -n 1)
grep -q "^continuing at epoch 2 after step $((at - 32)), best loss so far $best\$" "$tmp/stopped/rank0.log" ||
  fail "the resumed run does not continue at epoch 2 after step $((at - 32)) with best loss $best: $(grep continuing "$tmp/stopped/rank0.log")"
echo "2 ranks, SIGTERM to rank 1 at global step $at: both exited 75; the same command resumed at step $first"
compare() {
  cmp -s "$1" "$2" && return 0
  echo "$1 and $2 differ"
  if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
    /usr/bin/python3 - "$1" "$2" <<'EOF'
import sys, torch
a, b = (torch.load(p, map_location="cpu") for p in sys.argv[1:3])
for k in a:
    if k not in b or not torch.equal(a[k], b[k]):
        print(f"  {k} differs")
EOF
  fi
  return 1
}
compare "$tmp/whole/model.pt" "$tmp/stopped/model.pt" || fail "the resumed run's model.pt differs from the uninterrupted run's"
diff <(grep ' done: ' "$tmp/whole/rank0.log" | tail -n 1) <(grep ' done: ' "$tmp/stopped/rank0.log" | tail -n 1) ||
  fail "the last epoch's summary (loss, best loss) differs"
echo "the resumed run's model.pt is byte-identical to the uninterrupted run's"

# Whether process $1 listens on TCP port $2 itself (a LISTEN socket among its open files).
listens_on() {
  local pid=$1 hex inodes
  hex=$(printf '%04X' "$2")
  inodes=$(find "/proc/$pid/fd" -maxdepth 1 -lname 'socket:*' -printf '%l\n' 2>/dev/null | sed -nE 's/^socket:\[([0-9]+)\]$/\1/p')
  [ -n "$inodes" ] || return 1
  local tables=(/proc/net/tcp)
  [ -e /proc/net/tcp6 ] && tables+=(/proc/net/tcp6)
  awk -v hex="$hex" -v inodes="$inodes" '
    BEGIN { n = split(inodes, list, "\n"); for (i = 1; i <= n; i++) mine[list[i]] = 1 }
    FNR > 1 && $4 == "0A" && substr($2, length($2) - 3) == hex && ($10 in mine) { found = 1 }
    END { exit !found }' "${tables[@]}"
}
# A stop during start-up: rank 0 alone waits for rank 1 in the rendezvous (its SIGTERM handler
# installed, SigCgt in /proc says so, and listening on the port) and gets SIGTERM there. Rank 1,
# started before and held at its start (--wait-for-file, its libraries loaded), is let go at once
# and joins within the 2 s a stopped set-up waits for its peers; resume() agrees on the stop: both
# exit 75 before the first step and nothing is written.
early_on_port() {
  local port=$1 child
  rm -f "$tmp/early/go"
  pids=()
  start_rank "$tmp/early" "$port" 1 "${flags[@]}" --wait-for-file "$tmp/early/go"
  deadline=$((SECONDS + 90))
  until grep -q "^waiting for " "$tmp/early/rank1.log" 2>/dev/null; do
    [ $SECONDS -lt $deadline ] || fail "rank 1 never reached its start-up"
    sleep 0.05
  done
  start_rank "$tmp/early" "$port" 0 "${flags[@]}"
  deadline=$((SECONDS + 90))
  until child=$(pgrep -P "${pids[0]}") && grep -Eq '^SigCgt:.*[4-7c-f][0-9a-f]{3}$' "/proc/$child/status" 2>/dev/null &&
        listens_on "$child" "$port"; do
    if ! kill -0 "${pids[0]}" 2>/dev/null; then  # rank 0 ended before it listened: its port was taken?
      touch "$tmp/early/go"
      wait_two 75 "$tmp/early" || return $?
      fail "rank 0 ended before it listened on port $port, yet exited 75"
    fi
    [ $SECONDS -lt $deadline ] || fail "rank 0 never installed its SIGTERM handler and listened on port $port"
    sleep 0.05
  done
  kill -TERM "$child"
  touch "$tmp/early/go"
  wait_two 75 "$tmp/early"
}
mkdir "$tmp/early"
with_fresh_port early_on_port || fail "early stop: rank 0's port was taken 8 times in a row"
grep -q "stopped on request before the first step" "$tmp/early/rank0.log" || fail "early stop: no line saying so"
! grep -q '^epoch [0-9/]* step' "$tmp/early/rank0.log" || fail "a run stopped during start-up trained"
[ ! -e "$tmp/early/snapshot.pt" ] && [ ! -e "$tmp/early/model.pt" ] || fail "a run stopped during start-up wrote files"
echo "2 ranks, SIGTERM to rank 0 while it waited for rank 1: both exited 75 before the first step"

# Once more after the end: nothing to train, the same model.pt again.
cp "$tmp/stopped/model.pt" "$tmp/model.before"
run_two 0 "$tmp/stopped" "${flags[@]}"
! grep -q '^epoch [0-9/]* step' "$tmp/stopped/rank0.log" || fail "a finished run trained again"
compare "$tmp/model.before" "$tmp/stopped/model.pt" || fail "a finished run's model.pt changed"

# Python reads model.pt with a plain torch.load (when Debian's PyTorch is here).
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  /usr/bin/python3 -c '
import sys, torch
sd = torch.load(sys.argv[1])
assert list(sd) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], list(sd)
assert sd["fc1.weight"].shape == (64, 16), sd["fc1.weight"].shape
' "$tmp/whole/model.pt" || fail "Python cannot read model.pt"
  echo "Python's torch.load reads model.pt"
fi

if [ -n "$keep" ]; then
  mkdir -p "$(dirname "$keep")"
  cp "$consumer" "$keep.tmp"
  mv "$keep.tmp" "$keep"
  echo "consumer kept at $keep"
fi
echo "consumer: all checks passed"
