#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests: slurmctld on the host plus N slurmd
# "nodes" n1..nN, each in its own network namespace (a netns.sh lab) with its own hostname and
# /etc/hosts, all sharing this filesystem (so programs under test run on the nodes as they are).
# Everything (munged, config, state, spool, logs, pid files) lives in one temp dir; slurmctld's port
# is drawn below the ephemeral range and drawn again if slurmctld finds it taken; `down` (or the
# death of the owner process) removes it all.
#
# Usage:
#   slurm.sh check                            exit 0 if a cluster can be made here, else say why
#   slurm.sh up N [--gpus K] [--cpus C] [--owner PID]
#                                             start it; print KEY=VALUE lines: SLURM_CONF, LAB_*
#   slurm.sh down DIR|PREFIX                  stop and remove it (idempotent)
#   slurm.sh run N [options] -- CMD...        up, run CMD with SLURM_CONF and LAB_* exported, down
#
# Then, e.g.:  SLURM_CONF=... srun -N2 hostname   |   sbatch --wait job.sh   |   salloc -N3 srun -w n2,n3 ...
# Fake GPUs (--gpus K): K character devices with NVIDIA's major number and a gres.conf, so
# `--gpus-per-node=K` sets SLURM_GPUS_ON_NODE and CUDA_VISIBLE_DEVICES like on a GPU cluster.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NETNS="$HERE/netns.sh"
STATE_ROOT=${CTORCH_LAB_STATE:-/run/ctorch-lab}
export CTORCH_LAB_STATE=$STATE_ROOT

die() { echo "slurm.sh: $*" >&2; exit 1; }
# shellcheck source=common.sh
. "$HERE/common.sh"
# shellcheck source=../lib/ports.sh
. "$HERE/../lib/ports.sh"

cmd_check() {
  local why
  why=$("$NETNS" check) || { echo "$why"; exit 1; }
  local c
  for c in slurmctld slurmd srun sbatch salloc sinfo munged mknod; do
    command -v "$c" >/dev/null || { echo "'$c' is not installed (scripts/setup.sh installs slurm and munge)"; exit 1; }
  done
  exit 0
}

# A TCP port for a daemon: 10000-19999, below Linux's ephemeral range (where a client's outgoing
# connection could take it before the daemon binds), below fixed_port_candidate's default range and
# contract::slurmDerivedPort's (20000-31999), and not one another lab holds. Nobody checks that it is
# free (that would be a race): slurmctld says so when it is not, and `up` draws another.
lab_port() {
  local p tries
  for tries in $(seq 1 100); do
    p=$(fixed_port_candidate 10000 19999) || exit 1
    grep -qx "$p" "$STATE_ROOT"/*/ports 2>/dev/null || { echo "$p"; return 0; }
  done
  die "100 ports in 10000-19999 drawn, all held by other labs"
}

# start_slurmctld DIR LAB PORT: slurmctld on this machine (reachable from the nodes at .254) under the
# name "ctl"; returns once it listens on PORT, 98 when it found PORT taken (it is stopped then, its logs
# kept as *.port-taken), 1 when it died or did not listen within 60 s.
start_slurmctld() {
  local dir=$1 p=$2 port=$3
  SLURM_CONF="$dir/slurm.conf" setsid unshare --uts --mount -- sh -c \
    'mount --bind "$1" /etc/hosts && hostname ctl && exec slurmctld -D -i' \
    sh "$STATE_ROOT/$p/hosts" </dev/null >>"$dir/log/slurmctld.out" 2>&1 &
  local pid=$! tries=0
  echo "$pid" >"$dir/run/slurmctld.launcher.pid"
  until ss -Htlnp "sport = :$port" 2>/dev/null | grep -q '"slurmctld"'; do
    if port_taken "$dir/log/slurmctld.log" "$dir/log/slurmctld.out"; then
      kill_pidfile "$dir/run/slurmctld.launcher.pid" || true
      kill_pidfile "$dir/run/slurmctld.pid" || true
      local f
      for f in "$dir/log/slurmctld.log" "$dir/log/slurmctld.out"; do [ ! -e "$f" ] || mv "$f" "$f.port-taken"; done
      return 98
    fi
    if ! kill -0 "$pid" 2>/dev/null || [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ]; then
      echo "slurm.sh: slurmctld exited before it listened on port $port:" >&2
      tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmctld.out" >&2 2>/dev/null || true
      return 1
    fi
    tries=$((tries + 1))
    if [ $tries -gt 600 ]; then
      echo "slurm.sh: slurmctld does not listen on port $port after 60 s" >&2
      return 1
    fi
    sleep 0.1
  done
}

wait_idle() {  # DIR N: until every node is idle (bounded)
  local dir=$1 n=$2 tries=0 states
  while :; do
    states=$(SLURM_CONF="$dir/slurm.conf" sinfo -h -N -o '%N %T' 2>/dev/null || true)
    [ "$(grep -c ' idle$' <<<"$states" || true)" -eq "$n" ] && return 0
    tries=$((tries + 1))
    if [ $tries -gt 300 ]; then
      echo "slurm.sh: nodes not idle after 30 s:" >&2
      echo "$states" >&2
      tail -n 20 "$dir"/log/*.log >&2 || true
      return 1
    fi
    sleep 0.1
  done
}

cmd_up() {
  local n=${1:-}; shift || true
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 32 ] || die "up: number of nodes must be 1..32, not '$n'"
  local gpus=0 cpus=4 owner_pid=$PPID
  while [ $# -gt 0 ]; do
    case $1 in
      --gpus) gpus=${2:?}; shift 2 ;;
      --cpus) cpus=${2:?}; shift 2 ;;
      --owner) owner_pid=${2:?}; shift 2 ;;
      *) die "up: unknown option '$1'" ;;
    esac
  done
  [[ "$gpus" =~ ^[0-9]+$ ]] && [ "$gpus" -le 16 ] || die "up: --gpus must be 0..16, not '$gpus'"
  [[ "$cpus" =~ ^[0-9]+$ ]] && [ "$cpus" -ge 1 ] || die "up: --cpus must be a positive number, not '$cpus'"

  local lab p s
  lab=$("$NETNS" up "$n" --owner "$owner_pid") || die "up: could not create the network lab"
  p=$(sed -n 's/^LAB_PREFIX=//p' <<<"$lab")
  s=$(sed -n 's/^LAB_SUBNET=//p' <<<"$lab")
  local dir
  # munged insists that every directory above its socket is searchable by all (711), so not
  # $TMPDIR (often private); the nodes share this filesystem anyway.
  dir=$(mktemp -d "${CTORCH_LAB_TMP:-/tmp}/ctorch-slurm.XXXXXX")
  chmod 711 "$dir"
  echo "$p" >"$dir/lab"
  # netns.sh down (and its owner watcher) stops this cluster first.
  echo "$dir" >"$STATE_ROOT/$p/slurm"
  trap 'cmd_down "$dir" >/dev/null 2>&1 || true; exit 1' ERR INT TERM HUP

  mkdir -p "$dir/munge" "$dir/state" "$dir/log" "$dir/run" "$dir/dev"
  chmod 711 "$dir/munge"
  local i
  for i in $(seq 1 "$n"); do mkdir -p "$dir/spool/n$i"; done

  # munge: a private daemon with a fresh key; Slurm finds it through AuthInfo=socket=.
  head -c 1024 /dev/urandom >"$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"
  setsid munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --log-file="$dir/log/munged.log" --pid-file="$dir/munge/munged.pid" --seed-file="$dir/munge/seed" \
    </dev/null >>"$dir/log/munged.log" 2>&1
  local tries=0
  until [ -S "$dir/munge/munge.socket" ]; do
    tries=$((tries + 1)); [ $tries -le 100 ] || die "up: munged did not start (see $dir/log/munged.log)"
    sleep 0.05
  done

  local gres_node=""
  if [ "$gpus" -gt 0 ]; then
    for i in $(seq 0 $((gpus - 1))); do mknod "$dir/dev/nvidia$i" c 195 "$i"; done
    echo "Name=gpu File=$dir/dev/nvidia[0-$((gpus - 1))]" >"$dir/gres.conf"
    gres_node="Gres=gpu:$gpus"
  else
    : >"$dir/gres.conf"
  fi

  # slurmd listens inside each node's namespace (no other process there); slurmctld in this one, where
  # anything may hold a port: drawn again (and the configuration rewritten) when it is taken.
  local ctl_port slurmd_port attempt rc=98
  for attempt in 1 2 3 4 5 6 7 8; do
    ctl_port=$(lab_port)
    slurmd_port=$(lab_port)
    printf '%s\n' "$ctl_port" "$slurmd_port" >"$STATE_ROOT/$p/ports"
    write_slurm_conf
    rc=0
    start_slurmctld "$dir" "$p" "$ctl_port" || rc=$?
    [ $rc -eq 98 ] || break
    echo "slurm.sh: slurmctld's port $ctl_port was taken (attempt $attempt of 8)" >&2
  done
  [ $rc -eq 0 ] || die "up: slurmctld did not start (logs in $dir/log)"
  local daemons=("$(cat "$dir/run/slurmctld.launcher.pid")")
  for i in $(seq 1 "$n"); do
    SLURM_CONF="$dir/slurm.conf" setsid "$NETNS" exec "$p" "$i" slurmd -D -N "n$i" \
      </dev/null >>"$dir/log/slurmd-n$i.out" 2>&1 &
    daemons+=($!)
  done
  wait_idle "$dir" "$n" || die "up: cluster did not come up (logs in $dir/log)"
  # Out of our process group before we exit (wait_idle took long enough; this makes it certain).
  local pid
  for pid in "${daemons[@]}"; do wait_own_session "$pid"; done
  trap - ERR INT TERM HUP

  echo "SLURM_CONF=$dir/slurm.conf"
  echo "LAB_SLURM_DIR=$dir"
  echo "LAB_SLURM_NODES=n[1-$n]"
  echo "LAB_SLURM_GPUS=$gpus"
  echo "$lab"
}

# write_slurm_conf: $dir/slurm.conf from cmd_up's variables (dir, p, s, n, cpus, ctl_port, slurmd_port,
# gres_node).
write_slurm_conf() {
  cat >"$dir/slurm.conf" <<EOF
# Written by scripts/lab/slurm.sh for lab $p; everything lives under $dir.
ClusterName=$p
SlurmctldHost=ctl($s.254)
SlurmctldPort=$ctl_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SlurmdTimeout=10
KillWait=2
MinJobAge=5
InactiveLimit=0
GresTypes=gpu
NodeName=n[1-$n] NodeAddr=$s.[1-$n] NodeHostname=n[1-$n] CPUs=$cpus RealMemory=4000 $gres_node State=UNKNOWN
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  if [ "$n" -eq 1 ]; then
    sed -i "s/^NodeName=n\[1-1\] NodeAddr=$s.\[1-1\] NodeHostname=n\[1-1\]/NodeName=n1 NodeAddr=$s.1 NodeHostname=n1/" "$dir/slurm.conf"
  fi
}

kill_pidfile() {  # FILE: SIGKILL the pid in FILE and wait (bounded) until it is gone
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 0
  [ -n "$pid" ] || return 0
  kill -9 "$pid" 2>/dev/null || return 0
  local tries=0
  while kill -0 "$pid" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; do
    tries=$((tries + 1)); [ $tries -le 100 ] || return 1
    sleep 0.02
  done
}

cmd_down() {
  local arg=${1:?down: DIR or lab prefix required} dir p
  if [ -d "$arg" ]; then
    dir=$arg
  else
    dir=$(cat "$STATE_ROOT/$arg/slurm" 2>/dev/null) || { "$NETNS" down "$arg"; return; }
  fi
  p=$(cat "$dir/lab" 2>/dev/null || true)
  # Unhook first so that netns.sh down does not call back here.
  [ -n "$p" ] && rm -f "$STATE_ROOT/$p/slurm"
  local status=0
  kill_pidfile "$dir/run/slurmctld.launcher.pid" || status=1
  kill_pidfile "$dir/run/slurmctld.pid" || status=1
  # slurmd, slurmstepd and every job step run inside the namespaces: netns.sh kills them all.
  if [ -n "$p" ]; then "$NETNS" down "$p" || status=1; fi
  kill_pidfile "$dir/munge/munged.pid" || status=1
  case $dir in
    */ctorch-slurm.*) rm -rf "$dir" ;;
    *) echo "slurm.sh: not removing unexpected directory '$dir'" >&2; status=1 ;;
  esac
  return $status
}

cmd_run() {
  local n=${1:?run: number of nodes required}; shift
  local opts=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  [ $# -gt 0 ] || die "run: no command given"
  local out
  out=$(cmd_up "$n" "${opts[@]}" --owner $$) || exit 1
  run_in_lab "$out" 'cmd_down "$LAB_SLURM_DIR"' "$@"
}

main() {
  local cmd=${1:-}; shift || true
  case $cmd in
    check) cmd_check ;;
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    run) cmd_run "$@" ;;
    ""|-h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
    *) die "unknown command '$cmd' (see: slurm.sh --help)" ;;
  esac
}

main "$@"
