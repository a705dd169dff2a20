#!/usr/bin/env bash
# Runs a command on a busy machine (issue 57): N busy loops per core and, with --churn, the port
# churner (scripts/port-churn.py: loopback connections opened and closed as fast as it can, the
# kernel's ephemeral ports in constant use) beside it; stops them when the command ends, however it
# ends, and says what ran beside it. The command's exit status is this script's.
#   scripts/with-load.sh [--busy-per-core N] [--churn] [--churn-procs P] [--busy-after FILE] -- COMMAND [ARGS...]
# Defaults: 2 busy loops per core, no churner. --busy-after FILE: other work already keeps the cores
# busy (CI: the modern lane's build and the fuzz targets' compile, started beside this), and the busy
# loops only top it up: they start when FILE exists (that work wrote it when it ended). Used by scripts/load-guard.sh (CI) and for the suite's
# proof under load (docs/testing.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
per_core=2
churn=0
churn_procs=1
busy_after=
while [ $# -gt 0 ]; do
  case $1 in
    --busy-per-core) per_core=$2; shift 2 ;;
    --churn) churn=1; shift ;;
    --churn-procs) churn=1; churn_procs=$2; shift 2 ;;
    --busy-after) busy_after=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "with-load: unknown option '$1' (--busy-per-core N, --churn, --churn-procs P, --busy-after FILE, then -- COMMAND)" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "with-load: no command (usage: scripts/with-load.sh [options] -- COMMAND...)" >&2; exit 2; }
case $per_core in ''|*[!0-9]*) echo "with-load: --busy-per-core '$per_core' is not a whole number" >&2; exit 2 ;; esac
case $churn_procs in ''|*[!0-9]*|0) echo "with-load: --churn-procs '$churn_procs' is not a positive whole number" >&2; exit 2 ;; esac

python=/usr/bin/python3
[ -x "$python" ] || python=$(command -v python3 || true)
[ "$churn" -eq 0 ] || [ -n "$python" ] || { echo "with-load: --churn needs python3" >&2; exit 2; }

loops=$(( per_core * $(nproc) ))
pids=()
churn_log=$(mktemp)
stop() {
  [ ${#pids[@]} -eq 0 ] || kill -TERM "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  pids=()
}
trap 'stop; rm -f "$churn_log"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
busy_loops() {
  for _ in $(seq "$loops"); do
    ( trap 'exit 0' TERM; while :; do :; done ) &
    pids+=($!)
  done
}
if [ -z "$busy_after" ]; then
  busy_loops
else
  # The loops wait for FILE in one process; it starts them (its children, stopped with it).
  (
    trap 'kill -TERM $(jobs -p) 2>/dev/null; wait; exit 0' TERM
    while [ ! -e "$busy_after" ]; do sleep 1 & wait $!; done
    echo "with-load: $(date +%T) $busy_after is there: $loops busy loops start"
    pids=()
    busy_loops
    wait
  ) &
  pids+=($!)
fi
if [ "$churn" -eq 1 ]; then
  "$python" "$root/scripts/port-churn.py" --procs "$churn_procs" >"$churn_log" 2>&1 &
  pids+=($!)
fi
start=$(date +%s)
status=0
"$@" || status=$?
took=$(( $(date +%s) - start ))
stop
beside="$loops busy loops ($per_core per core)"
[ -z "$busy_after" ] || beside="$beside once $busy_after was there (other work before it)"
if [ "$churn" -eq 1 ]; then
  beside="$beside and the port churner ($(tail -n 3 "$churn_log" | tr '\n' ' ' | sed 's/  */ /g'))"
fi
echo "with-load: '$*' exited $status after $took s with $beside beside it"
exit $status
